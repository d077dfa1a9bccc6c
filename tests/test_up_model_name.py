"""``ethen up --model X.gguf`` serves the route under the GGUF's own model id (issue 13): ``/models`` lists
the slug of its ``general.name``, ``ethen/auto`` routes to it, and the receipt's mesh part names the file
and the name. The default SmolLM2 file keeps ``smollm2-135m-instruct``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ethen.gateway.catalog import Catalog
from ethen.gateway.config import build_pool, parse_config
from ethen.gateway.errors import GatewayConfigError
from ethen.gateway.providers.mesh import model_slug, served_model_id
from ethen.model import open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from ethen.up_config import gateway_document, mesh_route

NAME = "Tiny Llama Chat v0.1"
SLUG = "tiny-llama-chat-v0.1"


def test_model_slug() -> None:
    assert model_slug(NAME) == SLUG
    assert model_slug("Qwen2.5 0.5B Instruct (GGUF)") == "qwen2.5-0.5b-instruct-gguf"
    assert model_slug("  /// ") == "model"


def test_the_route_of_a_gguf_is_named_after_it_with_its_limits(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "t.gguf", TinySpec(name=NAME, context_length=512))
    store = open_weight_store(path)
    assert served_model_id(store) == SLUG
    route = mesh_route(store)
    assert route["model"] == SLUG and route["info"]["context_window"] == 512
    assert route["prices"] == {"input_per_mtok": 0.0, "output_per_mtok": 0.0}
    doc = gateway_document("127.0.0.1", 8080, "k" * 40, {"a": "127.0.0.1:5001"}, model_path=str(path),
                           route=route)
    (cand,) = build_pool(parse_config(doc), Catalog({}))
    assert (cand.model, cand.info.context_window, cand.info.supports_tools) == (SLUG, 512, False)
    assert cand.prices.input_per_mtok == cand.prices.output_per_mtok == 0.0
    # a mesh without model_path still serves only the default model
    del doc["providers"][0]["model_path"]
    with pytest.raises(GatewayConfigError, match="serves only 'smollm2-135m-instruct'"):
        parse_config(doc)


def test_the_default_gguf_keeps_its_id() -> None:
    store = open_weight_store()
    assert store.model_name != "smollm2-135m-instruct"  # its general.name is a training-run label
    assert served_model_id(store) == "smollm2-135m-instruct"
    assert mesh_route(store) == {"model": "smollm2-135m-instruct", "provider": "mesh"}


def test_ethen_up_with_a_gguf_serves_it_under_its_name(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", TinySpec(name=NAME))
    layout = tmp_path / "layout.toml"
    layout.write_text('[[workers]]\nnode_id = "a"\nlayers = "0-0"\n\n'
                      '[[workers]]\nnode_id = "b"\nlayers = "1-2"\n', encoding="utf-8")
    env = {**os.environ, "ETHEN_DATA_DIR": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for var in ("ETHEN_API_KEY", "ETHEN_ADMIN_KEY", "ETHEN_DATABASE_URL"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path),
                             "--layout", str(layout)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        for line in proc.stdout:  # bounded: EOF when the process exits, or the banner's last line
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops"):
                break
            assert time.monotonic() < deadline, lines
        m = re.search(r"^Ethen is up, ready in [0-9.]+ s since the command started: (\S+)$", "\n".join(lines),
                      re.M)
        assert m, "\n".join(lines)
        base = m.group(1)
        key = (tmp_path / "data" / "api_key").read_text().strip()
        auth = {"authorization": f"Bearer {key}"}
        with httpx.Client(timeout=120) as http:
            models = http.get(f"{base}/models", headers=auth).json()
            ids = [m["id"] for m in models["data"]]
            assert SLUG in ids and "smollm2-135m-instruct" not in ids
            r = http.post(f"{base}/chat/completions", headers=auth, json={
                "model": "ethen/auto", "temperature": 0, "max_tokens": 4,
                "messages": [{"role": "user", "content": "hello mesh"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == SLUG
        routing = body["ethen"]["routing"]
        assert routing["selected_model"] == SLUG and routing["selected_provider"] == "mesh"
        mesh = routing["mesh"]
        assert mesh["model_name"] == NAME and mesh["model_file"] == str(path.resolve())
        assert mesh["route"]["model"] == SLUG
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
