"""FuseQKV: the q, k and v projections of one tensor -> one MatMul over concatenated weights + Split."""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from .base import Fusion, Reject, fail
from .fuse_gate_up import is_gate_up_pair
from .projections import (
    Projection,
    check_compatible,
    fuse,
    parse_projection,
    projections_reading,
)

_ROLES = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"))


def candidate_groups(graph: ir.Graph) -> Iterable[ir.Node]:
    """The first MatMul of every tensor that two or more MatMuls read (not a gate/up pair)."""
    seen: set[ir.Value] = set()
    for node in graph:
        if node.op_type != "MatMul" or node.inputs[0] is None or node.inputs[0] in seen:
            continue
        x = node.inputs[0]
        seen.add(x)
        readers = projections_reading(x)
        if len(readers) < 2:
            continue
        if len(readers) == 2:
            try:
                pair = [parse_projection(n) for n in readers]
            except Reject:
                pair = None
            if pair and is_gate_up_pair(*pair):
                continue
        yield node


def match_qkv(first: ir.Node) -> list[Projection]:
    """[q, k, v] projections reading first's input, or fail() saying why they are not q/k/v."""
    x = first.inputs[0]
    readers = projections_reading(x)
    if len(readers) != 3:
        fail(f"{len(readers)} MatMuls read {x.name}; q/k/v fusion needs exactly three reading one tensor")
    projs = [parse_projection(n) for n in readers]
    projs = _in_role_order(projs)
    check_compatible(projs)
    q, k, v = (p.weight.out_dim for p in projs)
    if k != v:
        fail(f"k and v widths differ ({k} vs {v}): not q/k/v-shaped")
    if q < k or q % k:
        fail(f"q width {q} is not a multiple of the k/v width {k}: not q/k/v-shaped")
    return projs


def _in_role_order(projs: list[Projection]) -> list[Projection]:
    """Order by names (q_proj, k_proj, v_proj) when the graph has them, else keep graph order."""
    for roles in _ROLES:
        found = []
        for role in roles:
            hits = [p for p in projs if role in p.name or role in (p.weight.tensors["w"].name or "")]
            if len(hits) != 1:
                break
            found.append(hits[0])
        else:
            if len(set(map(id, found))) == 3:
                return found
    return projs


class FuseQKV(Fusion):
    """x·Wq [+bq], x·Wk [+bk], x·Wv [+bv]  ->  Split(x·[Wq|Wk|Wv] [+ [bq|bk|bv]]) -> q, k, v.

    Fires on exactly three projections reading the same tensor with GQA shapes (k and v of equal
    width, q a multiple of it). Weights are concatenated along the output dim: [in, out]
    initializers along axis 1, Transpose'd [out, in] ones along axis 0 (one Transpose stays),
    blocked DequantizeLinear data (uint4 unpacked and repacked), scales and zero points along
    their output axis. The concatenation is lazy: only these weights are read, at save time.
    Must not fire (and says why): other than three MatMuls read the tensor (e.g. q reads x, k/v
    read a different tensor); weights differ in form, dtype, bits or block size; k and v widths
    differ or q is not a multiple of them; only some have a bias; a weight is not a constant.
    """

    aliases = ("fuse-qkv", "qkv")

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return candidate_groups(graph)

    def match(self, first: ir.Node) -> list[Projection]:
        return match_qkv(first)

    def rewrite(self, graph: ir.Graph, projs: list[Projection]) -> str:
        return fuse(graph, projs, "q_proj", "qkv_proj")
