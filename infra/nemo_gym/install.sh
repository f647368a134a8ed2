#!/usr/bin/env bash
# NeMo Gym 0.7.0 in its own venv (Python 3.13, which rollflow's 3.11 venv cannot host), for the tests that
# start a real NeMo Gym stack (infra/nemo_gym/stack.py). Idempotent: a stamp file makes a second call
# return at once; a lock makes parallel callers (pytest-xdist workers) wait for one install.
# Prints the venv's path as its only line on stdout; pip's output goes to stderr.
#
#   ROLLFLOW_NEMO_GYM_VENV   where the venv goes (default ~/.cache/rollflow/nemo-gym-0.7.0)
#   ROLLFLOW_NEMO_GYM_PYTHON the Python 3.13 to build it with (default: pyenv's 3.13.0)
set -euo pipefail

VERSION=0.7.0
VENV="${ROLLFLOW_NEMO_GYM_VENV:-$HOME/.cache/rollflow/nemo-gym-$VERSION}"
STAMP="$VENV/.rollflow-nemo-gym-$VERSION.installed"

ready() { [[ -f "$STAMP" && -x "$VENV/bin/gym" && -x "$VENV/bin/ng_collect_rollouts" ]]; }

if ready; then
    echo "$VENV"
    exit 0
fi

find_python() {
    local candidates=()
    [[ -n "${ROLLFLOW_NEMO_GYM_PYTHON:-}" ]] && candidates+=("$ROLLFLOW_NEMO_GYM_PYTHON")
    candidates+=("/root/.pyenv/versions/3.13.0/bin/python" "${PYENV_ROOT:-$HOME/.pyenv}/versions/3.13.0/bin/python")
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)/versions/3.13.0/bin/python")
    fi
    local py
    for py in "${candidates[@]}"; do
        if [[ -x "$py" ]] && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 13))'; then
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
    echo "install.sh: no Python 3.13 found (set ROLLFLOW_NEMO_GYM_PYTHON, or: pyenv install 3.13.0)" >&2
    exit 1
}
echo "install.sh: building NeMo Gym $VERSION in $VENV with $PY" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
# nemo-gym 0.7.0 declares a narrower requires-python than the 3.13.0 it runs on here.
"$VENV/bin/python" -m pip install --quiet --ignore-requires-python "nemo-gym==$VERSION" >&2
"$VENV/bin/python" -c 'import importlib.metadata as m, sys; v = m.version("nemo-gym"); sys.exit(v != sys.argv[1])' "$VERSION"
touch "$STAMP"
echo "install.sh: NeMo Gym $VERSION ready in $VENV" >&2
echo "$VENV"
