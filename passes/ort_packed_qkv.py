"""OrtPackedQKV (target onnxruntime): Split(qkv) -> GroupQueryAttention(q, k, v)  ->  GroupQueryAttention(qkv)."""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from fuselm.graphcheck import ORT_DOMAIN

from .base import Fusion, attr, const, fail, input_at, producer, rank


class OrtPackedQKV(Fusion):
    """GroupQueryAttention(Split(x)[0], Split(x)[1], Split(x)[2], ...) -> GroupQueryAttention(x, "", "", ...).

    The pattern: a com.microsoft GroupQueryAttention whose query, key and value are the three
    outputs, in order, of one Split of the fused QKV projection's output x [B, S, (H + 2·KV)·D]
    along its last axis into constant sizes [H·D, KV·D, KV·D] (FuseQKV's form when no q/k norm
    or rotation sits between the projection and the attention: Qwen2, Llama). GQA then reads the
    packed tensor itself (its `query` input takes packed QKV, key and value omitted), and applies
    its rotation to the packed heads as it did to the split ones: one node less per layer, the
    same numbers (the same kernel reads the same values).
    Must not fire (and says why): q, k or v not straight outputs of one Split (a q/k norm or a
    Reshape between: Qwen3); a Split over another axis, into other sizes than the heads, or into
    more or fewer than three outputs; a Split output read by anything else or a graph output;
    head counts or a head size the sizes cannot be checked against.
    """

    aliases = ("ort-packed-qkv", "packed-qkv")
    needs_opset = None

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == ORT_DOMAIN]

    def match(self, gqa: ir.Node) -> ir.Node:
        q, k, v = (list(gqa.inputs) + [None] * 3)[:3]
        if k is None or v is None:
            fail("query is packed already (no key and value inputs)")
        split = producer(q, "Split")
        if split is None or producer(k, "Split") is not split or producer(v, "Split") is not split:
            fail("query, key and value are not outputs of one Split (a q/k norm or Reshape between them)")
        if list(split.outputs) != [q, k, v]:
            fail("the Split's outputs are not query, key, value in that order")
        r = rank(split.inputs[0])
        axis = attr(split, "axis", 0)
        if axis != -1 and (r is None or axis != r - 1):
            fail(f"the Split is over axis {axis}, not the last one")
        sizes = const(input_at(split, 1))
        heads, kv_heads = attr(gqa, "num_heads", 0), attr(gqa, "kv_num_heads", 0)
        if sizes is None or len(sizes) != 3 or not heads or not kv_heads:
            fail("the Split's sizes are not constant or the head counts are not known")
        head_dim, rest = divmod(int(sizes[0]), heads)
        if rest or [int(s) for s in sizes] != [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
            fail(f"the Split's sizes {[int(s) for s in sizes]} are not {heads}/{kv_heads}/{kv_heads} heads")
        for o in split.outputs:
            if o.is_graph_output() or len(o.uses()) != 1:
                fail(f"{o.name} is read outside the attention")
        return split

    def rewrite(self, graph: ir.Graph, split: ir.Node) -> str:
        gqa = split.outputs[0].uses()[0].node
        gqa.replace_input_with(0, split.inputs[0])
        gqa.replace_input_with(1, None)
        gqa.replace_input_with(2, None)
        graph.remove(split, safe=True)
        return (gqa.name or "GroupQueryAttention").rsplit("/", 1)[0]
