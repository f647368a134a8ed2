"""Shared fixtures: real servers on 127.0.0.1 (simulated backend, moto S3), one per test session."""

from __future__ import annotations

import pytest

pytest_plugins = [
    "fixtures_dask",
    "fixtures_net",
    "fixtures_nemo_gym",
    "fixtures_netns",
    "fixtures_prefect",
    "fixtures_runs",
    "fixtures_s3",
    "fixtures_sim",
    "fixtures_vllm",
    "local_http",
]

# Modules whose tests check what was written and said, never a rate, a duration or a deadline: `make test`
# runs them two at a time (pytest-xdist, a file per worker), the rest one at a time on a quiet machine.
# A module that times anything stays off this list.
CONCURRENT = {
    "test_chunk_data",
    "test_cli",
    "test_cli_text",
    "test_consistency",
    "test_deploy",
    "test_docs",
    "test_diagnosis_reuse",
    "test_errors",
    "test_input_sources",
    "test_lease_scope",
    "test_local_server",
    "test_math_verifier",
    "test_nemo_gym_dropin",
    "test_paths",
    "test_pipeline_e2e",
    "test_probe_accounting",
    "test_progress_artifact",
    "test_publish_files",
    "test_redaction",
    "test_replicas_cli",
    "test_report_figures",
    "test_resume",
    "test_reverify_sources",
    "test_rewards_report",
    "test_rollout_counts",
    "test_row_values",
    "test_rows",
    "test_schedules",
    "test_seed",
    "test_serve",
    "test_settings_sources",
    "test_sigterm",
    "test_startup",
    "test_storage",
    "test_storage_lost",
    "test_trust",
    "test_trust_replies",
    "test_ui",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # A test that measures a rate in a module of the list says so with `alone` and runs one at a time.
        listed = item.module is not None and item.module.__name__ in CONCURRENT
        if listed and not item.get_closest_marker("alone"):
            item.add_marker(pytest.mark.concurrent)
