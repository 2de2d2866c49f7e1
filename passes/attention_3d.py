"""AttentionTo3D: feed Attention-23 its 3-D form and drop the head Transposes around it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fuselm import contract

from .base import (
    Fusion,
    attr,
    const,
    fail,
    new_node,
    only_user,
    producer,
    small_constant,
    static_shape,
    take_over,
)

_SWAP = [0, 2, 1, 3]  # [B,S,H,D] <-> [B,H,S,D]


@dataclass
class Side:
    """One of q/k/v: the [B,S,H,D] tensor behind the Transpose, and its [B,S,H*D] form if one exists."""

    heads4: ir.Value
    flat: ir.Value | None  # the 3-D tensor a Reshape split into heads, when there is one
    heads: int
    head_dim: int | None


@dataclass
class Match:
    node: ir.Node
    sides: list[Side]
    merged: ir.Value  # Reshape(Transpose(Y)) = Y in [B,S,H*Dv], which the 3-D Y takes over


_SAME_RANK = {"Split", "Cast", "Sigmoid", "Relu", "Neg", "Sqrt", "Reciprocal", "Identity", "Softmax", "Transpose",
              "RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization", "DequantizeLinear",
              contract.ROPE_OP, contract.SWIGLU_OP, "Attention", "Concat"}
_BROADCAST = {"Add", "Sub", "Mul", "Div", "Pow", "Where", "MatMul"}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"}


def value_ranks(graph: ir.Graph) -> dict[ir.Value, int]:
    """The rank of every value one forward sweep can tell: from its shape, else from its producer
    (rank-keeping ops, broadcasting ops, Gather, Reshape to a constant shape, keepdims reductions)."""
    ranks: dict[ir.Value, int] = {}
    for v in [*graph.inputs, *graph.initializers.values()]:
        if v.shape is not None:
            ranks[v] = v.shape.rank()
    for node in graph:
        known = [ranks.get(v) if v is not None else None for v in node.inputs]
        r = None
        if node.op_type in _SAME_RANK and known and known[0] is not None:
            r = known[0]  # Attention's Y: 3-D for 3-D q, 4-D for 4-D (its present outputs have shapes)
        elif node.op_type in _BROADCAST and known and None not in known:
            r = max(known)
        elif node.op_type == "Gather" and len(known) == 2 and None not in known:
            r = known[0] - 1 + known[1]
        elif node.op_type == "Reshape" and (target := const(node.inputs[1])) is not None:
            r = len(target)
        elif node.op_type in _REDUCE and attr(node, "keepdims", 1) and known and known[0] is not None:
            r = known[0]
        for i, v in enumerate(node.outputs):
            if v.shape is not None:
                ranks[v] = v.shape.rank()
            elif r is not None and (i == 0 or node.op_type == "Split"):
                ranks[v] = r
    return ranks


def _same_batch_seq(a: ir.Value, b: ir.Value) -> bool:
    """Whether the shapes of a and b are known and agree on dims 0 and 1 (B, S; symbolic or not)."""
    if a.shape is None or b.shape is None or a.shape.rank() < 2 or b.shape.rank() < 2:
        return False
    dims = (a.shape[0], a.shape[1], b.shape[0], b.shape[1])
    if any(isinstance(d, ir.SymbolicDim) and d.value is None for d in dims):
        return False
    return a.shape[0] == b.shape[0] and a.shape[1] == b.shape[1]


def _split_heads(x: ir.Value, heads: int, ranks: dict) -> ir.Value | None:
    """t when x = Reshape(t) is [B,S,H,D] of a 3-D t = [B,S,H*D] (the Reshape that split the heads):
    by a constant target [0, 0, H, D] (the 0s copy B and S from t), or by their shapes (torch.onnx)."""
    reshape = producer(x, "Reshape")
    if reshape is None:
        return None
    t = reshape.inputs[0]
    target = const(reshape.inputs[1])
    if target is not None:
        if attr(reshape, "allowzero", 0) or len(target) != 4 or list(target[:2]) != [0, 0] or int(target[2]) != heads or target[3] <= 0:
            return None
        return t if ranks.get(t) == 3 else None
    if ranks.get(t) == 3 and x.shape is not None and x.shape.rank() == 4 and x.shape[2] == heads \
            and _same_batch_seq(x, t):
        return t
    return None


def _merges_heads(reshape: ir.Node) -> bool:
    """Whether the Reshape turns [B,S,H,D] into [B,S,H*D]: a target [0, 0, W] (allowzero off), where
    W is -1 or, the element count being fixed, necessarily H*D; or shapes that say so (torch.onnx)."""
    target = const(reshape.inputs[1])
    if target is not None:
        return not attr(reshape, "allowzero", 0) and len(target) == 3 and list(target[:2]) == [0, 0] and (int(target[2]) == -1 or int(target[2]) > 0)
    x, y = reshape.inputs[0], reshape.outputs[0]
    return y.shape is not None and y.shape.rank() == 3 and x.shape is not None and x.shape.rank() == 4 \
        and _same_batch_seq(x, y)


class AttentionTo3D(Fusion):
    """Attention(T(q), T(k), T(v), ...) -> T -> Reshape [B,S,H*Dv]  =>  Attention(q', k', v', ...).

    T is a Transpose with perm [0,2,1,3] ([B,S,H,D] -> [B,H,S,D]). Attention-23 also takes 3-D
    q/k/v [B,S,heads*D] (with q_num_heads / kv_num_heads) and then returns Y as [B,S,H*Dv], so the
    Transposes in front, and the Transpose + Reshape behind, go. Each of q/k/v becomes the 3-D
    tensor a Reshape split into heads (v straight from the fused QKV Split), else one Reshape
    [0, 0, H*D] of the [B,S,H,D] tensor (q and k after their RMSNorm over head_dim and FusedRoPE,
    which work on that 4-D view). Mask, past inputs and present outputs ([B, kv_heads, T, D],
    the graph contract) are untouched; present keeps its names.
    Must not fire (and says why): an Attention already 3-D or outside the default domain; a
    q/k/v that is not such a Transpose of a rank-4 tensor; head counts unknown or contradicting
    the tensors' shapes; Y read by
    anything but one Transpose [0,2,1,3] whose only reader is a Reshape merging the last two
    axes; a qk_matmul_output that is read.
    """

    aliases = ("attention-3d", "attention-to-3d", "3d")
    anchor_ops = ("Attention",)

    def apply(self, model: ir.Model, stats) -> bool:
        # One sweep is enough: a rewrite gives Y the rank (3) of the Reshape output it takes over.
        self._ranks = value_ranks(model.graph)  # (dropped after the run: Pass.__call__)
        return super().apply(model, stats)

    def match(self, node: ir.Node) -> Match:
        if len(node.outputs) > 3 and node.outputs[3].uses():
            fail("its qk_matmul_output is read")
        sides = []
        for i, role in enumerate(("q", "k", "v")):
            x = node.inputs[i]
            t = producer(x, "Transpose")
            if t is None or list(attr(t, "perm", [])) != _SWAP:
                fail(f"{role} is not a Transpose [0,2,1,3] (already 3-D, or another layout)")
            heads4 = t.inputs[0]
            shape = static_shape(heads4)
            if shape is not None and len(shape) != 4:
                fail(f"{role} before its Transpose has rank {len(shape)}, not 4")
            heads = attr(node, "q_num_heads" if role == "q" else "kv_num_heads") or (shape[2] if shape else None)
            split = producer(heads4, "Reshape")
            target = const(split.inputs[1]) if split is not None else None
            if not heads and target is not None and len(target) == 4 and target[2] > 0:
                heads = int(target[2])  # the Reshape that split the heads says
            if not heads:
                fail(f"the number of {role} heads is unknown (no attribute, no static shape)")
            if shape is not None and shape[2] is not None and shape[2] != heads:
                fail(f"{role} has {shape[2]} heads but the Attention says {heads}")
            sides.append(Side(heads4, _split_heads(heads4, int(heads), self._ranks), int(heads),
                              shape[3] if shape else None))
        y = node.outputs[0]
        t = only_user(y, "Transpose")
        if t is None or list(attr(t, "perm", [])) != _SWAP:
            fail("Y is not read by one Transpose [0,2,1,3] alone")
        reshape = only_user(t.outputs[0], "Reshape")
        if reshape is None or not _merges_heads(reshape):
            fail("Y's Transpose is not read by one Reshape to [B, S, H*Dv] alone")
        return Match(node, sides, reshape.outputs[0])

    def rewrite(self, graph: ir.Graph, m: Match) -> str:
        scope = (m.node.name or "attention").rsplit("/", 1)[0]
        for i, (role, side) in enumerate(zip(("q", "k", "v"), m.sides, strict=True)):
            flat = side.flat
            if flat is None:
                width = side.heads * side.head_dim if side.head_dim else -1
                shape = small_constant(graph, "/model/constants/merge_heads_shape", np.array([0, 0, width], np.int64))
                r = new_node(graph, "Reshape", [side.heads4, shape], f"{scope}/{role}_3d/Reshape")
                graph.insert_before(m.node, r)
                if side.heads4.dtype is not None:
                    r.outputs[0].dtype = side.heads4.dtype
                flat = r.outputs[0]
            m.node.replace_input_with(i, flat)
        for name, side in (("q_num_heads", m.sides[0]), ("kv_num_heads", m.sides[1])):
            if name not in m.node.attributes:
                m.node.attributes[name] = ir.AttrInt64(name, side.heads)
        y = m.node.outputs[0]
        y.shape = None  # was [B,H,S,Dv]; the 3-D Y takes the merged tensor's shape
        take_over(m.merged, y)
        return m.node.name or scope
