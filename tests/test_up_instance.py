"""``ethen up`` checks everything before it starts anything, owns its data directory, and its key belongs to a
project (issue 42, items 3, 5, 7, 11 and 13).

One real ``ethen up --config OVERLAY`` (real model, three workers) in a temporary data directory, its overlay
adding a scripted cloud provider on loopback (tests/gateway/upstream.py) that ``ethen/auto`` prefers and a
``[[shadows]]`` rule: the banner's Python example runs as printed while that provider serves, the banner
names the dashboard, the generated key's requests show under project ``default``, a second ``ethen up`` on
the same data directory (or one with a bad ``--port``) leaves the running one's config byte-identical, and
``ethen shadows promote --config OVERLAY`` takes the overlay. Cheaper processes (no model loaded) cover a
bad ``--port`` or ``--config`` on their own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ethen.gateway.config import load_overlay, parse_config, parse_overlay, read_overlay, stand_in_document
from ethen.gateway.errors import GatewayConfigError
from tests.gateway.upstream import Behavior, Script, ServerThread, make_upstream_app
from tests.test_up import Up, _env

PROVIDER_KEY = "sk-upstream-not-a-secret"
CANDIDATE = "alpha/alpha-shadow"


def _overlay(upstream: str) -> str:
    return f"""
[[providers]]
id = "alpha"
kind = "openai_compat"
base_url = "{upstream}/v1"
api_key_env = "ALPHA_KEY"

[[routes]]  # better than the mesh on every count: ethen/auto prefers it
model = "alpha-fast"
provider = "alpha"
upstream_model = "up-alpha-fast"
prices = {{ input_per_mtok = 0.0, output_per_mtok = 0.0 }}
[routes.info]
context_window = 128000
max_output_tokens = 8000
quality = 1.0
latency_ms = 50.0
ttft_ms = 20.0

[[routes]]
model = "alpha-shadow"
provider = "alpha"
upstream_model = "up-alpha-shadow"
prices = {{ input_per_mtok = 5.0, output_per_mtok = 5.0 }}
[routes.info]
context_window = 128000
max_output_tokens = 8000
quality = 0.2
latency_ms = 900.0
ttft_ms = 500.0

