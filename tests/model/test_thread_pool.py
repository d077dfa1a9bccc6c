"""``Engine(pool=...)`` / ``onnx_engine(threads, pool)`` (``ethen worker --thread-pool``;
:func:`ethen.model.engine.shared_pool`): ``shared`` runs every session of the process on one onnxruntime pool
(the process keeps a handful of threads instead of one pool per session), with the same outputs as a pool per
session; a second size cannot share it; bad values are refused naming them. Fresh processes: the shared pool
is process state."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from ethen.model.engine import Engine, EngineError
from ethen.model.errors import ModelInputError
from ethen.model.qmodel import onnx_engine

PROBE = """
import json, os, sys
import numpy as np
from ethen.model import load_layer_stacks, open_weight_store
from ethen.model.engine import Engine
from ethen.model.qmodel import onnx_engine, load_quant_layers
from ethen.model.model import LayerStack

store = open_weight_store()
eng = onnx_engine(int(sys.argv[1]), sys.argv[2])
stack = LayerStack(store.config, load_quant_layers([(0, 7)], store, eng)[0])
kv = stack.new_kv_cache()
x = np.random.default_rng(0).standard_normal((5, stack.config.d_model)).astype(np.float32)
a = stack.forward(x[:4], np.arange(4), kv)  # a 4-row step
b = stack.forward(x[4:], np.array([4]), kv)  # a decode step
threads = len(os.listdir("/proc/self/task"))
# another engine of the process, another size, a pool per session asked: with the shared pool, it runs there
other = Engine("cpu", eng.threads + 1, eng.accuracy, pool="session")
one = LayerStack(store.config, load_quant_layers([(0, 0)], store, other)[0])  # its sessions build and run
y = one.forward(x[:1], np.arange(1), one.new_kv_cache())
# then an engine asks for the shared pool (made here if the process has none): the first engine's new
# sessions, if it has a pool per session, must go on that pool too
Engine("cpu", 2, eng.accuracy, pool="shared")
late = LayerStack(store.config, load_quant_layers([(1, 1)], store, eng)[0])
z = late.forward(x[:1], np.arange(1), late.new_kv_cache())
print(json.dumps({"pool": eng.pool, "other": [other.pool, other.threads, bool(np.isfinite(y).all())],
                  "late": bool(np.isfinite(z).all()),
                  "threads": threads,
                  "out": np.concatenate([a, b]).tolist()}))
"""


def _probe(pool: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", PROBE, "2", pool], capture_output=True, text=True,
                         timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task (Linux)")
def test_a_shared_pool_serves_every_session_with_the_same_outputs() -> None:
    import numpy as np

    own, shared = _probe("session"), _probe("shared")
    assert own["pool"] == "session" and shared["pool"] == "shared"
    # another engine of the process (3 threads, a pool per session asked): on the process's pool if it has
    # one (onnxruntime allows no other then), with its 2 threads
    assert own["other"] == ["session", 3, True] and shared["other"] == ["shared", 2, True]
    assert own["late"] and shared["late"]  # sessions built after the process got its shared pool
    # 8 layers x 2 graphs x (2 - 1) pool threads each, against one pool of 2 threads (+ the other engine's
    # sessions, none built): numba, onnxruntime and the interpreter's own threads are common to both
    assert own["threads"] - shared["threads"] >= 14, (own["threads"], shared["threads"])  # measured 21 vs 4
    a, b = np.array(own["out"]), np.array(shared["out"])
    assert a.shape == b.shape and np.isfinite(a).all()
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * float(np.abs(a).max()))


def test_a_bad_thread_pool_is_refused_naming_the_value(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineError, match="thread pool 'spin' is not one of session, shared"):
        Engine("cpu", 1, pool="spin")
    with pytest.raises(ModelInputError, match="thread pool 'spin': must be one of session, shared"):
        onnx_engine(1, "spin")
    monkeypatch.setenv("ETHEN_THREAD_POOL", "shared")  # (read by nothing any more)
    assert onnx_engine(1).pool == "session"  # the default: a pool per session
