"""The MLX path reads only the filled rows of the cache, with no array mask at decode and
mask="causal" at prefill (rewrites/causal_masks.py decides at load which masks allow it), decodes through compiled
pieces between the attentions, and launches fewer kernels per decode token than mlx-lm. Checked against
the torch backend (static-shape decode over the whole buffer with the graph's array mask)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from fuselm.runtime_metal.backends.numpy_backend import NumpyBackend
from fuselm.runtime_metal.graph import Graph, Node
from fuselm.runtime_metal.rewrites.base import Load
from fuselm.runtime_metal.rewrites.causal_masks import CausalMasks
from fuselm.runtime_metal.session import Decode, Session

import fuselm

pytest.importorskip("mlx.core")


def _logits(sess, ids, n):
    """Prefill `ids`, then n - 1 greedy decode steps: every step's logits (host loop)."""
    sess.reset(len(ids) + n)
    out = [sess.logits_to_numpy(sess.prefill(ids, chunk=3))]
    for _ in range(n - 1):
        out.append(sess.logits_to_numpy(sess.decode(int(np.argmax(out[-1])))))
    return np.stack(out)


def test_causal_masks_classify_the_exporters_masks(optimized):
    for model, want in ((optimized("qwen3", "q4"), 0), (optimized("mistral", "f32", sliding_window=4), 4)):
        sess = Session(model, backend="mlx")
        rows = [n.attrs.get("causal_rows") for n in sess.graph.nodes if n.op_type == "Attention"]
        assert rows and all(r == want for r in rows) and sess.causal_reads


def _mask_graph(nodes: list[Node], mask: str) -> Graph:
    att = Node("Attention", "", "att", ["q", "k", "v", mask], ["y"], {})
    consts = {"zero": np.array(0.0, np.float32), "low": np.array(-1e9, np.float32), "axes": np.array([1, 2])}
    return Graph([*nodes, att], consts, ["input_ids", "attention_mask", "position_ids", "q", "k", "v"], ["y"], {"": 23})


def test_causal_masks_refuse_other_masks():
    """A padding-only (bidirectional) mask and a mask made from the query values are not causal bands."""
    pad = [Node("Cast", "", "c", ["attention_mask"], ["b"], {"to": 9}),
           Node("Unsqueeze", "", "u", ["b", "axes"], ["b4"]),
           Node("Where", "", "w", ["b4", "zero", "low"], ["m"])]
    for g in (_mask_graph(pad, "m"), _mask_graph([Node("Where", "", "w", ["q", "zero", "low"], ["m"])], "m")):
        _, modified, stats = CausalMasks()(g, Load(NumpyBackend()))
        assert not modified and "causal_rows" not in g.nodes[-1].attrs
        assert stats.skipped == [("att", "its mask is not a causal band under plain feeds")]


def test_decode_attention_gets_no_array_mask(optimized, monkeypatch):
    """Every sdpa call of a decode step gets mask None and exactly the filled rows; prefill gets "causal"."""
    sess = Session(optimized("qwen3", "q4"), backend="mlx", compile=False)
    seen = []
    real = sess.backend.sdpa

    def spy(q, k, v, mask, scale):
        seen.append((q.shape[2], k.shape[2], mask if mask is None or isinstance(mask, str) else "array"))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(sess.backend, "sdpa", spy)
    sess.reset(12)
    sess.prefill([5, 6, 7, 8, 9], chunk=3)
    assert seen == [(3, 3, "causal")] * 2 + [(2, 5, "causal")] * 2  # two layers, two chunks
    sess.decode(3)  # the checked step: dynamic and static
    seen.clear()
    for t in range(3):
        sess.decode(4 + t)
    assert sess.mode is Decode.STATIC
    assert seen == [(1, 7 + t, None) for t in range(3) for _ in range(2)]


def _masked_mlx(model, monkeypatch, **kv):
    """The MLX session as it ran before causal reads: the whole buffer, the graph's array mask, one compiled step."""
    from fuselm.runtime_metal.backends.mlx_backend import MLXBackend

    with monkeypatch.context() as m:
        m.setattr(MLXBackend, "causal_reads", False)
        sess = Session(model, backend="mlx", **kv)
    assert not sess.causal_reads
    return sess


@pytest.mark.parametrize("kv", [{}, {"kv_bits": 8}])
def test_causal_reads_match_the_masked_path(optimized, monkeypatch, kv):
    """MLX (filled rows, compiled pieces) vs torch (whole buffer, array mask) every step, and with an
    8-bit cache vs MLX's own masked path over the same stored rows (f32 weights: the torch CPU backend's
    quantized matmuls round activations to int8)."""
    model = optimized("qwen3", "f32")
    ids = [3, 9, 4, 7, 1]
    sess = Session(model, backend="mlx", **kv)
    got = _logits(sess, ids, 8)
    assert sess.mode is Decode.COMPILED and "pieces" in sess.describe()
    # a float cache: each decode Attention as direct backend calls (compiled.py); 8-bit: through the executor
    assert ("as direct backend calls" in sess.describe()) is not kv
    ref = _masked_mlx(model, monkeypatch, **kv) if kv else Session(model, backend="torch")
    np.testing.assert_allclose(got, _logits(ref, ids, 8), atol=2e-4 * np.abs(got).max())


