"""Issue 43 item 3, fewer knobs: the engine is chosen by ``--engine`` / ``--accuracy`` / ``--device`` only
(``$ETHEN_ENGINE`` is ``--engine``'s default), passed down as parameters; ``ETHEN_ACCURACY``,
``ETHEN_DEVICE`` and ``ETHEN_CACHE_DIR`` are no longer read (one warning line each), and the parent-death
plumbing between ``spawn_worker`` and its worker is hidden flags, not environment variables."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ethen.mesh.worker.launch import spawn_worker
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent / "ethen"
GONE = ("ETHEN_ACCURACY", "ETHEN_DEVICE", "ETHEN_ENGINE", "ETHEN_CACHE_DIR", "ETHEN_PARENT_PID",
        "ETHEN_PARENT_DEATHSIG")


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """Every string constant of a module but its docstrings (what code could look up in ``os.environ``)."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_no_module_of_the_model_or_the_mesh_names_an_engine_variable() -> None:
    """The choice travels as :class:`~ethen.model.choose.EngineOptions` and flags; the environment is read
    in the command-line entry points only (:mod:`ethen.knobs`)."""
    found = []
    for pkg in ("model", "mesh"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for line, text in _strings(ast.parse(path.read_text(encoding="utf-8"))):
                found += [f"{path.relative_to(ROOT)}:{line}: {var}" for var in GONE if var in text]
    assert found == []


def test_the_source_scan_sees_a_lookup() -> None:
    code = '"""ETHEN_DEVICE in a docstring is fine"""\nimport os\nx = os.environ.get("ETHEN_DEVICE")\n'
    assert [t for _, t in _strings(ast.parse(code)) if "ETHEN_" in t] == ["ETHEN_DEVICE"]


@pytest.fixture()
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small model (auto: onnxruntime) ggml also reads; the workers' cache under ``tmp_path``."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in GONE:
        monkeypatch.delenv(var, raising=False)
    return write_tiny_gguf(tmp_path / "m.gguf", TinySpec(types=("Q4_K",), embd_type="Q8_0", n_layers=2,
                                                         name="tiny knobs", quantizer="ggml"))


def _engine_of(path: Path, *flags: str) -> tuple[str, list[str]]:
    """The engine a real ``ethen worker`` process (started with ``flags``, this process's environment)
    loads its layers on, as it reports it; and its output."""
    w = spawn_worker("k", "0-1", extra_args=["--model", str(path), *flags], timeout_s=120)
    try:
        argv = Path(f"/proc/{w.pid}/cmdline").read_text().split("\0") if sys.platform == "linux" else []
        environ = Path(f"/proc/{w.pid}/environ").read_bytes() if sys.platform == "linux" else b""
    finally:
        w.stop()
    if sys.platform == "linux":  # the parent's pid travels as a hidden flag, not in the environment
        assert "--parent-pid" in argv and b"ETHEN_PARENT" not in environ, argv
    line = next(x for x in w.output if ": engine " in x)
    return line.split(": engine ", 1)[1].split(",", 1)[0], w.output


def test_the_worker_flags_decide_and_the_gone_variables_are_ignored(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_ACCURACY", "exact")  # would be onnx if read
    engine, out = _engine_of(tiny, "--accuracy", "fast")
    assert engine == "GgmlEngine", out
    assert sum("warning: ETHEN_ACCURACY is no longer read (ignored); use --accuracy" in x for x in out) == 1
    monkeypatch.setenv("ETHEN_ACCURACY", "fast")  # would be ggml if read
    monkeypatch.setenv("ETHEN_DEVICE", "vulkan")  # would be refused if read
    engine, out = _engine_of(tiny)
    assert engine == "Engine", out  # auto: a small model keeps onnxruntime's float32 compute
    assert any("warning: ETHEN_DEVICE is no longer read (ignored); use --device" in x for x in out), out


def test_ethen_engine_is_the_default_of_the_engine_flag(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETHEN_ENGINE", "ggml")
    assert _engine_of(tiny)[0] == "GgmlEngine"
    assert _engine_of(tiny, "--engine", "onnx")[0] == "Engine"  # the flag wins


def test_the_parent_flags_are_hidden_and_a_gone_cache_variable_warns(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in GONE}
    out = subprocess.run([sys.executable, "-m", "ethen", "worker", "--help"], capture_output=True, text=True,
                         timeout=120, env={**env, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "--accuracy" in out.stdout and "--parent-" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "ethen", "worker", "--node-id", "x", "--layers", "0-1",
                          "--accuracy", "exact-int4"], capture_output=True, text=True, timeout=120,
                         env={**env, "ETHEN_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 2
    assert "warning: ETHEN_CACHE_DIR is no longer read (ignored); use XDG_CACHE_HOME" in out.stderr
    assert "--accuracy 'exact-int4': must be one of auto, exact, fast" in out.stderr


def test_the_mesh_provider_carries_the_heads_choice() -> None:
    """``ethen up`` writes the flags other than ``auto`` into its mesh provider (the head's engine, loaded by
    the gateway); a bad value there is a config error naming the key and the value."""
    from ethen.gateway.config import parse_config
    from ethen.gateway.errors import GatewayConfigError
    from ethen.model.choose import EngineOptions
    from ethen.up_config import gateway_document

    doc = gateway_document("127.0.0.1", 8080, "sk-ethen-test", {"a": "127.0.0.1:1"},
                           engine_options=EngineOptions(accuracy="fast", device="cpu"))
    mesh = doc["providers"][0]
    assert (mesh["accuracy"], mesh["device"]) == ("fast", "cpu") and "engine" not in mesh
    p = parse_config(doc).providers[0]
    assert (p.engine, p.accuracy, p.device) == ("auto", "fast", "cpu")  # type: ignore[union-attr]
    mesh["accuracy"] = "int4"
    with pytest.raises(GatewayConfigError, match=r"accuracy.*int4"):
        parse_config(doc)
