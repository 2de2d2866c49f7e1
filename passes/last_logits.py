"""LastPositionLogits (generation-only graphs): the head runs on the last positions, logits [B, keep, vocab]."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx_ir as ir

from fuselm import contract

from .base import Fusion, const, fail, new_node, producer, rank, small_constant

HEADS = ("MatMul", "MatMulNBits")


class LastPositionLogits(Fusion):
    """head(x [B, S, H]) -> logits  ->  head(Slice(x, -logits_to_keep:, axis 1)) -> logits [B, keep, vocab].

    A generation loop reads the logits of a prompt's last position only (a speculative verification step: of
    its last k + 1); a graph that computes every position's pays the vocabulary-wide head S times per prompt.
    The pattern: the node
    writing the graph output `logits` is a matmul (MatMul, com.microsoft MatMulNBits) whose activation (or
    output) has rank 3; a Slice of its last `logits_to_keep` positions along axis 1 goes in front of it, and
    `logits_to_keep` (int64 [1], contract.LOGITS_TO_KEEP: HF's name for it) becomes a graph input whose
    initializer, 1, is its default. Numbers are unchanged for the kept positions; the others are gone, so this
    is not part of `fuselm optimize`: the graph no longer scores a text. `--backend auto`'s prepared copy, which
    only generates, runs it (runtime_metal/engines/ort_prepared.py), on onnxruntime with IO binding
    (onnxruntime-genai 0.18 binds a [B, S, vocab] logits buffer and rejects it).
    Must not fire (and says why): no `logits` output; logits written by another op (a Cast, a softcap, a
    Reshape: the head is not the last node); an activation whose rank is not 3; a head that reads
    the slice already (it is idempotent).
    """

    aliases = ("last-logits", "last-position-logits")
    needs_opset = None

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [o.producer() for o in graph.outputs if o.name == contract.LOGITS and o.producer() is not None]

    def match(self, head: ir.Node):
        if head.op_type not in HEADS:
            fail(f"logits are written by {head.op_type}, not by the head's matmul")
        x = head.inputs[0]
        if x is None or 3 not in (rank(x), rank(head.outputs[0])):
            fail("the head's activation is not [batch, sequence, hidden]")  # (a matmul keeps the leading axes)
        if _last_positions(x):
            fail("the head reads the last positions already")
        return head

    def rewrite(self, graph: ir.Graph, head: ir.Node) -> str:
        x = head.inputs[0]
        keep = ir.Value(name=contract.LOGITS_TO_KEEP, shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64),
                        const_value=ir.tensor(np.array([1], np.int64), name=contract.LOGITS_TO_KEEP))
        graph.inputs.append(keep)
        graph.register_initializer(keep)  # its default: the last position
        end = small_constant(graph, "last_position/end", np.array([np.iinfo(np.int64).max], np.int64))
        axis = small_constant(graph, "last_position/axis", np.array([1], np.int64))
        name = (head.name or "lm_head").rsplit("/", 1)[0] + "/LastPosition"
        start = new_node(graph, "Neg", [keep], name + "/start")
        sl = new_node(graph, "Slice", [x, start.outputs[0], end, axis], name)
        if x.shape is not None:
            sl.outputs[0].shape = ir.Shape([x.shape[0], "logits_rows", x.shape[2]])
        sl.outputs[0].type = x.type
        graph.insert_before(head, [start, sl])
        head.replace_input_with(0, sl.outputs[0])
        out = head.outputs[0]
        if out.shape is not None and out.shape.rank() == 3:
            out.shape = ir.Shape([out.shape[0], "logits_rows", out.shape[2]])
        return head.name or "lm_head"


def _last_positions(x: ir.Value) -> bool:
    """Whether `x` is a Slice of the last `logits_to_keep` positions along axis 1 (what this pass puts there)."""
    sl = producer(x, "Slice")
    if sl is None or len(sl.inputs) < 4:
        return False
    neg, axes = producer(sl.inputs[1], "Neg"), const(sl.inputs[3])
    return neg is not None and neg.inputs[0] is not None and neg.inputs[0].name == contract.LOGITS_TO_KEEP \
        and axes is not None and axes.tolist() == [1]
