"""ReorderQKVProjections: put each layer's q/k/v projections next to each other."""

from __future__ import annotations

import onnx_ir as ir

from .base import Pass, Reject, Stats
from .fuse_qkv import candidate_groups, match_qkv


class ReorderQKVProjections(Pass):
    """Move the q, k and v projections (their weight nodes such as DequantizeLinear, the MatMul and
    the bias Add) to the position of the earliest of them, in q, k, v order.

    This keeps a valid topological order: the three read only the shared input (available before
    the earliest one) and initializers. A runtime that fuses at dispatch time, or a fusion pass
    that runs later, then sees them contiguous. Already contiguous groups are left alone, so the
    pass is idempotent.
    Must not fire on: groups FuseQKV would reject (not three projections of one tensor, weights
    that are not constants); the reason is recorded.
    """

    aliases = ("reorder-qkv", "reorder-qkv-projections", "reorder")

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        graph = model.graph
        modified = False
        nodes = list(graph)
        # Positions from the original order stay valid: groups only move up within their own layer.
        order = {n: i for i, n in enumerate(nodes)}
        for first in list(candidate_groups(graph)):
            try:
                projs = match_qkv(first)
            except Reject as r:
                stats.skip(first.name or "MatMul", str(r))
                continue
            wanted = [n for p in projs for n in p.nodes]
            positions = [order[n] for n in wanted]
            if positions == list(range(positions[0], positions[0] + len(wanted))):
                continue
            # Everything moves up to where the earliest MatMul was: its input exists there, and
            # the weight nodes read only initializers.
            taken = set(wanted)
            i = min(order[p.matmul] for p in projs) - 1
            while i >= 0 and nodes[i] in taken:
                i -= 1
            graph.remove(wanted)  # keeps inputs/outputs connected; the nodes are re-inserted right away
            if i >= 0:
                graph.insert_after(nodes[i], wanted)
            else:
                graph.insert_before(next(iter(graph)), wanted)
            stats.fire(projs[0].name)
            modified = True
        return modified
