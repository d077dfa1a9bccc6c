"""Workers and the orchestrator agree on the model file (issue 24): ``ethen worker`` reports the fingerprint
of its GGUF in Health (:mod:`ethen.mesh.model_id`), and the orchestrator routes nothing to a worker that
loaded another file, with one ERROR line naming the file the mesh serves."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from ethen.mesh.model_id import model_fingerprint
from ethen.mesh.orchestrator import Orchestrator
from ethen.mesh.worker.launch import WorkerProcess, spawn_worker
from ethen.model import SamplingParams, open_weight_store
from ethen.model.tiny_gguf import TinySpec, write_tiny_gguf


def test_the_fingerprint_tells_models_apart_and_reads_only_the_header(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", TinySpec(n_layers=2, name="model-a"))
    a2 = write_tiny_gguf(tmp_path / "a2.gguf", TinySpec(n_layers=2, name="model-a"))
    b = write_tiny_gguf(tmp_path / "b.gguf", TinySpec(n_layers=2, name="model-b"))
    c = write_tiny_gguf(tmp_path / "c.gguf", TinySpec(n_layers=3, name="model-a"))
    fa = model_fingerprint(a)
    assert fa.startswith("sha256:") and len(fa) == len("sha256:") + 64
    assert model_fingerprint(a2) == fa  # same bytes, another path
    assert len({fa, model_fingerprint(b), model_fingerprint(c)}) == 3  # name / layer count differ
    # the stated limit: a change inside the tensor data alone is not seen (the weights are not hashed)
    data = bytearray(a.read_bytes())
    data[-1] ^= 0xFF
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(bytes(data))
    assert model_fingerprint(flipped) == fa


def test_the_fingerprint_refuses_what_is_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        model_fingerprint(bad)
    a = write_tiny_gguf(tmp_path / "a.gguf", TinySpec(n_layers=1))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(a.read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated header"):
        model_fingerprint(cut)


def test_a_worker_with_another_model_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the workers inherit it
    served = write_tiny_gguf(tmp_path / "served.gguf", TinySpec(n_layers=2, name="served"))
    other = write_tiny_gguf(tmp_path / "other.gguf", TinySpec(n_layers=2, name="other", seed=1))
    store = open_weight_store(served)
    workers: list[WorkerProcess] = []
    caplog.set_level(logging.INFO, logger="ethen.mesh.orchestrator")
    try:
        # "wrong" is the faster-looking node: without the check the router would pick it
        workers.append(spawn_worker("wrong", "0-1", extra_args=["--model", str(other),
                                                                 "--capacity-score", "50"], timeout_s=120))
        workers.append(spawn_worker("right", "0-1", extra_args=["--model", str(served)], timeout_s=120))
        orch = Orchestrator.load({w.node_id: w.address for w in workers}, store).start()
        try:
            states = {s.node_id: s for s in orch.monitor.states()}
            assert states["right"].alive and not states["wrong"].alive, states
            assert states["wrong"].served_layers == ()
            route = orch.route_for(4)
            assert [s.node_id for s in route.stages] == ["right"], route
            result = orch.chat([{"role": "user", "content": "hello mesh"}],
                               SamplingParams(temperature=0.0, max_tokens=3)).result()
            assert result.token_ids
            time.sleep(0.6)  # more polls: the refusal is logged once, not per poll
        finally:
            orch.close()
    finally:
        for w in workers:
            w.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith("mesh worker wrong serves another model file")
    assert str(served.resolve()) in errors[0] and f"--model {served.resolve()}" in errors[0]
    assert model_fingerprint(served) in errors[0] and model_fingerprint(other) in errors[0]
    assert not any("is dead" in r.getMessage() for r in caplog.records)
