"""FuseRMSNorm: the decomposed RMSNorm (as HF writes it by hand), and the L2 norm -> RMSNormalization-23."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .base import (
    Fusion,
    attr,
    const,
    fail,
    initializer,
    input_at,
    lazy_initializer,
    name_like,
    new_node,
    only_user,
    other_input,
    producer,
    rank,
    scalar,
    take_over,
)


@dataclass
class RMSMatch:
    x: ir.Value  # input of the fused node
    weight: ir.Value | None  # None: an L2 norm with no weight after it
    eps: float
    nodes: list[ir.Node]
    out: ir.Value
    offset: float = 0.0  # Gemma-style `x_norm · (offset + w)`: the fused weight is offset + w
    length: int | None = None  # an L2 norm's (a sum, not a mean) last dim D: the fused weight is w / sqrt(D)


def _offset_weight(v: ir.Value) -> tuple[ir.Value, float]:
    """(w, c) for v = Add(w, c) / Add(c, w) with w a 1-D constant and c a scalar constant, else (v, 0)."""
    add = producer(v, "Add")
    if add is None:
        return v, 0.0
    for w, c in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        if scalar(c) is not None and w.const_value is not None and w.shape is not None and w.shape.rank() == 1:
            return w, float(scalar(c))
    fail("the weight is Add(w, c) without a 1-D constant w and a scalar constant c")


class FuseRMSNorm(Fusion):
    """x · 1/sqrt(mean(x², -1) + eps) · w  ->  RMSNormalization(x, w, axis=-1, epsilon=eps).

    The L2 norm x · 1/sqrt(sum(x², -1) + eps) (the gated delta rule's q and k) is the same with epsilon eps / D and
    the weight 1 / sqrt(D), D the last dim (known statically), times a constant it is then multiplied by (a scalar
    or a 1-D weight) if there is one.

    Variants: x² as Pow(x, 2) or Mul(x, x); 1/sqrt as Reciprocal(Sqrt) or Div(1, Sqrt), or the
    whole as Div(x, Sqrt); the weight Mul on either side; with or without HF's Casts (x cast to
    float32 before, the normalized value cast back before the weight); the weight as `(1 + w)`
    (Gemma's RMSNorm: Add(w, 1) of a constant w; the fused weight 1 + w is computed when the model
    is written). Also fires on q_norm and k_norm, which normalize over head_dim of a [B, S, H, D] tensor.
    Must not fire (and says why): the mean is not over the last axis alone or drops the axis
    (keepdims=0); the exponent is not 2; epsilon or the weight is not a constant; the weight is
    not 1-D; an intermediate (x², the mean, the normalized x) has another reader; an L2 norm's last dim is unknown.
    """

    aliases = ("fuse-rms-norm", "rms-norm", "rmsnorm")
    anchor_ops = ("ReduceMean", "ReduceSum")

    def match(self, mean: ir.Node) -> RMSMatch:
        sq = producer(mean.inputs[0], "Pow", "Mul")
        if sq is None:
            fail(f"{mean.op_type} does not read x² (Pow or Mul)")
        x = sq.inputs[0]
        if sq.op_type == "Pow" and scalar(sq.inputs[1]) != 2:
            fail(f"exponent is {scalar(sq.inputs[1])}, not 2")
        if sq.op_type == "Mul" and sq.inputs[1] is not x:
            fail("Mul before ReduceMean is not x·x")
        axes = const(mean.inputs[1]) if input_at(mean, 1) is not None else attr(mean, "axes")
        r = rank(x)
        if axes is None or len(list(axes)) != 1:
            fail(f"mean over axes {None if axes is None else list(axes)}, not the last one")
        axis = int(list(axes)[0])
        if axis != -1 and (r is None or axis != r - 1):
            fail(f"mean over axis {axis}, not the last one")
        if attr(mean, "keepdims", 1) != 1:
            fail("keepdims=0: the mean does not broadcast back")
        length = None
        if mean.op_type == "ReduceSum":
            length = x.shape[-1] if x.shape is not None and x.shape.rank() else None
            if not isinstance(length, int):
                fail("an L2 norm over a last dim of unknown size")
            if attr(mean, "noop_with_empty_axes", 0):
                fail("ReduceSum with noop_with_empty_axes")
        add = only_user(mean.outputs[0], "Add")
        if add is None:
            fail("the mean is not followed by Add(eps) alone")
        eps = scalar(other_input(add, mean.outputs[0]))
        if eps is None:
            fail("epsilon is not a constant")
        sqrt = only_user(add.outputs[0], "Sqrt")
        if sqrt is None:
            fail("Add(eps) is not followed by Sqrt alone")
        nodes = [sq, mean, add, sqrt]
        inv_user = only_user(sqrt.outputs[0], "Reciprocal", "Div")
        if inv_user is None:
            fail("Sqrt is not followed by Reciprocal or Div alone")
        if inv_user.op_type == "Div" and inv_user.inputs[1] is sqrt.outputs[0] and inv_user.inputs[0] is x:
            normed = inv_user  # x / sqrt(...)
            nodes.append(normed)
        else:
            if inv_user.op_type == "Div" and scalar(inv_user.inputs[0]) != 1.0:
                fail("Div by the root is neither 1/root nor x/root")
            nodes.append(inv_user)
            normed = only_user(inv_user.outputs[0], "Mul")
            if normed is None or other_input(normed, inv_user.outputs[0]) is not x:
                fail("1/root is not multiplied by x alone")
            nodes.append(normed)
        if any(len(n.outputs[0].uses()) != 1 or n.outputs[0].is_graph_output() for n in nodes[:-1]):
            fail("an intermediate value has another reader")
        y, inp = normed.outputs[0], x
        cast_back = only_user(y, "Cast")
        cast_in = producer(x, "Cast")
        if cast_back is not None and cast_in is not None and cast_in.inputs[0].dtype is not None \
                and ir.DataType(attr(cast_back, "to")) == cast_in.inputs[0].dtype:
            nodes.append(cast_back)
            y, inp = cast_back.outputs[0], cast_in.inputs[0]
        wmul = only_user(y, "Mul")
        if length is not None:  # an L2 norm: a constant scalar or [D] weight after it is taken in, else none
            w = None if wmul is None else other_input(wmul, y)
            c = const(w)
            if c is None or c.size not in (1, length) or c.ndim > 1:
                return RMSMatch(inp, None, float(eps), nodes, y, length=length)
            return RMSMatch(inp, w, float(eps), [*nodes, wmul], wmul.outputs[0], length=length)
        if wmul is None:
            fail("the normalized value is not multiplied by a weight alone")
        weight, offset = _offset_weight(other_input(wmul, y))
        if weight is None or weight.const_value is None and const(weight) is None:
            fail("the weight is not a constant")
        if weight.shape is None or weight.shape.rank() != 1:
            fail(f"the weight has shape {weight.shape}, not 1-D")
        nodes.append(wmul)
        return RMSMatch(inp, weight, float(eps), nodes, wmul.outputs[0], offset)

    def rewrite(self, graph: ir.Graph, m: RMSMatch) -> str:
        last = m.nodes[-1]
        named = m.weight is not None and m.length is None  # (an L2 norm's scale is no norm's weight: named by its node)
        scope = ((m.weight.name if named else None) or last.name or "rms_norm").removesuffix(".weight")
        name = name_like(last.name, "/Mul_1", "/RMSNormalization", f"{scope}/RMSNormalization")
        weight = m.weight if not m.offset else _plus(graph, m.weight, m.offset)
        eps = m.eps
        if m.length is not None:  # |x|₂ = sqrt(D) · rms(x) (eps / D inside the root)
            w = np.ones(m.length) if m.weight is None else const(m.weight).reshape(-1)
            known = [v.dtype for v in (m.weight, m.out, m.x) if v is not None and v.dtype is not None]
            dtype = (known[0] if known else ir.DataType.FLOAT).numpy()
            weight = initializer(graph, f"{scope}_l2_norm_weight", np.broadcast_to(w / np.sqrt(m.length), m.length)
                                 .astype(dtype))
            eps = m.eps / m.length
        node = new_node(graph, "RMSNormalization", [m.x, weight], name, axis=-1, epsilon=eps, stash_type=1)
        graph.insert_before(last, node)
        take_over(m.out, node.outputs[0])
        graph.remove(m.nodes, safe=True)
        return name.removesuffix("/RMSNormalization")


def _plus(graph: ir.Graph, w: ir.Value, offset: float) -> ir.Value:
    """A new initializer offset + w, computed lazily (the weight is read only when the model is written)."""
    def build() -> np.ndarray:
        a = w.const_value.numpy()
        return (a + np.asarray(offset, a.dtype)).astype(a.dtype)

    t = w.const_value
    return lazy_initializer(graph, f"{w.name}_plus_{offset:g}", t.dtype, t.shape, build)
