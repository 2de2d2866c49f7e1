"""FuseAttention and FuseRoPE on tiny graphs: HF eager attention with a cache, rotate_half RoPE."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.passes.fuse_attention import FuseAttention
from fuselm.passes.fuse_rope import FuseRoPE
from onnx import TensorProto
from onnx import helper as oh
from passes_helpers import G, apply, assert_same, ops

B, S, P, D = 1, 3, 2, 8


def attn_graph(heads=4, kv_heads=2, scale="mul", mask=True, softmax_axis=-1, scale_input=False,
               value_layer=0, cache=True, cacheless_op=False, sdpa=None):
    """HF eager attention; `sdpa` writes torch's SDPA decomposition instead (opsets < 23): sqrt(scale)
    on Q and Kᵀ, Kᵀ as Reshape-Transpose-Reshape, Where(IsNaN(p), 0, p) after Softmax ("guard":
    that Where with 1 instead of 0, which is no NaN guard)."""
    g = G()
    q = g.inp("q", [B, S, heads, D])
    k = g.inp("k", [B, S, kv_heads, D])
    v = g.inp("v", [B, S, kv_heads, D])
    perm = [0, 2, 1, 3]
    q, k, v = (g.node("Transpose", [t], perm=perm) for t in (q, k, v))
    kv = []
    for kind, new, layer in (("key", k, 0), ("value", v, value_layer)):
        if cache:
            past = g.inp(f"past_key_values.{layer}.{kind}", [B, kv_heads, P, D])
            new = g.node("Concat", [past, new], axis=2)
            g.nodes[-1].output[0] = f"present.{layer}.{kind}"
            new = f"present.{layer}.{kind}"
        if heads != kv_heads:
            x = g.node("Unsqueeze", [new, g.init(f"ax2_{kind}", np.array([2], np.int64))])
            x = g.node("Expand", [x, g.init(f"rep_{kind}", np.array([1, 1, heads // kv_heads, 1, 1], np.int64))])
            new = g.node("Reshape", [x, g.init(f"shape_{kind}", np.array([0, heads, -1, D], np.int64))])
        kv.append(new)
    total = P + S if cache else S
    causal = np.triu(np.full((S, total), np.finfo(np.float32).min, np.float32), k=total - S + 1)[None, None]
    if cacheless_op:  # an Attention-23 that reads the expanded cache (onnxscript's rewrite)
        out = g.node("Attention", [q, kv[0], kv[1], g.inp("mask", [B, 1, S, total], value=causal)], scale=D ** -0.5)
        return _finish(g, out, heads, kv_heads, cache, value_layer)
    if sdpa:
        half = g.init("sqrt_scale", np.array(D ** -0.25, np.float32))
        flat = g.node("Reshape", [kv[0], g.init("flat3", np.array([-1, P + S if cache else S, D], np.int64))])
        kt = g.node("Reshape", [g.node("Transpose", [flat], perm=[0, 2, 1]),
                                g.init("back4", np.array([B, heads, D, -1], np.int64))])
        scores = g.node("MatMul", [g.node("Mul", [q, half]), g.node("Mul", [kt, half])])
        scores = g.node("Add", [scores, g.inp("mask", [B, 1, S, P + S], value=causal)])
        probs = g.node("Softmax", [scores], axis=-1)
        fill = g.init("fill", np.array(0.0 if sdpa != "guard" else 1.0, np.float32))
        probs = g.node("Where", [g.node("IsNaN", [probs]), fill, probs])
        return _finish(g, g.node("MatMul", [probs, kv[1]]), heads, kv_heads, cache, value_layer)
    scores = g.node("MatMul", [q, g.node("Transpose", [kv[0]], perm=[0, 1, 3, 2])])
    c = g.inp("c", [], value=np.array(D ** -0.5, np.float32)) if scale_input else None
    if scale == "mul":
        scores = g.node("Mul", [scores, c or g.init("scale", np.array(D ** -0.5, np.float32))])
    elif scale == "div":
        scores = g.node("Div", [scores, g.init("scale", np.array(D ** 0.5, np.float32))])
    if mask:
        scores = g.node("Add", [scores, g.inp("mask", [B, 1, S, total], value=causal)])
    probs = g.node("Softmax", [scores], axis=softmax_axis)
    return _finish(g, g.node("MatMul", [probs, kv[1]]), heads, kv_heads, cache, value_layer)


def _finish(g, out, heads, kv_heads, cache, value_layer):
    out = g.node("Transpose", [out], perm=[0, 2, 1, 3])
    g.out(g.node("Reshape", [out, g.init("flat", np.array([0, 0, heads * D], np.int64))]), "attn_out")
    if cache:
        g.outputs += [oh.make_tensor_value_info(f"present.{layer}.{kind}", TensorProto.FLOAT, ["b", kv_heads, "t", D])
                      for kind, layer in (("key", 0), ("value", value_layer))]
    return g


@pytest.mark.parametrize("kwargs", [dict(), dict(heads=4, kv_heads=4), dict(heads=4, kv_heads=1, scale="div"),
                                    dict(mask=False), dict(cache=False), dict(sdpa=True),
                                    dict(sdpa=True, heads=2, kv_heads=2)])
def test_fuse_attention_fires(kwargs):
    g = attn_graph(**kwargs)
    before = g.model()
    after, modified, stats = apply(FuseAttention(), before)
    assert modified and stats.fired
    assert ops(after).count("Attention") == 1
    assert not {"Softmax", "Expand", "MatMul", "IsNaN", "Where"} & set(ops(after))
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    node = next(n for n in after.graph.node if n.op_type == "Attention")
    attrs = {a.name: a for a in node.attribute}
    assert attrs["q_num_heads"].i == kwargs.get("heads", 4) and attrs["kv_num_heads"].i == kwargs.get("kv_heads", 2)
    assert abs(attrs["scale"].f - D ** -0.5) < 1e-7
    assert_same(before, after, g.feeds)
    assert not apply(FuseAttention(), after)[1]


@pytest.mark.parametrize("case,kwargs,reason", [
    ("softmax over another axis", dict(softmax_axis=2), "not the last"),
    ("scale from an input", dict(scale_input=True), "scale is not a non-zero constant"),
    ("K and V from different layers", dict(value_layer=1), "different layers"),
    ("Where after Softmax that is no NaN guard", dict(sdpa="guard"), "not as Where(IsNaN(p), 0, p)"),
])
def test_fuse_attention_must_not_fire(case, kwargs, reason):
    before = attn_graph(**kwargs).model()
    after, modified, stats = apply(FuseAttention(), before)
    assert not modified and ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def test_fuse_attention_moves_the_cache_into_a_cacheless_attention():
    """onnxscript's form: Attention(q, repeat_kv(Concat(past, k)), repeat_kv(Concat(past, v)), mask)."""
    g = attn_graph(cacheless_op=True)
    before = g.model()
    after, modified, stats = apply(FuseAttention(), before)
    assert modified and ops(after).count("Attention") == 1 and "Expand" not in ops(after)
    node = next(n for n in after.graph.node if n.op_type == "Attention")
    assert list(node.input[4:]) == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert_same(before, after, g.feeds)


