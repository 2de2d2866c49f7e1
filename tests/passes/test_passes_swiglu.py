"""FuseSwiGLU on tiny graphs: Split(gate_up) -> SiLU(gate)·up as one fuselm::SwiGLU."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.passes.fuse_swiglu import FuseSwiGLU
from onnx import TensorProto
from onnx import helper as oh
from passes_helpers import G, apply, assert_same, ops

from fuselm import contract

B, S, HID, INTER = 1, 3, 8, 12


def mlp_graph(swap_mul=False, swap_silu=False, sizes=(INTER, INTER), num_outputs=False, up_first=False,
              extra_reader=False, separate=False, width_known=True):
    """x -> MatMul(gate_up) -> Split -> gate·Sigmoid(gate)·up -> MatMul(down): FuseGateUp's output in small."""
    g = G()
    x = g.inp("x", [B, S, HID])
    if separate:
        gate = g.node("MatMul", [x, g.weight("gate.weight", [HID, INTER])])
        up = g.node("MatMul", [x, g.weight("up.weight", [HID, INTER])])
    else:
        gu = g.node("MatMul", [x, g.weight("gate_up.weight", [HID, sum(sizes)])])
        if num_outputs:  # the halves' width is then the input's, read from its shape
            gate, up = g.node("Split", [gu], n_out=2, axis=-1, num_outputs=2)
            g.width = (gu, [B, S, sum(sizes)] if width_known else [B, S, "w"])
        else:
            gate, up = g.node("Split", [gu, g.init("sizes", np.array(sizes, np.int64))], n_out=2, axis=-1)
        if up_first:
            gate, up = up, gate
    sig = g.node("Sigmoid", [gate])
    silu = g.node("Mul", [sig, gate] if swap_silu else [gate, sig])
    h = g.node("Mul", [up, silu] if swap_mul else [silu, up], name="/model/layers.0/mlp/Mul")
    g.out(g.node("MatMul", [h, g.weight("down.weight", [sizes[1], HID])]), "y")
    if extra_reader:
        g.out(gate, "gate")
    return g


def model_of(g: G):
    model = g.model()
    if hasattr(g, "width"):
        model.graph.value_info.append(oh.make_tensor_value_info(g.width[0], TensorProto.FLOAT, g.width[1]))
    return model


@pytest.mark.parametrize("kwargs", [dict(), dict(swap_mul=True, swap_silu=True), dict(num_outputs=True)])
def test_swiglu_fires(kwargs):
    g = mlp_graph(**kwargs)
    before = model_of(g)
    after, modified, stats = apply(FuseSwiGLU(), before)
    assert modified and stats.fired == ["/model/layers.0/mlp"]
    assert ops(after) == ["MatMul", contract.SWIGLU_OP, "MatMul", "Identity"]
    node = after.graph.node[1]
    assert node.domain == contract.DOMAIN and node.name == "/model/layers.0/mlp/act/SwiGLU"
    assert [f.name for f in after.functions] == [contract.SWIGLU_OP]
    assert_same(before, after, g.feeds)
    assert not apply(FuseSwiGLU(), after)[1]


@pytest.mark.parametrize("case,kwargs,reason", [
    ("separate gate and up projections", dict(separate=True), "not outputs of one Split"),
    ("up is the first half", dict(up_first=True), "gate then up"),
    ("halves of different widths (a broadcast gate)", dict(sizes=(1, INTER)), "not two equal halves"),
    ("gate read elsewhere", dict(extra_reader=True), "read outside SiLU(gate)"),
    ("Split in two of an unknown width", dict(num_outputs=True, width_known=False), "known, even width"),
])
def test_swiglu_must_not_fire(case, kwargs, reason):
    before = model_of(mlp_graph(**kwargs))
    after, modified, stats = apply(FuseSwiGLU(), before)
    assert not modified and ops(after) == ops(before), case
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)
