"""What the runtime keeps in memory: no dequantized copy of a weight, logits only where they are read.

References: onnxruntime on the same graph (all positions' logits, accuracy level 1) and the
stored tensors themselves (4-bit rows unpacked independently of the runtime).
"""

from __future__ import annotations

import mmap

import numpy as np
import onnx
import pytest
from fuselm.runtime_metal.loader import Packed4
from fuselm.runtime_metal.session import Session

import fuselm
from fuselm.contract import MODEL_NAME
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner


def _mapped(a: np.ndarray) -> bool:
    """True when `a` is a view of a memory-mapped file (pages the kernel can drop), not a heap copy."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


@pytest.fixture(scope="module")
def shared_q4(make_ckpt, tmp_path_factory):
    """Tied tiny qwen3, q4 linears, q4 head and q4 embedding stored as one tensor."""
    out = tmp_path_factory.mktemp("shared-q4") / "model"
    return fuselm.convert(make_ckpt("qwen3"), out, quant="q4", lm_head="q4", embed="q4", quiet=True)


def test_tied_quantized_head_stored_once(shared_q4):
    graph = onnx.load(str(shared_q4 / MODEL_NAME), load_external_data=False).graph
    names = [t.name for t in graph.initializer]
    assert not any(n.startswith("lm_head") for n in names), names
    assert read_meta(shared_q4)["quantization"]["lm_head"]["shares"] == "embed"
    head = next(n for n in graph.node if n.name == "/model/lm_head/MatMul")
    transpose = next(n for n in graph.node if n.output[0] == head.input[1])
    assert transpose.op_type == "Transpose"
    dq = next(n for n in graph.node if n.output[0] == transpose.input[0])
    assert dq.op_type == "DequantizeLinear" and dq.input[0] == "model.embed_tokens.weight.qweight"


def test_no_dequantized_weight_copy(shared_q4):
    """Every weight-sized constant the runtime keeps is a view of the data file; the folded weights'
    sources are gone; the embedding is gathered from its packed 4-bit rows."""
    sess = Session(shared_q4, backend="torch", device="cpu")
    g = sess.graph
    ops = [n.op_type for n in g.nodes]
    assert "DequantizeLinear" not in ops and "Transpose" not in ops[-3:]
    gather = next(n for n in g.nodes if n.op_type == "QGather")
    assert gather.attrs["packed4"] == 1
    vocab, hidden = sess.meta["dims"]["vocab"], sess.meta["dims"]["hidden"]
    assert g.constants[gather.inputs[0]].shape == (vocab, hidden // 2)
    for name, value in g.constants.items():
        assert not isinstance(value, Packed4), name
        if np.asarray(value).size >= 64 * 64:
            assert _mapped(value), f"{name} is a heap copy of a weight"
    head = next(n for n in g.nodes if "logits" in n.outputs)
    assert head.op_type == "QMatMul" and head.attrs["weight"].bits == 4


def test_packed_rows_gather_the_stored_values(shared_q4):
    """QGather over packed uint4 rows = the stored table dequantized (unpacked here with numpy)."""
    sess = Session(shared_q4, backend="torch")
    gather = next(n for n in sess.graph.nodes if n.op_type == "QGather")
    model = onnx.load(str(shared_q4 / MODEL_NAME))
    stored = {t.name: t for t in model.graph.initializer}
    raw = np.frombuffer(stored["model.embed_tokens.weight.qweight"].raw_data, np.uint8)
    vocab, hidden = sess.meta["dims"]["vocab"], sess.meta["dims"]["hidden"]
    q = np.stack([raw & 15, raw >> 4], axis=1).reshape(vocab, hidden).astype(np.float32)
    scale = onnx.numpy_helper.to_array(stored["model.embed_tokens.weight.scales"])
    zraw = np.frombuffer(stored["model.embed_tokens.weight.zero_points"].raw_data, np.uint8)
    zp = (
        np.stack([zraw & 15, zraw >> 4], axis=1)
        .reshape(-1)[: scale.size]
        .reshape(scale.shape)
        .astype(np.float32)
    )
    block = gather.attrs["block_size"]
    want = (q - np.repeat(zp, block, 1)) * np.repeat(scale, block, 1)
    ids = np.array([[3, 0, vocab - 1, 7]])
    from fuselm.runtime_metal.ops import OPS

    b = sess.backend
    args = [b.asarray(sess.graph.constants[x]) if x else None for x in gather.inputs[:3]]
    got = OPS[("fuselm.runtime", "QGather")].fn(b, *args, b.asarray(ids), **gather.attrs)
    np.testing.assert_allclose(b.to_numpy(got), want[ids], rtol=0, atol=1e-6)


def test_mlx_embedding_gathers_from_the_tied_head(shared_q4):
    """On MLX the tied 4-bit embedding is gathered from the lm_head's prepared weight (one copy, as mlx-lm's
    QuantizedEmbedding): the same object, and rows equal to the stored table dequantized (as above)."""
    pytest.importorskip("mlx.core")
    sess = Session(shared_q4, backend="mlx")
    gather = next(n for n in sess.graph.nodes if n.op_type == "QGatherRows")
    head = next(n for n in sess.graph.nodes if "logits" in n.outputs)
    assert gather.attrs["weight"] is head.attrs["weight"]
    assert not any(n.op_type == "QGather" for n in sess.graph.nodes)
    ref = Session(shared_q4, backend="torch")
    qg = next(n for n in ref.graph.nodes if n.op_type == "QGather")
    from fuselm.runtime_metal.ops import OPS

    vocab = sess.meta["dims"]["vocab"]
    ids = np.array([[3, 0, vocab - 1, 7]])
    rb = ref.backend
    args = [rb.asarray(ref.graph.constants[x]) if x else None for x in qg.inputs[:3]]
    want = rb.to_numpy(OPS[("fuselm.runtime", "QGather")].fn(rb, *args, rb.asarray(ids), **qg.attrs))
    b = sess.backend
    got = b.to_numpy(OPS[("fuselm.runtime", "QGatherRows")].fn(b, b.asarray(ids), **gather.attrs))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_logits_of_the_last_position_only(exported):
    """A prefill chunk's lm_head reads the last position ([1, 1, vocab]); a run that asks for every
    position gets them, equal to onnxruntime's on the same graph (f32: no activation rounding on
    either side); both agree on the last one."""
    model = exported("qwen3", "f32")
    ids = list(range(5, 21))
    sess = Session(model, backend="torch")
    assert any(n.op_type == "LastRows" for n in sess.graph.nodes)
    outs = {}
    for every in (False, True):
        sess.reset(32)
        sess.executor.ctx["logit_rows"] = None if every else 1
        feeds = {
            "input_ids": sess._ids(ids),
            "attention_mask": sess._ids(np.ones(16)),
            "position_ids": sess._ids(np.arange(16)),
            **{c.name: sess.backend.full((1, c.heads, 0, c.head_dim), 0, c.dtype) for c in sess.caches},
        }
        outs[every] = np.asarray(sess.backend.to_numpy(sess.executor.run(feeds)["logits"]))
    vocab = sess.meta["dims"]["vocab"]
    assert outs[False].shape == (1, 1, vocab) and outs[True].shape == (1, 16, vocab)
    ort_logits, _ = OrtRunner(model).forward(np.array([ids]), np.ones((1, 16)), np.arange(16)[None])
    np.testing.assert_allclose(outs[True], ort_logits, atol=1e-4 * max(1.0, np.abs(ort_logits).max()))
    np.testing.assert_allclose(outs[False][0, 0], outs[True][0, -1], atol=1e-4)


def test_shared_q4_head_validates(shared_q4, make_ckpt):
    """The shared 4-bit table through `fuselm validate`, held to what test_runtime_validate holds q4 to
    (onnxruntime level 1's tokens and logits; int8 activations: drift within its bound of level 4's)."""
    from test_runtime_validate import _check_quantized

    r = fuselm.validate(shared_q4, make_ckpt("qwen3"), tokens=6, backend="torch", quiet=True)
    assert r["quantized"]
    _check_quantized(r)


def test_wide_weight_packed_in_slices():
    """A vocab-wide weight is prepared in column slices: the same matmul as packing it whole."""
    import torch
    from fuselm.runtime_metal.backends import make_backend, torch_backend, torch_quant

    b = make_backend("torch", "cpu")
    rng = np.random.default_rng(0)
    k, n = 64, torch_backend._PREPARE_COLUMNS * 2 + 96
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, (k // 32, n)).astype(np.float32)
    zp = rng.integers(0, 16, (k // 32, n), dtype=np.uint8)
    sliced, whole = b.prepare_quantized(q, scale, zp, 32, 4), torch_quant.prepare(b, q, scale, zp, 32, 4)
    assert (sliced.kind, sliced.in_features, sliced.out_features) == (whole.kind, k, n)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    np.testing.assert_array_equal(b.quantized_matmul(x, sliced).numpy(), b.quantized_matmul(x, whole).numpy())


def test_long_lazy_prefill_waits_layer_by_layer(shared_q4, monkeypatch):
    """A long prefill on MLX is queued a few layers ahead (executor.InFlight): the host waits once per layer
    past the depth, and the logits are the ones of the run queued whole."""
    mlx = pytest.importorskip("mlx.core")
    ids = list(range(3, 3 + 80))  # >= session._LONG_RUN rows
    whole = Session(shared_q4, backend="mlx", device="cpu")
    whole.backend.inflight_layers = None
    whole.reset(len(ids) + 1)
    ref = np.array(whole.prefill(ids))
    sess = Session(shared_q4, backend="mlx", device="cpu")
    sess.backend.inflight_layers = 1
    waits = []
    sync = sess.backend.sync
    monkeypatch.setattr(sess.backend, "sync", lambda x: (waits.append(x), sync(x))[1])
    sess.reset(len(ids) + 1)
    got = np.array(sess.prefill(ids))
    layers = sess.meta["dims"]["layers"]
    assert len(waits) == layers - 1, (len(waits), layers)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert mlx.get_active_memory() > 0
