"""Resident memory of a worker holding k of n layers: about k/n of the layer weights (they are memory-mapped
from the float32 cache, and a process only has the pages it touched), measured in fresh processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ethen.model import WeightStore

PROBE = """
import json, sys
import numpy as np
from ethen.model import load_layer_stack, open_weight_store

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

store = open_weight_store(weights="float32")  # this test is about the float32 cache
before = rss()
lo, hi = int(sys.argv[1]), int(sys.argv[2])
stack = load_layer_stack(lo, hi, store)
kv = stack.new_kv_cache()
h = np.ones((4, stack.config.d_model), dtype=np.float32)
stack.forward(h, np.arange(4), kv)  # touches every weight page of the stack
print(json.dumps({"delta": rss() - before, "weights": stack.nbytes}))
"""


def _probe(lo: int, hi: int) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(lo), str(hi)], capture_output=True, text=True,
                         timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_a_worker_with_k_of_n_layers_keeps_about_k_over_n_resident(store: WeightStore) -> None:
    n = store.config.n_layers
    part = _probe(0, n // 3 - 1)  # 10 of 30 layers
    whole = _probe(0, n - 1)
    print(f"resident growth: {part['delta'] / 2**20:.0f} MiB for {n // 3} layers "
          f"({part['weights'] / 2**20:.0f} MiB of weights), {whole['delta'] / 2**20:.0f} MiB for all {n} "
          f"({whole['weights'] / 2**20:.0f} MiB)")
    assert part["weights"] * 3 == pytest.approx(whole["weights"], rel=0.01)
    assert part["delta"] <= part["weights"] * 1.25 + 48 * 2**20  # its own layers, plus working memory
    assert part["delta"] <= 0.5 * whole["delta"]
