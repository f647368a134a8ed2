"""rollflow: maximum-throughput, resumable LLM rollout collection as Prefect flows.

The code lives in the top-level folders flows/, tasks/, settings/ and infra/, installed as the
subpackages rollflow.flows, rollflow.tasks, rollflow.settings and rollflow.infra (see pyproject.toml).
"""

__version__ = "0.1.0"
