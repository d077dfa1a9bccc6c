"""Each GGUF tensor type kept in its own blocks (:mod:`ethen.model.quant`) and multiplied by the engine
(:mod:`ethen.model.engine`, onnxruntime ``MatMulNBits``) against a float64 product of ``gguf``'s own
dequantization: float32-exact at ``ACCURACY_EXACT``, within 2% of the output scale at the default
``ACCURACY_FAST`` (int8 activations, as llama.cpp's Q8 dot products), and the packed bytes per type."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from ethen.model.engine import (
    ACCURACY_AUTO,
    ACCURACY_EXACT,
    ACCURACY_EXACT_INT8,
    ACCURACY_FAST,
    Engine,
    EngineError,
    GraphBuilder,
)
from ethen.model.quant import NBits, pack
from ethen.model.tiny_gguf import _KQUANT_SCALES

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
#: packed bytes / file bytes per type (the table in ``ethen.model.quant``)
RATIO = {"F32": 1.0, "F16": 1.0, "BF16": 1.0, "Q8_0": 36 / 34, "Q4_0": 20 / 18, "Q4_1": 22.5 / 20,
         "Q4_K": 22.0625 / 18, "Q5_K": 1.75, "Q6_K": 1.53}
R, K = 96, 512


def _raw(kind: str, rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((R, K)).astype(np.float32) * 0.1
    if kind in _KQUANT_SCALES:
        size, fields = _KQUANT_SCALES[kind]
        raw = rng.integers(0, 256, size=(R, K // 256, size), dtype=np.uint8)
        for off, sc in fields:
            d = (sc * rng.uniform(0.5, 1, size=(R, K // 256))).astype(np.float16)
            raw[:, :, off:off + 2] = d.view(np.uint8).reshape(R, K // 256, 2)
        return raw.reshape(R, -1)
    if kind == "F32":
        return w.view(np.uint8)
    if kind == "F16":
        return w.astype(np.float16).view(np.uint8)
    return np.asarray(quantize(w, GGMLQuantizationType[kind])).view(np.uint8)


def _run(kind: str, raw: np.ndarray, x: np.ndarray, accuracy: int) -> np.ndarray:
    g = GraphBuilder("one-matmul")
    y = g.linear(g.input("x", K), pack(kind, raw, R, K), accuracy)
    g.node("Identity", [y], ["y"])
    g.output("y", R)
    out: np.ndarray = Engine("cpu", 1, accuracy).session(g).run(["y"], {"x": x})[0]
    return out


@pytest.mark.parametrize("kind", TYPES)
def test_every_type_multiplies_like_its_float64_dequantization(kind: str) -> None:
    rng = np.random.default_rng(TYPES.index(kind))
    raw = _raw(kind, rng)
    x = rng.standard_normal((5, K)).astype(np.float32)
    w64 = np.asarray(dequantize(raw, GGMLQuantizationType[kind]), np.float64).reshape(R, K)
    ref = x.astype(np.float64) @ w64.T  # [5, R]
    scale = float(np.abs(ref).max())
    exact = _run(kind, raw, x, ACCURACY_EXACT)
    assert float(np.abs(exact - ref).max()) <= 1e-5 * scale, kind
    assert float(np.abs(_run(kind, raw, x, ACCURACY_EXACT_INT8) - ref).max()) <= 1e-5 * scale, kind
    fast = _run(kind, raw, x, ACCURACY_FAST)
    assert float(np.abs(fast - ref).max()) <= 2e-2 * scale, kind
    w = pack(kind, raw, R, K)
    # (Q4_1 without zero points, 22 bytes per 32, when every block's m + 8 d is a float16: rare in gguf's
    # random blocks here, the rule in SmolLM2's file; test_q4_1_runs_at_the_default_zero_point_...)
    ratio = 22 / 20 if isinstance(w, NBits) and kind == "Q4_1" and w.zero_points is None else RATIO[kind]
    assert w.nbytes == pytest.approx(ratio * raw.nbytes, rel=0.01)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_exact_int8_splits_rows_so_the_int8_kernel_is_float32_grade(kind: str) -> None:
    """``ACCURACY_EXACT_INT8``: each row runs as 3 rows the int8-activation kernel quantizes without loss
    (``GraphBuilder.split3``), one ``MatMulNBits`` at onnxruntime's int8 level on the blocks as stored (8 bits
    stay 8 bits), the rows summed. Within float32 compute's error of a float64 product on rows with an
    outlier (the case int8 activations get wrong), an all-zero block and tiny values; the int8 level alone
    is >100x off there."""
    rng = np.random.default_rng(21)
    raw = _raw(kind, rng)
    w = pack(kind, raw, R, K)
    x = rng.standard_normal((4, K)).astype(np.float32)
    x[0, 3] = 500.0  # an outlier in a block
    x[1, :64] = 0.0  # zero blocks
    x[2, 64:96] = 1e-20  # a block of tiny values
    x[3] *= 1e4
    w64 = np.asarray(dequantize(raw, GGMLQuantizationType[kind]), np.float64).reshape(R, K)
    ref = x.astype(np.float64) @ w64.T
    scale = np.abs(ref).max(axis=1, keepdims=True)  # per row
    err = {acc: float((np.abs(_run(kind, raw, x, acc) - ref) / scale).max())
           for acc in (ACCURACY_EXACT, ACCURACY_EXACT_INT8, ACCURACY_FAST)}
    assert err[ACCURACY_EXACT_INT8] <= 2e-6, err
    assert err[ACCURACY_EXACT_INT8] <= 3 * err[ACCURACY_EXACT], err  # float32-grade
    assert err[ACCURACY_FAST] > 100 * err[ACCURACY_EXACT_INT8], err
    g = GraphBuilder("ops")
    g.linear(g.input("x", K), w, ACCURACY_EXACT_INT8)
    nbits = [n for n in g.nodes if n.op_type == "MatMulNBits"]
    assert isinstance(w, NBits)
    assert (nbits[0].attrs["accuracy_level"], nbits[0].attrs["bits"]) == (ACCURACY_FAST, w.bits)
    assert [n.op_type for n in g.nodes].count("Round") == 2


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_K", "Q4_0", "Q4_1", "Q4_K"])
def test_auto_accuracy_is_exact_int8_for_8bit_blocks_and_exact_for_4bit(kind: str) -> None:
    """``ACCURACY_AUTO`` (``--accuracy``'s default) builds, per matrix, the exact-int8 graph for 8-bit
    blocks (8 bits kept: no nibble halves) and the float32-compute graph for 4-bit blocks; its products are
    those of the level it picks, bit for bit."""
    rng = np.random.default_rng(5)
    raw = _raw(kind, rng)
    w = pack(kind, raw, R, K)
    assert isinstance(w, NBits)
    picked = ACCURACY_EXACT_INT8 if w.bits == 8 else ACCURACY_EXACT

    def graph(acc: int) -> list[tuple[str, tuple[tuple[str, object], ...]]]:
        g = GraphBuilder("auto")
        g.linear(g.input("x", K), w, acc)
        return [(n.op_type, tuple(sorted((k, v) for k, v in n.attrs.items() if not isinstance(v, bytes))))
                for n in g.nodes]

    assert graph(ACCURACY_AUTO) == graph(picked)
    assert graph(ACCURACY_AUTO) != graph(ACCURACY_EXACT_INT8 if picked == ACCURACY_EXACT else ACCURACY_EXACT)
    x = rng.standard_normal((3, K)).astype(np.float32)
    np.testing.assert_array_equal(_run(kind, raw, x, ACCURACY_AUTO), _run(kind, raw, x, picked))


def test_onnx_engine_takes_the_accuracy() -> None:
    from ethen.model.choose import EngineOptions
    from ethen.model.errors import ModelInputError
    from ethen.model.qmodel import onnx_engine

    for value, level in (("auto", ACCURACY_AUTO), ("exact", ACCURACY_EXACT), ("fast", ACCURACY_FAST)):
        assert onnx_engine(1, accuracy=value, device="cpu").accuracy == level
    assert onnx_engine(1).accuracy == ACCURACY_AUTO  # the default
    with pytest.raises(ModelInputError, match=r"--accuracy 'int4': must be one of auto, exact, fast$"):
        EngineOptions(accuracy="int4")
    with pytest.raises(ModelInputError, match=r"--accuracy 'int4'"):
        onnx_engine(1, accuracy="int4")
    # exact-int8 is what auto runs for 8-bit blocks, no longer a value of its own
    with pytest.raises(ModelInputError,
                       match=r"--accuracy 'exact-int8': must be one of auto, exact, fast \(auto runs"):
        EngineOptions(accuracy="exact-int8")


def test_device_errors_are_clear() -> None:
    import onnxruntime as ort

    with pytest.raises(EngineError, match="not one of auto, cpu, cuda"):
        Engine("tpu")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert Engine("auto").device == "cuda"
    else:
        with pytest.raises(EngineError, match="onnxruntime-gpu"):
            Engine("cuda")
        assert Engine("auto").device == "cpu"


def test_cuda_gives_the_cpu_outputs() -> None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("no CUDAExecutionProvider here (needs onnxruntime-gpu and a CUDA GPU)")
    rng = np.random.default_rng(1)
    raw = _raw("Q4_0", rng)
    x = rng.standard_normal((3, K)).astype(np.float32)
    g = GraphBuilder("cuda")
    y = g.linear(g.input("x", K), pack("Q4_0", raw, R, K), ACCURACY_EXACT)
    g.node("Identity", [y], ["y"])
    g.output("y", R)
    got = Engine("cuda", 1, ACCURACY_EXACT).session(g).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, _run("Q4_0", raw, x, ACCURACY_EXACT), rtol=0, atol=1e-3)


def _unpack4(data: np.ndarray) -> np.ndarray:
    return np.stack([data & 15, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)  # [..., 2n]


@pytest.mark.parametrize("kind", ["Q8_0", "Q5_K", "Q6_K"])
def test_exact_8bit_blocks_run_as_two_4bit_halves_of_the_same_weights(kind: str) -> None:
    """At ``ACCURACY_EXACT`` an 8-bit matrix is one 4-bit ``MatMulNBits`` over ``[x, x]`` (onnxruntime's
    8-bit CPU kernel has no float32-compute path: it dequantized the whole matrix per call, 20x slower);
    the halves hold the 8-bit weights exactly; the fast path keeps 8 bits."""
    from ethen.model.quant import NBits, nibble_halves

    rng = np.random.default_rng(7)
    w = pack(kind, _raw(kind, rng), R, K)
    assert isinstance(w, NBits) and w.bits == 8
    bits = {}
    for acc in (ACCURACY_EXACT, ACCURACY_FAST):
        g = GraphBuilder("bits")
        g.linear(g.input("x", K), w, acc)
        bits[acc] = next(n.attrs["bits"] for n in g.nodes if n.op_type == "MatMulNBits")  # (then mins)
    assert bits == {ACCURACY_EXACT: 4, ACCURACY_FAST: 8}
    h = nibble_halves(w)
    nb = K // w.block
    z = (np.full((R, nb), 128) if w.zero_points is None else w.zero_points.reshape(R, nb)).astype(np.float64)
    w8 = w.scales.reshape(R, nb, 1).astype(np.float64) * (w.data.reshape(R, nb, w.block) - z[..., None])
    zh = _unpack4(h.zero_points.reshape(R, -1))[:, :2 * nb].astype(np.float64)  # type: ignore[union-attr]
    q = _unpack4(h.data).astype(np.float64)  # [R, 2 nb, block]
    w4 = h.scales.reshape(R, 2 * nb, 1).astype(np.float64) * (q - zh[..., None])
    np.testing.assert_array_equal(w4[:, :nb] + w4[:, nb:], w8)  # bit for bit


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_the_k_quant_minimum_term_is_a_small_exact_4bit_matmul(kind: str) -> None:
    """The K-quants' ``- dmin * m`` is a 4-bit ``MatMulNBits`` ``[R, K / 16]`` (``quant.k_mins``: ``[m & 15,
    m >> 4]`` per super-block, scale ``-dmin``), float32 compute at both accuracies; its weights times
    ``[xsum, 16 xsum]`` are ``- dmin * m`` times ``xsum`` bit for bit. No weight is cast or multiplied per
    call (the old form built a float ``[K / 32, R]`` matrix from ``Cast(m) * Cast(dmin)`` on every call)."""
    rng = np.random.default_rng(3)
    raw = _raw(kind, rng)
    w = pack(kind, raw, R, K)
    assert w.mins is not None  # type: ignore[union-attr]
    mins = w.mins  # type: ignore[union-attr]
    nsb = K // 256
    assert (mins.rows, mins.cols, mins.bits, mins.block) == (R, 16 * nsb, 4, 16)
    for acc in (ACCURACY_EXACT, ACCURACY_FAST):
        g = GraphBuilder("mins")
        g.linear(g.input("x", K), w, acc)
        ops = [n.op_type for n in g.nodes]
        assert "Cast" not in ops and "MatMul" not in ops, ops
        nbits = [(n.attrs["K"], n.attrs["accuracy_level"]) for n in g.nodes if n.op_type == "MatMulNBits"]
        assert nbits[-1] == (16 * nsb, ACCURACY_EXACT)
    # the file's m and dmin (gguf's layout: d, dmin, 12 bytes of 6-bit scales / mins per super-block)
    blk = raw.reshape(R, nsb, -1)
    dmin = blk[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)  # [R, nsb]
    s = blk[:, :, 4:16].astype(np.int64)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    q = _unpack4(mins.data).reshape(R, nsb, 16).astype(np.float64)
    sc = mins.scales.reshape(R, nsb, 1).astype(np.float64)
    # weight j of a super-block meets xsum_j in column j and 16 xsum_j in column 8 + j
    np.testing.assert_array_equal(sc * q[..., :8] + sc * 16 * q[..., 8:], -dmin[..., None] * m)
    assert not _unpack4(mins.zero_points.reshape(R, -1)).any()  # type: ignore[union-attr]


def _q4_1(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_1 bytes ``[R, nb * 20]`` of float16 ``d``, ``m`` ``[R, nb]`` and 4-bit ``q [R, nb, 32]`` (weight j
    in byte j's low nibble, weight j + 16 in its high one: gguf's layout)."""
    r, nb = d.shape
    blk = np.zeros((r, nb, 20), np.uint8)
    blk[:, :, 0:2] = d.astype(np.float16).view(np.uint8).reshape(r, nb, 2)
    blk[:, :, 2:4] = m.astype(np.float16).view(np.uint8).reshape(r, nb, 2)
    blk[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return blk.reshape(r, -1)


def test_q4_1_runs_at_the_default_zero_point_when_every_shifted_minimum_is_a_float16() -> None:
    """Q4_1's ``w = d q + m`` packs as ``d (q - 8) + (m + 8 d)``: ``MatMulNBits`` at its default zero point,
    no zero-point input (onnxruntime's float32 kernel ran ~14 % slower with one), the minimum term over the
    float16 ``m + 8 d``, when every block's ``m + 8 d`` is a float16; a matrix with one block where it is
    not keeps zero points of 0 and the file's ``m``. Either way the products are the float64 ones."""
    rng = np.random.default_rng(11)
    nb = K // 32
    d = rng.integers(16, 32, (R, nb)) / 1024.0  # few significant bits, so that m and m + 8 d are float16s
    m = -8 * d + rng.integers(-64, 64, (R, nb)) / 4096.0
    q = rng.integers(0, 16, (R, nb, 32)).astype(np.uint8)
    x = rng.standard_normal((5, K)).astype(np.float32)
    d_odd, m_odd = d.copy(), m.copy()
    d_odd[3, 5], m_odd[3, 5] = 1 + 2.0**-10, 2.0**-13  # m + 8 d = 8 + 2^-7 + 2^-13: 17 significant bits
    for dd, mm, shifted in ((d, m, True), (d_odd, m_odd, False)):
        raw = _q4_1(dd, mm, q)
        w = pack("Q4_1", raw, R, K)
        assert isinstance(w, NBits) and w.mins_f16 is not None
        if shifted:
            assert w.zero_points is None
            np.testing.assert_array_equal(w.mins_f16.T.astype(np.float64), mm + 8 * dd)
            assert w.nbytes == R * nb * 22  # 16 bytes of nibbles, a float32 scale, a float16 minimum
        else:
            assert w.zero_points is not None and not _unpack4(w.zero_points.reshape(R, -1)).any()
            np.testing.assert_array_equal(w.mins_f16.T.astype(np.float64), mm)
        g = GraphBuilder("q4_1")
        g.linear(g.input("x", K), w, ACCURACY_EXACT)
        main = next(n for n in g.nodes if n.op_type == "MatMulNBits")
        assert len(main.inputs) == (3 if shifted else 4)  # x, data, scales[, zero points]
        w64 = np.asarray(dequantize(raw, GGMLQuantizationType.Q4_1), np.float64).reshape(R, K)
        ref = x.astype(np.float64) @ w64.T
        for acc in (ACCURACY_EXACT, ACCURACY_EXACT_INT8):
            got = _run("Q4_1", raw, x, acc)
            assert float(np.abs(got - ref).max()) <= 1e-5 * float(np.abs(ref).max()), (shifted, acc)


def test_the_graph_bytes_are_the_model_onnx_helper_builds() -> None:
    """:mod:`ethen.model.onnx_wire` writes the protobuf without the ``onnx`` package (its import costs
    ~1 s per process); ``onnx`` parses the bytes into the model its own helpers build from the same parts."""
    import subprocess
    import sys

    from onnx import ModelProto, TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    g = GraphBuilder("check")
    x = g.input("x", K)
    h = g.rms_norm(x, rng.standard_normal(K).astype(np.float32), 1e-5)
    y = g.linear(h, pack("Q4_1", _raw("Q4_1", rng), R, K), ACCURACY_EXACT)  # int attrs, uint8/f16 tensors
    y = g.op("Concat", [y, g.linear(h, pack("BF16", _raw("F16", rng), R, K), ACCURACY_EXACT)], axis=-1)
    g.node("Identity", [g.op("LeakyRelu", [y], alpha=0.25)], ["y"])  # a float attribute
    g.output("y", 2 * R)
    got = ModelProto()
    got.ParseFromString(g.model_bytes())

    def tensor(t: object) -> object:
        assert hasattr(t, "raw")
        if t.data_type == 16:  # type: ignore[attr-defined]
            return helper.make_tensor(t.name, 16, list(t.dims), t.raw, raw=True)  # type: ignore[attr-defined]
        arr = np.frombuffer(t.raw, dtype=helper.tensor_dtype_to_np_dtype(t.data_type))  # type: ignore[attr-defined]
        return numpy_helper.from_array(arr.reshape(t.dims), t.name)  # type: ignore[attr-defined]

    want = helper.make_model(helper.make_graph(
        [helper.make_node(n.op_type, n.inputs, n.outputs, domain=n.domain or None, **n.attrs)
         for n in g.nodes],
        "check", [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in g.inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, d) for n, d in g.outputs],
        [tensor(t) for t in g.inits]),  # type: ignore[misc]
        opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    want.ir_version = 10
    assert got == want
    code = "import sys, ethen.model.qmodel, ethen.model.engine; sys.exit('onnx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0  # onnx not imported



def test_a_file_backed_session_gives_the_same_outputs(tmp_path: Path) -> None:
    """``Engine.session(graph, backing)``: the large initializers go to the file (the model's ONNX external
    data, which onnxruntime maps), the small ones stay in the model; outputs are bit for bit those of the
    in-model graph."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, K)).astype(np.float32)
    norm = rng.standard_normal(K).astype(np.float32)
    mats = {kind: pack(kind, _raw(kind, rng), R, K) for kind in ("Q4_1", "Q8_0", "Q4_K", "BF16")}
    path = tmp_path / "engine" / "g.bin"
    outs = []
    for backing in (None, path):
        g = GraphBuilder("backed")
        h = g.rms_norm(g.input("x", K), norm, 1e-5)
        g.node("Concat", [g.linear(h, m, ACCURACY_EXACT) for m in mats.values()], ["y"], axis=1)
        g.output("y", 4 * R)
        in_model = sum(len(t.raw) for t in g.inits)
        sess = Engine("cpu", 1, ACCURACY_EXACT).session(g, backing)
        outs.append(sess.run(["y"], {"x": x})[0])
        if backing is not None:
            external = [t for t in g.inits if t.external is not None]
            assert external and all(t.raw == b"" for t in external)  # the bytes are in the file only
            assert any(t.data_type == 16 for t in external)  # bfloat16 too
            assert all(t.external is not None and t.external[0] == path.name for t in external)
            assert path.stat().st_size >= in_model - sum(len(t.raw) for t in g.inits) > 0
            assert not list(path.parent.glob("*.tmp"))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", TYPES)
def test_only_graphs_with_f16_weights_let_onnxruntime_fold_casts_into_float32_copies(kind: str) -> None:
    """``Engine.session_options``: onnxruntime's last optimization level folds the ``Cast`` of a float16
    constant into a float32 copy. Wanted for F16 weights (a Cast per call made decode 6-7x slower), not for
    Q4_1's float16 min term (a float32 copy, prepacked again: 12 MiB more for 30 SmolLM2 layers) nor for the
    rest (BF16 is cast per call at every level). A long variant keeps its graph's choice."""
    import onnxruntime as ort

    g = GraphBuilder("one")
    g.node("Identity", [g.linear(g.input("x", K), pack(kind, _raw(kind, np.random.default_rng(1)), R, K),
                                 ACCURACY_AUTO)], ["y"])
    g.output("y", R)
    level = Engine("cpu", 1, ACCURACY_AUTO).session_options([g]).graph_optimization_level
    levels = ort.GraphOptimizationLevel
    assert level == (levels.ORT_ENABLE_ALL if kind == "F16" else levels.ORT_ENABLE_EXTENDED)
    assert g.fold_f16 == (kind == "F16")
    long = g.long_variant()
    assert long is None or not long.fold_f16
