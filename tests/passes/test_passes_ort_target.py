"""The onnxruntime target's lowering passes on tiny graphs: each fires where it should (onnxruntime on the
lowered graph equals onnxruntime, optimizations off, on the standard one) and says why where it must not."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from fuselm.passes.ort_gather_quantized import OrtGatherBlockQuantized
from fuselm.passes.ort_gqa import OrtGroupQueryAttention
from fuselm.passes.ort_matmul_nbits import OrtMatMulNBits
from fuselm.passes.ort_packed_qkv import OrtPackedQKV
from fuselm.passes.ort_skip_norm import OrtSkipRMSNorm
from onnx import TensorProto
from onnx import helper as oh
from passes_helpers import G, assert_same, dq_weight, ops, quantize_uint4

from fuselm import contract
from fuselm.graphcheck import check_graph_file

K, N = 64, 48


def lower(pass_, model: onnx.ModelProto, tmp_path):
    """Run one pass; the result must pass fuselm's graph checker (onnxruntime loads its contrib ops)."""
    m, modified, stats = pass_(ir.serde.deserialize_model(model))
    out = ir.serde.serialize_model(m)
    path = tmp_path / f"{pass_.name}.onnx"
    onnx.save(out, str(path))
    check_graph_file(path)
    return out, modified, stats


def reasons(stats) -> str:
    return " | ".join(r for _, r in stats.skipped)


# ---- MatMulNBits -------------------------------------------------------------------------------