def test_cache_in_another_dtype_goes_through_the_executor(optimized):
    """A cache buffer not in the compute dtype (a graph's float16 cache under float32 activations; here the
    buffers are made float16 by hand): each direct decode attention hands it to the executor's Attention
    (compiled.py, the 3-D K/V inputs rebuilt from the rows), and the logits stay those of the float32 cache
    up to float16 rounding."""
    import mlx.core as mx

    model = optimized("qwen3", "f32")
    ids = [3, 9, 4, 7, 1]
    sess = Session(model, backend="mlx")
    sess.reset(len(ids) + 6)
    half = {id(v): v.astype(mx.float16) for v in sess.buffers.values()}  # K and V keep sharing one buffer
    sess.buffers = {k: half[id(v)] for k, v in sess.buffers.items()}
    out = [sess.logits_to_numpy(sess.prefill(ids, chunk=3))]
    for _ in range(5):
        out.append(sess.logits_to_numpy(sess.decode(int(np.argmax(out[-1])))))
    got = np.stack(out)
    assert sess.mode is Decode.COMPILED and "as direct backend calls" in sess.describe(), sess.describe()
    assert all(v.dtype == mx.float16 for v in sess.buffers.values())
    want = _logits(Session(model, backend="mlx"), ids, 6)
    np.testing.assert_allclose(got, want, atol=1e-2 * np.abs(want).max())


def test_sliding_window_past_the_window_matches_torch(optimized):
    """A window of 4, 11 tokens: MLX decodes static over the window's last rows; torch goes dynamic."""
    model = optimized("mistral", "f32", sliding_window=4)
    ids = [3, 4, 5, 6, 2]
    sess = Session(model, backend="mlx")
    got = _logits(sess, ids, 7)
    assert sess.static_checked
    torch_sess = Session(model, backend="torch")
    want = _logits(torch_sess, ids, 7)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(got).max())


def test_sliding_window_int8_cache(optimized, monkeypatch):
    """The window with an 8-bit cache (head_dim 32: MLX quantizes groups of 32 at least) vs the masked path."""
    model = optimized("mistral", "f32", sliding_window=4, head_dim=32)
    ids = [3, 4, 5, 6, 2]
    got = _logits(Session(model, backend="mlx", kv_bits=8), ids, 7)
    want = _logits(_masked_mlx(model, monkeypatch, kv_bits=8), ids, 7)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(got).max())


def test_greedy_tokens_equal_torch_on_a_q4_graph(make_ckpt, tmp_path):
    """A trained checkpoint (random weights have near-ties), 32 greedy tokens: MLX == torch."""
    hf = make_ckpt("qwen3", train_steps=40)
    fuselm.convert(hf, tmp_path / "exp", quant="q4", quiet=True)
    fuselm.optimize(tmp_path / "exp", tmp_path / "opt", quiet=True)
    runs = [fuselm.run(tmp_path / "opt", prompt="hello world! what is the capital of", max_tokens=32,
                       ignore_eos=True, quiet=True, backend=backend, stream=io.StringIO()) for backend in ("mlx", "torch")]
    assert "pieces" in runs[0]["what"]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(set(runs[0]["tokens"])) > 3


def test_decode_kernels_per_layer(optimized):
    """One decode token on the tiny qwen3 q4 graph, MLX's fused ops counted as one kernel each (the graph
    a GPU runs): 13 kernels per layer (rms_norm, QKV matmul, one rms_norm over the heads, one fused
    norm-weight + RoPE kernel, one K/V update, sdpa, o_proj, add, rms_norm, gate_up, SiLU gate, down, add)
    against mlx-lm's 19, and a few for the embedding, the rope table, the head and the pick."""
    import sys
    from pathlib import Path

    import mlx.core as mx
    from fuselm.runtime_metal.sampling import Sampler

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from mlx_standins import fused_ops_as_one, standin_kernels

    with fused_ops_as_one():
        sess = Session(optimized("qwen3", "q4"), backend="mlx")
        sess.reset(24)
        b = sess.backend
        y = b.pick_token(sess.prefill([3, 4, 5, 6]), Sampler())
        for _ in range(4):  # past the checked step and the compile
            y = b.pick_token(sess.decode(y), Sampler())
        mx.eval(y, list(sess.buffers.values()))
        y = b.pick_token(sess.decode(y), Sampler())
        counts = standin_kernels([y, *sess.buffers.values()])
    layers = sess.meta["dims"]["layers"]
    top = dict(counts["top"])
    assert sess.mode is Decode.COMPILED and sess.packed
    assert top["ScaledDotProductAttention"] == layers and top["SliceUpdate"] == layers and "RoPE" not in top
    assert top["RMSNorm"] == 3 * layers + 1 and top["QuantizedMatmul"] == 4 * layers + 1
    assert counts["kernels"] <= 13 * layers + 16, counts["top"]


