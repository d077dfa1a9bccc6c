"""``ethen up --model PATH.gguf``: the model reaches the workers and the gateway's mesh provider, and a file
the loader refuses stops ``ethen up`` at step 1 with the reason, before any worker or the gateway starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ethen.gateway.config import parse_config
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf
from ethen.up_config import gateway_document


def test_the_gateway_document_names_the_model_path() -> None:
    doc = gateway_document("127.0.0.1", 8080, "k" * 40, {"a": "127.0.0.1:5001"}, model_path="/m/tiny.gguf")
    assert doc["providers"][0]["model_path"] == "/m/tiny.gguf"
    cfg = parse_config(doc)
    assert cfg.providers[0].model_path == "/m/tiny.gguf"  # type: ignore[union-attr]
    default = gateway_document("127.0.0.1", 8080, "k" * 40, {"a": "127.0.0.1:5001"})
    assert "model_path" not in default["providers"][0]


def test_an_unsupported_model_stops_ethen_up_with_the_reason(tmp_path: Path) -> None:
    # TQ2_0: a type neither engine reads (Q5_1, used here before, now runs on the ggml engine)
    path = write_tiny_gguf(tmp_path / "m.gguf", TinySpec(types=("F16", "TQ2_0")))
    env = {**os.environ, "ETHEN_DATA_DIR": str(tmp_path / "data"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "ethen", "up", "--port", "0", "--model", str(path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "has type TQ2_0, which is not supported" in out.stderr
    assert "[2/4]" not in out.stderr  # no worker was started
    root = tmp_path / "cache" / "ethen"  # $XDG_CACHE_HOME/ethen
    assert not root.exists() or list(root.iterdir()) == []