def projection(kind: str, block: int = 16) -> G:
    g = G()
    g.inp("x", [1, 3, K])
    if kind == "transposed":  # a tied lm_head: DequantizeLinear([N, K] blocked along axis 1) -> Transpose
        w = (g.rng.standard_normal((K, N)) * 0.3).astype(np.float32)
        q, s, z = quantize_uint4(w, block)
        qn = g.raw_init("t.qweight", TensorProto.UINT8, [N, K], q.T.ravel().tolist())
        zn = g.raw_init("t.zero_points", TensorProto.UINT8, [N, K // block], z.T.ravel().tolist())
        dq = g.node("DequantizeLinear", [qn, g.init("t.scales", np.ascontiguousarray(s.T)), zn], axis=1,
                    block_size=block)
        w = g.node("Transpose", [dq], perm=[1, 0])
    elif kind == "per-channel":
        q = g.raw_init("w.qweight", TensorProto.UINT8, [K, N], g.rng.integers(0, 255, K * N).tolist())
        w = g.node("DequantizeLinear", [q, g.init("w.scales", np.full([N], 0.01, np.float32))], axis=1)
    elif kind == "int4":
        w = (g.rng.standard_normal((K, N)) * 0.3).astype(np.float32)
        q, s, z = quantize_uint4(w, block)
        qn = g.raw_init("w.qweight", TensorProto.INT4, [K, N], (q.astype(int) - 8).ravel().tolist())
        zn = g.raw_init("w.zero_points", TensorProto.INT4, list(z.shape), (z.astype(int) - 8).ravel().tolist())
        w = g.node("DequantizeLinear", [qn, g.init("w.scales", s), zn], axis=0, block_size=block)
    elif kind == "no-zero-point":
        qn = g.raw_init("w.qweight", TensorProto.UINT4, [K, N], g.rng.integers(0, 16, K * N).tolist())
        w = g.node("DequantizeLinear", [qn, g.init("w.scales", np.full([K // block, N], 0.02, np.float32))], axis=0,
                   block_size=block)
    else:
        bits = 8 if kind == "q8" else 4
        w = dq_weight(g, "w", [K, N], block=block, bits=bits,
                      dtype=TensorProto.UINT8 if bits == 8 else TensorProto.UINT4)
    g.out(g.node("MatMul", ["x", w], name="/model/layers.0/mlp/down_proj/MatMul"), "y")
    return g


@pytest.mark.parametrize("kind", ["q4", "q8", "int4", "no-zero-point", "transposed"])
def test_matmul_nbits_fires_and_matches(kind, tmp_path):
    g = projection(kind)
    before = g.model()
    exact, modified, stats = lower(OrtMatMulNBits(accuracy_level=1), before, tmp_path)
    assert modified and ops(exact) == ["MatMulNBits", "Identity"], (ops(exact), reasons(stats))
    node = exact.graph.node[0]
    attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "com.microsoft" and (attrs["K"], attrs["N"], attrs["block_size"]) == (K, N, 16)
    assert_same(before, exact, g.feeds, rtol=1e-5)  # float32 activations: the dequantized MatMul exactly
    fast, _, _ = lower(OrtMatMulNBits(), before, tmp_path)  # default level 4: int8 activations
    assert {a.name: a.i for a in fast.graph.node[0].attribute}["accuracy_level"] == 4
    assert_same(before, fast, g.feeds, rtol=3e-2)


@pytest.mark.parametrize("kind,block,why", [
    ("per-channel", 16, r"not blocked \(block_size 0"),
    ("q4", 8, r"block_size 8 is not a power of two >= 16"),
])
def test_matmul_nbits_must_not_fire(kind, block, why, tmp_path):
    _, modified, stats = lower(OrtMatMulNBits(), projection(kind, block).model(), tmp_path)
    assert not modified
    assert pytest.importorskip("re").search(why, reasons(stats)), reasons(stats)


# ---- Skip/SimplifiedLayerNormalization -----------------------------------------------------

def norms(bias_add: bool = False, axis: int = -1) -> G:
    """h = a + b; y = RMSNorm(h) (axis); z = h + y (the sum read again); also RMSNorm(a) alone."""
    g = G()
    g.inp("a", [1, 3, 32])
    g.inp("b", [1, 3, 32])
    w = g.weight("norm.weight", [32] if axis == -1 else [3, 32])
    h = g.node("Add", ["a", g.weight("bias", [32]) if bias_add else "b"])
    y = g.node("RMSNormalization", [h, w], axis=axis, epsilon=1e-6)
    g.out(g.node("Add", [h, y]), "z")
    g.out(g.node("RMSNormalization", ["a", g.weight("first.weight", [32])], epsilon=1e-6), "first")
    return g


def test_skip_norm_folds_the_residual(tmp_path):
    g = norms()
    before = g.model()
    after, modified, _ = lower(OrtSkipRMSNorm(), before, tmp_path)
    assert modified and sorted(ops(after)).count("Add") == 1  # the one reading the sum (output 3)
    assert {"SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"} <= set(ops(after))
    skip = next(n for n in after.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert skip.domain == "com.microsoft" and skip.output[3] and not skip.output[1]
    assert_same(before, after, g.feeds, rtol=1e-5)


def test_skip_norm_keeps_a_broadcast_add_outside_and_refuses_other_axes(tmp_path):
    g = norms(bias_add=True)
    after, _, _ = lower(OrtSkipRMSNorm(), g.model(), tmp_path)
    assert "SkipSimplifiedLayerNormalization" not in ops(after) and ops(after).count("Add") == 2
    assert_same(g.model(), after, g.feeds, rtol=1e-5)
    _, _, stats = lower(OrtSkipRMSNorm(), norms(axis=1).model(), tmp_path)
    assert "normalizes from axis 1, not the last one alone" in reasons(stats)


# ---- GroupQueryAttention -------------------------------------------------------------------

H, KV, D = 4, 2, 16
INV = 1.0 / 10000 ** (np.arange(0, D, 2) / D)


def attention(mask: str = "causal", rope: str = "both", interleaved: int = 0, head_dim: int = D,
              rotary: int | None = None, packed: str = "no", reader: bool = False) -> G:
    """One 3-D Attention-23 over a past, q/k rotated by FusedRoPE after a Reshape to heads, the mask
    computed from attention_mask as fuselm's exporter does (causal and padding, or variants: chunked). `packed`
    "yes": q, k, v are one Split of a fused qkv input (FuseQKV's form); "shared": k is also a graph output.
    `reader`: its presents are no graph outputs (a layer that reads another layer's cache: KV sharing)."""
    g = G()
    s, p = 3, 4
    hd = head_dim
    if packed == "no":
        g.inp("q", [1, "seq", H * hd], value=g.rng.standard_normal((1, s, H * hd)).astype(np.float32))
        g.inp("k", [1, "seq", KV * hd], value=g.rng.standard_normal((1, s, KV * hd)).astype(np.float32))
        g.inp("v", [1, "seq", KV * hd], value=g.rng.standard_normal((1, s, KV * hd)).astype(np.float32))
    else:
        width = (H + 2 * KV) * hd
        g.inp("qkv", [1, "seq", width], value=g.rng.standard_normal((1, s, width)).astype(np.float32))
        sizes = g.init("qkv_sizes", np.array([H * hd, KV * hd, KV * hd], np.int64))
        g.nodes.append(oh.make_node("Split", ["qkv", sizes], ["q", "k", "v"], name="/model/layers.0/attn/qkv_proj/Split",
                                    axis=-1))
        if packed == "shared":
            g.out("k", "k_out")
    g.inp("attention_mask", [1, "total"], TensorProto.INT64, np.ones((1, p + s), np.int64))
    g.inp("position_ids", [1, "seq"], TensorProto.INT64, np.arange(p, p + s)[None])
    for kind in ("key", "value"):
        g.inp(f"past_key_values.0.{kind}", [1, KV, "past", hd], value=g.rng.standard_normal((1, KV, p, hd)).astype(np.float32))
    g.inits.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "one"))
    total = g.node("Shape", ["attention_mask"], start=1, end=2)
    g.inp("input_ids", [1, "seq"], TensorProto.INT64, np.zeros((1, s), np.int64))
    seq = g.node("Shape", ["input_ids"], start=1, end=2)
    past = g.node("Squeeze", [g.node("Sub", [total, seq]), g.init("ax0", np.array([0], np.int64))])
    t = g.node("Squeeze", [total, "ax0"])
    keys = g.node("Range", [g.init("zero", np.array(0, np.int64)), t, g.init("step", np.array(1, np.int64))])
    rows = g.node("Unsqueeze", [g.node("Range", [past, t, "step"]), "one"])
    allowed = g.node("Cast", [g.node("Unsqueeze", ["attention_mask", g.init("ax12", np.array([1, 2], np.int64))])],
                     to=TensorProto.BOOL)
    if mask != "padding-only":
        causal = g.node("LessOrEqual", [keys, rows])
        allowed = g.node("And", [causal, allowed])
    if mask == "chunked":  # Llama 4's chunked local attention: keys of the query's own block of 2 indices
        two = g.init("two", np.array(2, np.int64))
        same = g.node("Equal", [g.node("Div", [keys, two]), g.node("Div", [rows, two])])
        allowed = g.node("And", [same, allowed])
    additive = g.node("Where", [allowed, g.init("z0", np.array(0, np.float32)),
                                g.init("neg", np.array(-3.4e38, np.float32))])
    qk = []
    for x, heads, role in (("q", H, "q"), ("k", KV, "k")):
        if rope == "both" or (rope == "q-only" and role == "q"):
            x4 = g.node("Reshape", [x, g.init(f"{role}4", np.array([0, 0, heads, hd], np.int64))])
            g.nodes.append(contract.fused_rope_node(x4, "position_ids", f"{role}_rot", f"/model/layers.0/attn/{role}_rope",
                                                    INV[: (rotary or hd) // 2], 1.0, interleaved))
            x = g.node("Reshape", [f"{role}_rot", g.init(f"{role}3", np.array([0, 0, heads * hd], np.int64))])
        qk.append(x)
    y, _, _ = g.node("Attention", [*qk, "v", additive, "past_key_values.0.key", "past_key_values.0.value"], n_out=3,
                       name="/model/layers.0/attn/Attention", q_num_heads=H, kv_num_heads=KV)
    g.out(y, "y")
    if reader:  # a KV-sharing reader (Gemma 3n / 4): its presents are another layer's, not outputs
        return g
    g.nodes[-2].output[1:] = ["present.0.key", "present.0.value"]  # the Attention's presents are graph outputs
    for name in ("present.0.key", "present.0.value"):
        g.outputs.append(oh.make_tensor_value_info(name, TensorProto.FLOAT, [1, KV, "total", hd]))
    return g


def model_of(g: G) -> onnx.ModelProto:
    m = g.model()
    m.opset_import.append(oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION))
    m.functions.extend(contract.functions_for(m.graph.node))
    return m


@pytest.mark.parametrize("interleaved,head_dim,rotary", [(0, D, None), (1, D, None), (0, 2 * D, D)])
def test_gqa_fires_and_matches_prefill_and_decode(interleaved, head_dim, rotary, tmp_path):
    """rotate_half and interleaved FusedRoPE (GQA's rotary_interleaved), and partial rotary (rd < D)."""
    g = attention(interleaved=interleaved, head_dim=head_dim, rotary=rotary)
    before = model_of(g)
    after, modified, stats = lower(OrtGroupQueryAttention(max_length=64), before, tmp_path)
    assert modified, reasons(stats)
    assert "GroupQueryAttention" in ops(after) and "FusedRoPE" not in ops(after) and "Attention" not in ops(after)
    assert not after.functions and contract.DOMAIN not in {o.domain for o in after.opset_import}
    gqa = next(n for n in after.graph.node if n.op_type == "GroupQueryAttention")
    assert {a.name: a.i for a in gqa.attribute if a.type == onnx.AttributeProto.INT}["rotary_interleaved"] == interleaved
    assert_same(before, after, g.feeds, rtol=1e-5)  # a decode-like chunk: 3 new tokens after 4 past
    prefill = dict(g.feeds, attention_mask=np.ones((1, 3), np.int64), position_ids=np.arange(3)[None],
                   input_ids=np.zeros((1, 3), np.int64),
                   **{f"past_key_values.0.{k}": np.zeros((1, KV, 0, head_dim), np.float32) for k in ("key", "value")})
    assert_same(before, after, prefill, rtol=1e-5)


@pytest.mark.parametrize("kw,why", [
    ({"mask": "padding-only"}, "the mask is not causal + attention_mask padding"),
    ({"mask": "chunked"}, "the mask is not causal + attention_mask padding"),
    ({"reader": True}, "no past inputs and present graph outputs"),
    ({"rope": "q-only"}, "only one of q and k is rotated"),
    ({"head_dim": 8}, "head size 8 is not a multiple of 16"),
    ({"rotary": D // 2}, "rotary dim 8 is not a multiple of 16"),
])
def test_gqa_must_not_fire(kw, why, tmp_path):
    _, modified, stats = lower(OrtGroupQueryAttention(), model_of(attention(**kw)), tmp_path)
    assert not modified and why in reasons(stats), reasons(stats)


@pytest.mark.parametrize("rope", ["both", "none"])
def test_packed_qkv_fires_and_matches(rope, tmp_path):
    """GQA reads the fused projection's output as packed QKV (rotated inside GQA, or not rotated): the
    Split goes, the numbers stay (prefill-like and decode-like chunks)."""
    g = attention(rope=rope, packed="yes")
    before = model_of(g)
    mid, modified, stats = lower(OrtGroupQueryAttention(max_length=64), before, tmp_path)
    assert modified and "Split" in ops(mid), reasons(stats)
    after, modified, stats = lower(OrtPackedQKV(), mid, tmp_path)
    assert modified and "Split" not in ops(after), reasons(stats)
    gqa = next(n for n in after.graph.node if n.op_type == "GroupQueryAttention")
    assert list(gqa.input[:3]) == ["qkv", "", ""]
    assert_same(before, after, g.feeds, rtol=1e-5)
    prefill = dict(g.feeds, attention_mask=np.ones((1, 3), np.int64), position_ids=np.arange(3)[None],
                   input_ids=np.zeros((1, 3), np.int64),
                   **{f"past_key_values.0.{k}": np.zeros((1, KV, 0, D), np.float32) for k in ("key", "value")})
    assert_same(before, after, prefill, rtol=1e-5)


def test_packed_qkv_must_not_fire(tmp_path):
    """A Split output read elsewhere; q/k through their own Reshape -> norm -> Reshape (Qwen3's q/k norms:
    GQA's query is no Split output)."""
    mid, _, _ = lower(OrtGroupQueryAttention(max_length=64), model_of(attention(packed="shared")), tmp_path)
    _, modified, stats = lower(OrtPackedQKV(), mid, tmp_path)
    assert not modified and "is read outside the attention" in reasons(stats), reasons(stats)
    mid, _, _ = lower(OrtGroupQueryAttention(max_length=64), model_of(attention()), tmp_path)
    _, modified, stats = lower(OrtPackedQKV(), mid, tmp_path)
    assert not modified and "are not outputs of one Split" in reasons(stats), reasons(stats)


# ---- GatherBlockQuantized ------------------------------------------------------------------

def embedding(form: str, bits: int = 4) -> G:
    """A [V, H] table blocked along its rows: Gather(DequantizeLinear(table)), or the rows of each part gathered
    (fuselm's exporter; uint8 only there: onnxruntime's Gather takes no uint4)."""
    g = G()
    v, h, block = 40, 32, 16
    g.inp("input_ids", [1, 3], TensorProto.INT64, np.array([[3, 39, 0]], np.int64))
    g.inp("other_ids", [1, 3], TensorProto.INT64, np.array([[1, 2, 3]], np.int64))
    w = (g.rng.standard_normal((h, v)) * 0.3).astype(np.float32)
    q, s, z = quantize_uint4(w, block)
    dtype = TensorProto.UINT8 if bits == 8 else TensorProto.UINT4
    scale = 16 if bits == 8 else 1
    qn = g.raw_init("embed.qweight", dtype, [v, h], (q.T * scale).ravel().tolist())
    sn = g.init("embed.scales", np.ascontiguousarray(s.T) / scale)
    zn = g.raw_init("embed.zero_points", dtype, [v, h // block], (z.T * scale).ravel().tolist())
    if form == "dq-then-gather":
        y = g.node("Gather", [g.node("DequantizeLinear", [qn, sn, zn], axis=1, block_size=block), "input_ids"], axis=0)
    else:
        second = "other_ids" if form == "different-ids" else "input_ids"
        parts = [g.node("Gather", [t, i], axis=0) for t, i in ((qn, "input_ids"), (sn, second), (zn, "input_ids"))]
        y = g.node("DequantizeLinear", parts, axis=2, block_size=block)
    g.out(g.node("Identity", [y], name="/model/embed_tokens/out"), "hidden")
    return g


@pytest.mark.parametrize("form,bits", [("dq-then-gather", 4), ("dq-then-gather", 8), ("gather-then-dq", 8)])
def test_gather_block_quantized_fires_and_matches(form, bits, tmp_path):
    g = embedding(form, bits)
    after, modified, stats = lower(OrtGatherBlockQuantized(), g.model(), tmp_path)
    assert modified and "GatherBlockQuantized" in ops(after) and "DequantizeLinear" not in ops(after), reasons(stats)
    assert_same(g.model(), after, g.feeds, rtol=1e-6)


def test_gather_block_quantized_must_not_fire_on_different_indices(tmp_path):
    _, modified, stats = lower(OrtGatherBlockQuantized(), embedding("different-ids", 8).model(), tmp_path)
    assert not modified and "the Gathers do not read the same indices" in reasons(stats)


def test_graph_checker_has_onnxruntime_refuse_a_broken_contrib_op(tmp_path):
    """onnx.checker knows no contrib-op schema: fuselm's checker has onnxruntime load the graph."""
    from fuselm.errors import FuselmError

    good, _, _ = lower(OrtMatMulNBits(), projection("q4").model(), tmp_path)
    node = good.graph.node[0]
    kept = [a for a in node.attribute if a.name != "K"]
    del node.attribute[:]
    node.attribute.extend(kept)
    onnx.save(good, str(tmp_path / "broken.onnx"))
    with pytest.raises(FuselmError, match=r"onnxruntime rejects the graph's contrib ops: .*MatMulNBits"):
        check_graph_file(tmp_path / "broken.onnx")


def test_tied_table_becomes_matmul_nbits_and_gather_block_quantized_sharing_it(tmp_path):
    """One DequantizeLinear of a [V, H] uint4 table read by the embedding's Gather and the lm_head's
    Transpose -> MatMul (`fuselm convert --lm-head q4` on a tied checkpoint): both lowered, one packed copy."""
    g = embedding("dq-then-gather", 4)
    dq = next(n for n in g.nodes if n.op_type == "DequantizeLinear").output[0]
    g.inp("h", [1, 3, 32])
    g.out(g.node("MatMul", ["h", g.node("Transpose", [dq], perm=[1, 0])], name="/model/lm_head/MatMul"), "logits")
    before = g.model()
    mid, _, _ = lower(OrtMatMulNBits(accuracy_level=1), before, tmp_path)
    after, _, _ = lower(OrtGatherBlockQuantized(), mid, tmp_path)
    assert {"MatMulNBits", "GatherBlockQuantized"} <= set(ops(after)) and "DequantizeLinear" not in ops(after)
    assert len([t for t in after.graph.initializer if t.name.endswith(".nbits")]) == 1
    assert_same(before, after, g.feeds, rtol=1e-5)