def test_sliding_window_decode_reads_the_windows_rows(optimized, monkeypatch):
    """Past the window (4), a decode step's sdpa gets the last 4 rows only, and no mask."""
    sess = Session(optimized("mistral", "f32", sliding_window=4), backend="mlx", compile=False)
    seen = []
    real = sess.backend.sdpa

    def spy(q, k, v, mask, scale):
        seen.append((k.shape[2], mask))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(sess.backend, "sdpa", spy)
    sess.reset(10)
    sess.prefill([3])
    sess.decode(5)  # the checked step
    seen.clear()
    for t in range(5):
        sess.decode(6 + t)
    layers = sess.meta["dims"]["layers"]
    assert seen == [(min(4, 3 + t), None) for t in range(5) for _ in range(layers)]  # rows 0..pos, then 4


@pytest.mark.parametrize("skip", [(), ("RoPETo3D",), ("FuseRoPENorm", "RoPETo3D")])
def test_qkv_heads_takes_every_fused_rope_form(exported, tmp_path, skip):
    """rewrites/qkv_heads.py matches FusedRoPE on [B,S,H·D] with its norm weight (the default pipeline), between
    head Reshapes with the weight, and after a separate RMSNormalization: one QKVHeads per layer, no
    FusedRoPE left, logits equal torch's (which runs the op table's FusedRoPE)."""
    model = fuselm.optimize(exported("qwen3", "f32"), tmp_path / "opt", skip=skip, quiet=True)
    sess = Session(model, backend="mlx")
    ops = [n.op_type for n in sess.graph.nodes]
    assert ops.count("QKVHeads") == sess.meta["dims"]["layers"] and "FusedRoPE" not in ops
    ids = [3, 4, 5, 6, 2]
    got, want = _logits(sess, ids, 3), _logits(Session(model, backend="torch"), ids, 3)
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(got).max())


def test_few_causal_queries_in_groups_match_one_call(monkeypatch):
    """A verification's few causal queries over the filled rows, in groups of VECTOR_ROWS (MLX's CUDA vector
    kernel; cuDNN would build a graph per key length): each group over the keys up to its own last row gives what
    one causal call over all of them gives (grouped-query heads, 2-7 rows, groups of 1 and 3; forced here on the
    CPU). Half precision goes one row a call: MLX's CUDA sdpa takes cuDNN for any half query of more than one row."""
    import mlx.core as mx
    from fuselm.runtime_metal.backends import mlx_backend
    from fuselm.runtime_metal.backends.mlx_backend import VECTOR_ROWS, MLXBackend

    assert VECTOR_ROWS["bf16"] == VECTOR_ROWS["f16"] == 1 < VECTOR_ROWS["f32"]
    b = MLXBackend(device="cpu")
    rng = np.random.default_rng(0)
    for n in sorted(set(VECTOR_ROWS.values())):
        for rows in range(n + 1, 8):
            q, k, v = (mx.array(rng.standard_normal((1, h, s, 16)).astype(np.float32))
                       for h, s in ((4, rows), (2, 9 + rows), (2, 9 + rows)))
            whole = np.array(b.sdpa(q, k, v, "causal", 0.25))
            b.vector_rows = n
            grouped = np.array(b.sdpa(q, k, v, "causal", 0.25))
            b.vector_rows = None
            np.testing.assert_allclose(grouped, whole, atol=1e-5)
            assert not np.allclose(whole[:, :, 0], np.array(b.sdpa(q[:, :, :1], k, v, None, 0.25))[:, :, 0],
                                   atol=1e-3)
    seen = []  # the rows of each call MLX's sdpa gets, in bfloat16 with CUDA's groups
    real = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mlx_backend.mx.fast, "scaled_dot_product_attention",
                        lambda q, *a, **k: (seen.append(q.shape[2]), real(q, *a, **k))[1])
    half = MLXBackend(device="cpu", dtype="bf16")
    half.vector_rows = VECTOR_ROWS[half.compute]
    q, k, v = (mx.array(rng.standard_normal((1, 2, s, 16))).astype(mx.bfloat16) for s in (5, 12, 12))
    half.sdpa(q, k, v, "causal", 0.25)
    assert seen == [1] * 5
