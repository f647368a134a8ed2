"""Shared fixtures: real servers on 127.0.0.1 (simulated backend, moto S3), one per test session."""

pytest_plugins = [
    "fixtures_dask",
    "fixtures_net",
    "fixtures_netns",
    "fixtures_prefect",
    "fixtures_runs",
    "fixtures_s3",
    "fixtures_sim",
    "local_http",
]