[[shadows]]
alias = "ethen/auto"
candidate = "{CANDIDATE}"
percent = 100
project = "default"
min_samples = 1
min_success_rate = 0.5
"""


class Upstream:
    def __init__(self) -> None:
        script = Script(behaviors={"up-alpha-fast": Behavior(pieces=("Paris", " it is")),
                                   "up-alpha-shadow": Behavior(pieces=("Paris",))})
        self.server = ServerThread(make_upstream_app(script))
        self.script = script


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Path]]:
    tmp = tmp_path_factory.mktemp("up_overlay")
    up_stream = Upstream()
    with up_stream.server as server:
        overlay = tmp / "my.toml"
        overlay.write_text(_overlay(server.url), encoding="utf-8")
        u = Up(tmp, "--config", str(overlay), ALPHA_KEY=PROVIDER_KEY)
        try:
            yield u, overlay
        finally:
            u.close()


def _run_up(data: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ethen", "up", *args], capture_output=True, text=True,
                          env=_env(data, ALPHA_KEY=PROVIDER_KEY), timeout=timeout)


def test_the_banner_python_example_runs_as_printed_when_a_cloud_route_serves(cloud: tuple[Up, Path]) -> None:
    up, _ = cloud
    script = up.block(f"{sys.executable} - <<'PY'", "PY")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Paris it is", "served by alpha/alpha-fast"], out.stdout


def test_the_banner_names_the_dashboard_and_its_sign_in(cloud: tuple[Up, Path]) -> None:
    up, _ = cloud
    root = up.base.rsplit("/api/", 1)[0]
    (line,) = [ln for ln in up.lines if ln.startswith("Dashboard: ")]
    assert line == f"Dashboard: {root}/ui  (sign in with the admin key above)", line
    assert up.admin_key in up.text
    with httpx.Client(base_url=root, timeout=30) as client:
        assert 'name="csrf-token"' not in client.get("/ui").text  # the sign-in form
        r = client.post("/ui/login", data={"admin_key": up.admin_key})  # as the banner says
        assert r.status_code < 400 and "ethen_session" in client.cookies, r.text
        page = client.get("/ui", follow_redirects=True)
        assert page.status_code == 200 and 'name="csrf-token"' in page.text  # the dashboard itself


def test_the_generated_key_belongs_to_project_default_and_shows_in_usage(cloud: tuple[Up, Path]) -> None:
    up, _ = cloud
    assert up.key.startswith("ethen_") and "API key (project 'default', generated now into" in up.text
    key_id = up.key.split("_")[1]
    r = httpx.post(f"{up.base}/chat/completions", timeout=120, headers={"authorization": f"Bearer {up.key}"},
                   json={"model": "alpha-fast", "max_tokens": 8,
                         "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    out = up.ethen("usage")
    assert out.returncode == 0, out.stderr
    rows = [(row["project"], row["provider"], row["model"]) for row in json.loads(out.stdout)["data"]
            if row["key_id"] == key_id]
    assert ("default", "alpha", "alpha-fast") in rows, out.stdout
    api = httpx.get(f"{up.admin_base}/usage", params={"project": "default"}, timeout=30,
                    headers={"authorization": f"Bearer {up.admin_key}"})
    assert api.status_code == 200, api.text
    data = api.json()["data"]
    assert any(row["key_id"] == key_id and row["model"] == "alpha-fast" for row in data), api.text


def test_a_second_ethen_up_on_the_data_directory_is_refused(cloud: tuple[Up, Path]) -> None:
    up, _ = cloud
    written = (up.data / "up-gateway.toml").read_bytes()
    t0 = time.monotonic()
    out = _run_up(up.data, "--port", "0")
    assert out.returncode == 1, out.stderr
    assert f"another `ethen up` (pid {up.proc.pid}) runs on the data directory {up.data}" in out.stderr
    assert "ETHEN_DATA_DIR=OTHER_DIR" in out.stderr
    assert "[1/4]" not in out.stderr and time.monotonic() - t0 < 30
    assert (up.data / "up-gateway.toml").read_bytes() == written
    second = _run_up(up.data, "--port", "70000")  # issue 42 item 3's exact case
    assert second.returncode == 2 and "--port" in second.stderr and "65535" in second.stderr, second.stderr
    assert (up.data / "up-gateway.toml").read_bytes() == written
    r = httpx.get(f"{up.base}/models", headers={"authorization": f"Bearer {up.key}"}, timeout=30)
    assert r.status_code == 200  # the running one still serves


def test_shadows_promote_takes_the_ethen_up_overlay(cloud: tuple[Up, Path]) -> None:
    up, overlay = cloud
    before = overlay.read_text(encoding="utf-8")
    deadline = time.monotonic() + 60
    while True:  # the banner's example (and the usage test) went to ethen/auto: their shadow pairs land
        body = {"model": "ethen/auto", "max_tokens": 8,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        r = httpx.post(f"{up.base}/chat/completions", timeout=120, json=body,
                       headers={"authorization": f"Bearer {up.key}"})
        assert r.status_code == 200, r.text
        listed = up.ethen("shadows", "--json", "--config", str(overlay))
        assert listed.returncode == 0, listed.stderr
        if any(d["promotable"] for d in json.loads(listed.stdout)["data"]):
            break
        assert time.monotonic() < deadline, listed.stdout
        time.sleep(0.5)
    out = up.ethen("shadows", "promote", "--config", str(overlay), "--alias", "ethen/auto",
                   "--candidate", CANDIDATE, "--percent", "1")
    assert out.returncode == 0, out.stderr
    assert f"written to {overlay}" in out.stdout
    after = overlay.read_text(encoding="utf-8")
    assert after.startswith(before) and "[[canaries]]" in after[len(before):]
    cfg = load_overlay(overlay)
    assert [(c.alias, c.candidate, c.percent) for c in cfg.canaries] == [("ethen/auto", CANDIDATE, 1)]


# -- cheap: no model, no worker ------------------------------------------------------------------------------

def _existing(tmp_path: Path) -> tuple[Path, bytes]:
    data = tmp_path / "data"
    data.mkdir()
    written = b"# the config of a running ethen up\n[server]\nport = 8080\n"
    (data / "up-gateway.toml").write_bytes(written)
    return data, written


def test_an_out_of_range_port_fails_before_anything(tmp_path: Path) -> None:
    data, written = _existing(tmp_path)
    out = _run_up(data, "--port", "70000")
    assert out.returncode == 2, out.stderr
    assert "--port" in out.stderr and "65535" in out.stderr, out.stderr
    assert "[1/4]" not in out.stderr and "worker" not in out.stderr
    assert (data / "up-gateway.toml").read_bytes() == written


def test_a_bad_overlay_fails_before_anything_naming_the_key(tmp_path: Path) -> None:
    data, written = _existing(tmp_path)
    overlay = tmp_path / "bad.toml"
    overlay.write_text('[[routes]]\nmodel = "gpt-x"\nprovider = "opneai"\n', encoding="utf-8")
    t0 = time.monotonic()
    out = _run_up(data, "--port", "0", "--config", str(overlay))
    assert out.returncode == 2, out.stderr
    assert f"--config {overlay}" in out.stderr, out.stderr
    assert "routes[1].provider = 'opneai': unknown provider" in out.stderr, out.stderr
    assert "[1/4]" not in out.stderr and "worker" not in out.stderr
    assert time.monotonic() - t0 < 30
    assert (data / "up-gateway.toml").read_bytes() == written
    assert sorted(p.name for p in data.iterdir()) == ["up-gateway.toml"]  # no key, no lock, no database


def test_an_overlay_parses_merged_as_ethen_up_merges_it(tmp_path: Path) -> None:
    overlay = {"server": {"port": 1}, "routes": [{"model": "smollm2-135m-instruct", "provider": "mesh",
                                                  "catalog_model": "smollm2-135m-instruct"}]}
    with pytest.raises(GatewayConfigError, match="duplicate provider/model route"):
        parse_overlay(overlay, source="my.toml")
    ok = parse_overlay({"server": {"port": 1}, "policy": {"allowed_providers": ["mesh"]}}, source="my.toml")
    assert ok.server.port == 8080 and ok.store is not None and ok.policy.allowed_providers == ["mesh"]
    with pytest.raises(GatewayConfigError, match="api_keys: required key is missing"):
        parse_config({k: v for k, v in stand_in_document().items() if k != "api_keys"})
    path = tmp_path / "o.toml"
    path.write_text("[policy\n", encoding="utf-8")
    with pytest.raises(GatewayConfigError, match="not valid TOML"):
        read_overlay(path)