H = 2


def rope_graph(layout="bhsd", freqs="mul", table=None, sin_scale=1.0, split=None, scale=1.0, rotary=D,
               tail_start=None, interleaved=False, interleaved_odd=1):
    """x·cos + rotate_half(x)·sin; `rotary` < D: HF's partial rotary (x[..., :rotary] rotated, the rest
    concatenated back); `table`: cos/sin gathered by position from cached tables ("rows": after a
    [:n] slice, as older HF; "random": tables that are no cos/sin of positions)."""
    g = G()
    shape = [B, H, S, D] if layout == "bhsd" else [B, S, H, D]
    x_all = g.inp("x", shape)
    pos = g.inp("position_ids", [B, S], TensorProto.INT64, value=np.array([[5, 6, 7]], np.int64))
    inv = (1.0 / (10000 ** (np.arange(0, rotary, 2) / rotary))).astype(np.float32)
    split = rotary // 2 if split is None else split
    last = g.init("ax_d", np.array([-1], np.int64))
    zero, end = g.init("zero", np.array([0], np.int64)), g.init("end", np.array([2**62], np.int64))
    x = x_all
    if rotary < D:
        x = g.node("Slice", [x_all, zero, g.init("rd", np.array([rotary], np.int64)), last])
    if table:  # optimum-style: cos/sin gathered from precomputed tables
        emb = np.concatenate([np.outer(np.arange(32), inv)] * 2, axis=-1).astype(np.float32)
        if interleaved:
            emb = np.repeat(np.outer(np.arange(32), inv), 2, axis=-1).astype(np.float32)
        if table == "random":  # Concat(angles, angles) of angles that grow with no inv_freq
            emb = np.concatenate([np.random.default_rng(3).uniform(0, 6, (32, rotary // 2))] * 2, -1).astype(np.float32)
            emb[0] = 0  # position 0 unrotated, as a real table
        elif table == "unpaired":
            emb = np.random.default_rng(3).uniform(0, 6, emb.shape).astype(np.float32)
        cos_t, sin_t = g.init("cos_cached", scale * np.cos(emb)), g.init("sin_cached", scale * sin_scale * np.sin(emb))
        if table == "rows":
            n = g.init("n_rows", np.array([16], np.int64))
            cos_t = g.node("Slice", [cos_t, zero, n, g.init("ax0", np.array([0], np.int64))])
            sin_t = g.node("Slice", [sin_t, zero, n, "ax0"])
        cos = g.node("Gather", [cos_t, pos], axis=0)
        sin = g.node("Gather", [sin_t, pos], axis=0)
    else:
        if freqs == "mul":
            p = g.node("Cast", [g.node("Unsqueeze", [pos, g.init("ax_last", np.array([-1], np.int64))])], to=TensorProto.FLOAT)
            f = g.node("Mul", [p, g.init("model.rotary_emb.inv_freq", inv)])
        else:  # HF: inv_freq[None, :, None].expand(B, -1, 1) @ position_ids[:, None, :].float(), transposed
            inv3 = g.node("Expand", [g.init("model.rotary_emb.inv_freq", inv[None, :, None]),
                                     g.init("exp_shape", np.array([B, D // 2, 1], np.int64))])
            p = g.node("Cast", [g.node("Unsqueeze", [pos, g.init("ax1", np.array([1], np.int64))])], to=TensorProto.FLOAT)
            f = g.node("Transpose", [g.node("MatMul", [inv3, p])], perm=[0, 2, 1])
        if interleaved:  # repeat_interleave(freqs, 2, -1) as torch.onnx writes it
            f2 = g.node("Unsqueeze", [f, last])
            f2 = g.node("Expand", [f2, g.init("rep2", np.array([1, 1, 1, 2], np.int64))])
            emb = g.node("Reshape", [f2, g.init("emb_shape", np.array([B, S, rotary], np.int64))])
        else:
            emb = g.node("Concat", [f, f], axis=-1)
        cos = g.node("Mul", [g.node("Cos", [emb]), g.init("scale_c", np.array(scale, np.float32))])
        sin = g.node("Mul", [g.node("Sin", [emb]), g.init("scale_s", np.array(scale * sin_scale, np.float32))])
    axis = 1 if layout == "bhsd" else 2
    cos = g.node("Unsqueeze", [cos, g.init("ax_h", np.array([axis], np.int64))])
    sin = g.node("Unsqueeze", [sin, "ax_h"])
    if interleaved:  # rotate_every_two: stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
        two = g.init("two", np.array([2], np.int64))
        even = g.node("Slice", [x, zero, end, last, two])
        odd = g.node("Slice", [x, g.init("one", np.array([interleaved_odd], np.int64)), end, last, two])
        rot = g.node("Concat", [g.node("Unsqueeze", [g.node("Neg", [odd]), last]), g.node("Unsqueeze", [even, last])],
                     axis=-1)
        rot = g.node("Reshape", [rot, g.init("flat_shape", np.array(shape[:3] + [rotary], np.int64))])
    else:
        x1 = g.node("Slice", [x, zero, g.init("h", np.array([split], np.int64)), last])
        x2 = g.node("Slice", [x, "h", end, last])
        rot = g.node("Concat", [g.node("Neg", [x2]), x1], axis=-1)
    y = g.node("Add", [g.node("Mul", [x, cos]), g.node("Mul", [rot, sin])])
    if rotary < D:
        start = g.init("tail", np.array([rotary if tail_start is None else tail_start], np.int64))
        y = g.node("Concat", [y, g.node("Slice", [x_all, start, end, last])], axis=-1)
    g.out(y, "y", rank=4)
    return g


@pytest.mark.parametrize("kwargs", [dict(), dict(layout="bshd"), dict(freqs="matmul"), dict(scale=1.25),
                                    dict(table="gather"), dict(table="rows", layout="bshd"), dict(table="gather", scale=1.25),
                                    dict(rotary=D // 2), dict(rotary=D // 2, table="gather"),
                                    dict(interleaved=True), dict(interleaved=True, layout="bshd", table="gather")])
def test_fuse_rope_fires(kwargs):
    g = rope_graph(**kwargs)
    before = g.model()
    after, modified, stats = apply(FuseRoPE(), before)
    assert modified and ops(after).count("FusedRoPE") == 1
    assert not {"Cos", "Sin", "Neg", "Slice", "Gather", "Concat"} & set(ops(after))
    assert ops(after).count("Transpose") == (2 if kwargs.get("layout", "bhsd") == "bhsd" else 0)
    assert [f.name for f in after.functions] == ["FusedRoPE"]
    node = next(n for n in after.graph.node if n.op_type == "FusedRoPE")
    attrs = {a.name: a for a in node.attribute}
    rotary = kwargs.get("rotary", D)
    inv = (1.0 / (10000 ** (np.arange(0, rotary, 2) / rotary))).astype(np.float32)
    if kwargs.get("table"):  # recovered from the tables: equal to float32 rounding
        np.testing.assert_allclose(np.array(attrs["inv_freq"].floats, np.float32), inv, rtol=1e-5)
    else:
        assert np.array_equal(np.array(attrs["inv_freq"].floats, np.float32), inv)
    assert attrs["attention_scaling"].f == pytest.approx(kwargs.get("scale", 1.0))
    assert attrs["interleaved"].i == int(kwargs.get("interleaved", False))
    assert_same(before, after, g.feeds)
    assert not apply(FuseRoPE(), after)[1]


@pytest.mark.parametrize("case,kwargs,reason", [
    ("tables that are not cos/sin of positions", dict(table="random"), "tables are not cos/sin(position × inv_freq)"),
    ("table halves that differ", dict(table="unpaired"), "the table's halves differ"),
    ("sin scaled differently", dict(sin_scale=2.0), "scaled differently"),
    ("halves split elsewhere", dict(split=D // 4), f"rotate_half splits at {D // 4} but inv_freq has {D // 2} entries"),
    ("partial rotary, the rest from elsewhere", dict(rotary=D // 2, tail_start=D // 4), "partial rotary: the rotated"),
    ("interleaved pairs from the wrong offset", dict(interleaved=True, interleaved_odd=0), "not x[..., 0::2] and x[..., 1::2]"),
    ("interleaved rotation with a rotate_half angle", dict(interleaved=True, table="unpaired"), "the table's pairs differ"),
])
def test_fuse_rope_must_not_fire(case, kwargs, reason):
    g = rope_graph(**kwargs)
    before = g.model()
    after, modified, stats = apply(FuseRoPE(), before)
    assert not modified and ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def test_fuse_rope_standard_rotary_embedding():
    """onnxscript's fused form: RotaryEmbedding(x, Cos(freqs), Sin(freqs)) -> FusedRoPE."""
    g = G()
    x = g.inp("x", [B, H, S, D])
    pos = g.inp("position_ids", [B, S], TensorProto.INT64, value=np.array([[0, 1, 2]], np.int64))
    inv = (1.0 / (10000 ** (np.arange(0, D, 2) / D))).astype(np.float32)
    p = g.node("Cast", [g.node("Unsqueeze", [pos, g.init("ax", np.array([-1], np.int64))])], to=TensorProto.FLOAT)
    f = g.node("Mul", [p, g.init("inv_freq", inv)])
    g.out(g.node("RotaryEmbedding", [x, g.node("Cos", [f]), g.node("Sin", [f])], interleaved=0, num_heads=H), "y", rank=4)
    before = g.model()
    after, modified, _ = apply(FuseRoPE(), before)
    assert modified and "RotaryEmbedding" not in ops(after) and "FusedRoPE" in ops(after)
    assert_same(before, after, g.feeds)
