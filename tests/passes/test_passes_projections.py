"""FuseQKV, FuseGateUp, ReorderQKVProjections on tiny graphs: fire when they should, say why not."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.passes.fuse_gate_up import FuseGateUp
from fuselm.passes.fuse_qkv import FuseQKV
from fuselm.passes.reorder_qkv import ReorderQKVProjections
from onnx import TensorProto
from passes_helpers import G, apply, assert_same, dq_weight, ops

IN = 32


def qkv_graph(widths=(16, 8, 8), form="plain", bias=(False, False, False), inputs=("x", "x", "x"),
              forms=None, blocks=(16, 16, 16)):
    """x [1,3,IN] -> q/k/v projections (graph outputs q, k, v)."""
    g = G()
    for name in sorted(set(inputs)):
        g.inp(name, [1, 3, IN])
    outs = []
    for role, width, b, x, f, block in zip("qkv", widths, bias, inputs, forms or [form] * 3, blocks, strict=True):
        scope = f"/model/layers.0/attn/{role}_proj"
        wname = f"model.layers.0.self_attn.{role}_proj.weight"
        if f == "plain":
            w = g.weight(wname, [IN, width])
        elif f == "transposed":
            w = g.node("Transpose", [g.weight(wname, [width, IN])], perm=[1, 0])
        else:
            w = dq_weight(g, wname, [IN, width], block=block, bits=8 if f == "q8" else 4,
                          dtype=TensorProto.UINT8 if f == "q8" else TensorProto.UINT4)
        y = g.node("MatMul", [x, w], name=f"{scope}/MatMul")
        if b:
            y = g.node("Add", [y, g.weight(f"model.layers.0.self_attn.{role}_proj.bias", [width])], name=f"{scope}/Add")
        outs.append(g.out(y, role))
    return g


@pytest.mark.parametrize("form", ["plain", "transposed", "q4", "q8"])
def test_fuse_qkv_fires_and_keeps_numbers(form):
    # Odd widths make the uint4 nibbles of a row straddle bytes: concatenation must repack.
    g = qkv_graph(widths=(18, 6, 6) if form == "q4" else (16, 8, 8), form=form, bias=(True, True, True))
    before = g.model()
    after, modified, stats = apply(FuseQKV(), before)
    assert modified and stats.fired == ["/model/layers.0/attn/qkv_proj"]
    assert ops(after).count("MatMul") == 1 and ops(after).count("Split") == 1
    assert [o.name for o in after.graph.output] == ["q", "k", "v"]
    names = {i.name for i in after.graph.initializer}
    assert any("qkv_proj" in n for n in names) and not any("q_proj" in n for n in names)
    assert_same(before, after, g.feeds)
    again, modified2, _ = apply(FuseQKV(), after)
    assert not modified2 and again == after


@pytest.mark.parametrize("case,kwargs,reason", [
    ("different inputs", dict(inputs=("x", "y", "y")), "2 MatMuls read y"),
    ("k and v widths differ", dict(widths=(16, 8, 4)), "k and v widths differ"),
    ("q narrower than k", dict(widths=(4, 8, 8)), "not a multiple"),
    ("f32 vs quantized", dict(forms=["plain", "q4", "q4"]), "weights differ in form or quantization"),
    ("4-bit vs 8-bit", dict(forms=["q4", "q8", "q8"]), "weights differ in form or quantization"),
    ("block sizes differ", dict(form="q4", blocks=(16, 32, 32)), "weights differ in form or quantization"),
    ("bias on q only", dict(bias=(True, False, False)), "only some projections have a bias"),
])
def test_fuse_qkv_must_not_fire(case, kwargs, reason):
    before = qkv_graph(**kwargs).model()
    after, modified, stats = apply(FuseQKV(), before)
    assert not modified, case
    assert ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def mlp_graph(act="silu", inputs=("x", "x"), forms=("plain", "plain"), up_width=24):
    g = G()
    for name in sorted(set(inputs)):
        g.inp(name, [1, 3, IN])
    ys = []
    for role, x, f in zip(("gate", "up"), inputs, forms, strict=True):
        wname = f"model.layers.0.mlp.{role}_proj.weight"
        width = 24 if role == "gate" else up_width
        w = g.weight(wname, [IN, width]) if f == "plain" else dq_weight(g, wname, [IN, width])
        ys.append(g.node("MatMul", [x, w], name=f"/model/layers.0/mlp/{role}_proj/MatMul"))
    gate, up = ys
    if act == "silu":
        h = g.node("Mul", [gate, g.node("Sigmoid", [gate])])
    else:  # a sigmoid gate (GLU), not SiLU
        h = g.node("Sigmoid", [gate])
    y = g.node("Mul", [h, up])
    g.out(g.node("MatMul", [y, g.weight("model.layers.0.mlp.down_proj.weight", [24, IN])]), "mlp_out")
    return g


@pytest.mark.parametrize("forms", [("plain", "plain"), ("q4", "q4")])
def test_fuse_gate_up_fires(forms):
    g = mlp_graph(forms=forms)
    before = g.model()
    after, modified, stats = apply(FuseGateUp(), before)
    assert modified and stats.fired == ["/model/layers.0/mlp/gate_up_proj"]
    assert ops(after).count("MatMul") == 2 and "Split" in ops(after)
    assert_same(before, after, g.feeds)
    assert not apply(FuseGateUp(), after)[1]


@pytest.mark.parametrize("case,kwargs,reason", [
    ("sigmoid gate, not SiLU", dict(act="glu"), "neither factor is SiLU"),
    ("different inputs", dict(inputs=("x", "y")), "read different tensors"),
    ("quantized vs f32", dict(forms=("q4", "plain")), "weights differ"),
    ("widths differ", dict(up_width=1), "widths differ"),
])
def test_fuse_gate_up_must_not_fire(case, kwargs, reason):
    before = mlp_graph(**kwargs).model()
    after, modified, stats = apply(FuseGateUp(), before)
    assert not modified
    assert ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def test_reorder_qkv_makes_projections_contiguous():
    g = G()
    x = g.inp("x", [1, 3, IN])
    ws = {r: dq_weight(g, f"model.layers.0.self_attn.{r}_proj.weight", [IN, 8]) for r in "qkv"}
    # q projection, then unrelated work, then v and k (out of order), like an exporter might emit.
    q = g.node("MatMul", [x, ws["q"]], name="/model/layers.0/attn/q_proj/MatMul")
    other = g.node("Relu", [x])
    v = g.node("MatMul", [x, ws["v"]], name="/model/layers.0/attn/v_proj/MatMul")
    g.out(other, "other")
    k = g.node("MatMul", [x, ws["k"]], name="/model/layers.0/attn/k_proj/MatMul")
    for name, value in (("q", q), ("k", k), ("v", v)):
        g.out(value, name)
    before = g.model()
    after, modified, stats = apply(ReorderQKVProjections(), before)
    assert modified
    names = [n.name for n in after.graph.node]
    i = names.index("model.layers.0.self_attn.q_proj.weight/DequantizeLinear")
    assert names[i:i + 6] == [n for r in "qkv" for n in (f"model.layers.0.self_attn.{r}_proj.weight/DequantizeLinear",
                                                           f"/model/layers.0/attn/{r}_proj/MatMul")]
    assert_same(before, after, g.feeds)
    again, modified2, _ = apply(ReorderQKVProjections(), after)
    assert not modified2 and again == after


def test_reorder_skips_with_reason():
    before = qkv_graph(inputs=("x", "y", "y")).model()
    after, modified, stats = apply(ReorderQKVProjections(), before)
    assert not modified and any("2 MatMuls read y" in r for _, r in stats.skipped)


def test_fused_weights_are_lazy_until_written():
    """The concatenation is not computed while the pass runs (only when the model is written)."""
    import onnx_ir as ir

    m = ir.serde.deserialize_model(qkv_graph(widths=(18, 6, 6), form="q4").model())
    m, modified, _ = FuseQKV()(m)
    lazy = {v.name: v.const_value for v in m.graph.initializers.values() if isinstance(v.const_value, ir.LazyTensor)}
    base = "model.layers.0.self_attn.qkv_proj.weight"
    assert modified and set(lazy) == {f"{base}.qweight", f"{base}.scales", f"{base}.zero_points"}
    assert lazy[f"{base}.qweight"].shape.numpy() == (IN, 30) and lazy[f"{base}.scales"].shape.numpy() == (IN // 16, 30)
    assert np.asarray(lazy[f"{base}.qweight"].numpy()).shape == (IN, 30)
