"""RoPETo3D: FusedRoPE between a head-splitting and a head-merging Reshape -> FusedRoPE on [B, S, H·D]."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

from fuselm import contract

from .attention_3d import _merges_heads, _split_heads, value_ranks
from .base import Fusion, attr, const, fail, only_user, producer, static_shape, take_over


@dataclass
class Match:
    rope: ir.Node
    flat: ir.Value  # [B, S, H·D] before the split Reshape
    merged: ir.Value  # the merge Reshape's output, which FusedRoPE's output takes over
    heads: int


class RoPETo3D(Fusion):
    """Reshape(FusedRoPE(Reshape(t, [0, 0, H, D]), pos[, w]), [0, 0, H·D])  ->  FusedRoPE(t, pos[, w], num_heads=H).

    AttentionTo3D leaves q and k split into heads for FusedRoPE (and its norm over head_dim) and merged
    back for the 3-D Attention. FusedRoPE also takes x as [B, S, H·D] with `num_heads` (as onnxruntime's
    RotaryEmbedding does; fuselm/contract.py): both Reshapes go, the output keeps t's 3-D shape.
    The split is a constant target [0, 0, H, D] (or shapes that say so: torch.onnx), the merge one
    of [0, 0, H·D] / [0, 0, -1].
    Must not fire (and says why): a FusedRoPE already 3-D; an input that is not such a head split of a
    3-D tensor, or heads unknown; the split heads or the rotated output read by anything but the rope
    and one merging Reshape.
    """

    aliases = ("rope-3d", "rope-to-3d")
    needs_opset = None
    functions = True

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [n for n in graph if n.domain == contract.DOMAIN and n.op_type == contract.ROPE_OP
                and not attr(n, "num_heads", 0)]

    def apply(self, model: ir.Model, stats) -> bool:
        self._ranks = value_ranks(model.graph)  # (dropped after the run: Pass.__call__)
        return super().apply(model, stats)

    def match(self, rope: ir.Node) -> Match:
        x = rope.inputs[0]
        split = producer(x, "Reshape")
        if split is None:
            fail("its input is not a Reshape that splits heads")
        target = const(split.inputs[1])
        shape = static_shape(x)
        heads = int(target[2]) if target is not None and len(target) == 4 and target[2] > 0 else \
            (shape[2] if shape is not None and len(shape) == 4 else None)
        if not heads:
            fail("the number of heads is unknown (no constant Reshape target, no static shape)")
        flat = _split_heads(x, heads, self._ranks)
        if flat is None:
            fail(f"its input is not a Reshape of a 3-D tensor into [B, S, {heads}, D]")
        if len(x.uses()) != 1 or x.is_graph_output():
            fail("the split heads are read by more than the FusedRoPE")
        merge = only_user(rope.outputs[0], "Reshape")
        if merge is None or not _merges_heads(merge):
            fail("its output is not read by one Reshape to [B, S, H·D] alone")
        return Match(rope, flat, merge.outputs[0], heads)

    def rewrite(self, graph: ir.Graph, m: Match) -> str:
        m.rope.replace_input_with(0, m.flat)
        m.rope.attributes["num_heads"] = ir.AttrInt64("num_heads", m.heads)
        y = m.rope.outputs[0]
        y.shape = None  # was [B,S,H,D]; the 3-D output takes the merged tensor's shape
        take_over(m.merged, y)
        return m.rope.name or contract.ROPE_OP
