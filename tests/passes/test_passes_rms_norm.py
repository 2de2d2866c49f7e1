"""FuseRMSNorm and RemoveDeadShapeOp on tiny graphs."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.passes.fuse_rms_norm import FuseRMSNorm
from fuselm.passes.remove_dead_shape_ops import RemoveDeadShapeOp
from onnx import TensorProto
from passes_helpers import G, apply, assert_same, ops

D = 16


def rms_graph(square="pow", inverse="reciprocal", weight_first=False, casts=False, axis=-1, exponent=2.0,
              eps_input=False, mean_out=False, shape=(2, 3, D), one_plus=None):
    g = G()
    x = g.inp("x", list(shape), TensorProto.FLOAT16 if casts else TensorProto.FLOAT,
              value=g.rng.standard_normal(shape).astype(np.float16 if casts else np.float32))
    h = g.node("Cast", [x], to=TensorProto.FLOAT) if casts else x
    sq = g.node("Pow", [h, g.init("two", np.array(exponent, np.float32))]) if square == "pow" else g.node("Mul", [h, h])
    mean = g.node("ReduceMean", [sq, g.init("axes", np.array([axis], np.int64))], keepdims=1)
    eps = g.inp("eps", [], value=np.array(1e-6, np.float32)) if eps_input else g.init("eps", np.array(1e-6, np.float32))
    var = g.node("Add", [mean, eps])
    root = g.node("Sqrt", [var])
    if inverse == "reciprocal":
        normed = g.node("Mul", [h, g.node("Reciprocal", [root])])
    elif inverse == "one_over":
        normed = g.node("Mul", [g.node("Div", [g.init("one", np.array(1.0, np.float32)), root]), h])
    else:
        normed = g.node("Div", [h, root])
    if casts:
        normed = g.node("Cast", [normed], to=TensorProto.FLOAT16)
    w = g.init("model.layers.0.input_layernorm.weight",
               (1 + 0.1 * g.rng.standard_normal(shape[-1 if axis == -1 else axis])).astype(np.float16 if casts else np.float32))
    if one_plus == "constant":  # Gemma: x_norm * (1 + w)
        w = g.node("Add", [g.init("one_w", np.array(1.0, np.float32)), w])
    elif one_plus == "input":
        w = g.node("Add", [w, g.inp("shift", [], value=np.array(1.0, np.float32))])
    y = g.node("Mul", [w, normed] if weight_first else [normed, w], name="/model/layers.0/input_layernorm/Mul_1")
    g.out(y, "y", dtype=TensorProto.FLOAT16 if casts else TensorProto.FLOAT, rank=len(shape))
    if mean_out:
        g.out(mean, "mean", rank=len(shape))
    return g


@pytest.mark.parametrize("kwargs", [
    dict(), dict(square="mul", inverse="one_over", weight_first=True), dict(inverse="div"),
    dict(casts=True), dict(shape=(1, 3, 4, D)),  # q_norm / k_norm over head_dim
    dict(one_plus="constant"), dict(one_plus="constant", weight_first=True),
])
def test_fuse_rms_norm_fires(kwargs):
    g = rms_graph(**kwargs)
    before = g.model()
    after, modified, stats = apply(FuseRMSNorm(), before)
    assert modified and ops(after) == ["RMSNormalization", "Identity"]
    assert stats.fired == ["/model/layers.0/input_layernorm"]
    assert_same(before, after, g.feeds, rtol=2e-3 if kwargs.get("casts") else 1e-5)


@pytest.mark.parametrize("case,kwargs,reason", [
    ("mean over another axis", dict(axis=1, shape=(2, D, D)), "not the last one"),
    ("cube, not square", dict(exponent=3.0), "exponent is 3.0"),
    ("epsilon from an input", dict(eps_input=True), "epsilon is not a constant"),
    ("mean read elsewhere", dict(mean_out=True), "Add(eps) alone"),
    ("(c + w) with c from an input", dict(one_plus="input"), "without a 1-D constant w and a scalar constant c"),
])
def test_fuse_rms_norm_must_not_fire(case, kwargs, reason):
    before = rms_graph(**kwargs).model()
    after, modified, stats = apply(FuseRMSNorm(), before)
    assert not modified and ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def test_remove_dead_shape_ops():
    g = G()
    x = g.inp("x", [2, 3, D])
    # A constant shape subgraph (Shape of a static tensor -> Gather -> Concat) feeding a Reshape,
    # a dead Shape chain, a no-op Slice and an Identity in front of the output.
    shape = g.node("Shape", [x])
    last = g.node("Gather", [shape, g.init("i2", np.array(2, np.int64))], axis=0)
    target = g.node("Concat", [g.init("lead", np.array([-1], np.int64)),
                               g.node("Unsqueeze", [last, g.init("ax0", np.array([0], np.int64))])], axis=0)
    flat = g.node("Reshape", [x, target])
    g.node("Size", [g.node("Shape", [flat])])  # dead
    full = g.node("Slice", [flat, g.init("s0", np.array([0], np.int64)), g.init("big", np.array([2**63 - 1], np.int64)),
                            g.init("ax1", np.array([1], np.int64))])
    y = g.node("Relu", [g.node("Identity", [full])])
    g.out(y, "y", rank=2)
    before = g.model()
    after, modified, stats = apply(RemoveDeadShapeOp(), before)
    assert modified
    assert ops(after) == ["Reshape", "Relu"]
    assert [o.name for o in after.graph.output] == ["y"]
    assert_same(before, after, g.feeds)
    assert stats.counts["removed Shape"] == 2 and stats.counts["no-op Slice bypassed"] == 1
    again, modified2, _ = apply(RemoveDeadShapeOp(), after)
    assert not modified2 and again == after


def test_remove_dead_shape_ops_keeps_dynamic_shapes_and_outputs():
    g = G()
    x = g.inp("x", ["batch", 3, D], value=np.ones((2, 3, D), np.float32))
    batch = g.node("Shape", [x], start=0, end=1)  # dynamic: must stay
    target = g.node("Concat", [batch, g.init("rest", np.array([3 * D], np.int64))], axis=0)
    g.out(g.node("Reshape", [x, target]), "y", rank=2)
    g.out(g.node("Identity", [x]), "x_copy")  # an Identity between two graph I/O names stays
    before = g.model()
    after, modified, _ = apply(RemoveDeadShapeOp(), before)
    assert "Shape" in ops(after) and "Identity" in ops(after)
    assert [o.name for o in after.graph.output] == ["y", "x_copy"]
    assert_same(before, after, g.feeds)


def l2_graph(weight="scalar", known=True, axis=-1):
    """The gated delta rule's q / k norm: x · 1/sqrt(sum(x², -1) + eps), then a scalar scale, a [D] weight or nothing."""
    g = G()
    x = g.inp("x", [2, 3, 4, D] if known else [2, 3, 4, "d"], value=g.rng.standard_normal((2, 3, 4, D)).astype(np.float32))
    total = g.node("ReduceSum", [g.node("Mul", [x, x]), g.init("axes", np.array([axis], np.int64))], keepdims=1)
    inv = g.node("Reciprocal", [g.node("Sqrt", [g.node("Add", [total, g.init("eps", np.array(1e-6, np.float32))])])])
    y = g.node("Mul", [x, inv], name="/model/layers.0/mul_161")
    if weight == "scalar":
        y = g.node("Mul", [y, g.init("scale", np.array(D ** -0.5, np.float32))], name="/model/layers.0/mul_182")
    elif weight == "vector":
        y = g.node("Mul", [g.init("w", (1 + 0.1 * g.rng.standard_normal(D)).astype(np.float32)), y])
    g.out(y, "y", rank=4)
    return g


@pytest.mark.parametrize("weight", ["scalar", "vector", None])
def test_fuse_rms_norm_takes_an_l2_norm(weight):
    g = l2_graph(weight)
    before = g.model()
    after, modified, stats = apply(FuseRMSNorm(), before)
    assert modified and ops(after) == ["RMSNormalization", "Identity"]
    assert_same(before, after, g.feeds, rtol=1e-5)


@pytest.mark.parametrize("case,kwargs,reason", [
    ("sum over another axis", dict(axis=1), "not the last one"),
    ("last dim unknown", dict(known=False), "unknown size"),
])
def test_fuse_rms_norm_l2_must_not_fire(case, kwargs, reason):
    before = l2_graph(**kwargs).model()
    after, modified, stats = apply(FuseRMSNorm(), before)
    assert not modified and ops(after) == ops(before)
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)
