"""FuseSwiGLU: Split(gate_up) -> SiLU(gate)·up  ->  one fuselm::SwiGLU over the fused gate/up output."""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from fuselm import contract

from .base import (
    Fusion,
    attr,
    const,
    fail,
    input_at,
    new_node,
    producer,
    rank,
    static_shape,
    take_over,
    users,
)
from .fuse_gate_up import silu_input


def _halves(split: ir.Node) -> None:
    """fail() unless the Split cuts its input's last axis into two equal halves."""
    axis = attr(split, "axis", 0)
    r = rank(split.inputs[0])
    if axis != -1 and (r is None or axis != r - 1):
        fail(f"the Split is over axis {axis}, not the last one")
    sizes = const(input_at(split, 1))
    if sizes is not None:
        if len(sizes) != 2 or int(sizes[0]) != int(sizes[1]):
            fail(f"the Split's sizes {[int(s) for s in sizes]} are not two equal halves")
        return
    if input_at(split, 1) is not None:
        fail("the Split's sizes are not a constant")
    shape = static_shape(split.inputs[0])
    if attr(split, "num_outputs") != 2 or not shape or shape[-1] is None or shape[-1] % 2:
        fail("the Split is not into two halves of a known, even width")


class FuseSwiGLU(Fusion):
    """Mul(SiLU(gate), up) with gate, up = Split(x) (halves, last axis)  ->  fuselm::SwiGLU(x).

    FuseGateUp's output: x = x_norm·[Wg|Wu] split in two, SiLU(gate) = gate·Sigmoid(gate) (either
    operand order), times up. One node of the fuselm domain replaces the Split, the Sigmoid and the
    two Muls; its model-local function (fuselm/contract.py) is those four standard ops, so
    onnxruntime and Netron still read it, and a runtime that knows it runs one gated kernel.
    Must not fire (and says why): gate and up not the first and second output of one Split
    (separate projections, when FuseGateUp did not fire; up first); halves of different widths,
    or a Split over another axis; any intermediate (gate, up, the Sigmoid, SiLU(gate)) read by
    anything else or a graph output; an activation that is not SiLU.
    """

    aliases = ("fuse-swiglu", "swiglu", "silu-gate")
    needs_opset = None
    functions = True

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        for node in graph:
            if node.op_type == "Mul" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2 and \
                    silu_input(node.outputs[0]) is None and any(silu_input(v) is not None for v in node.inputs):
                yield node

    def match(self, mul: ir.Node) -> tuple[ir.Node, ir.Node]:
        side = next(i for i in (0, 1) if silu_input(mul.inputs[i]) is not None)
        silu, up = mul.inputs[side], mul.inputs[1 - side]
        gate = silu_input(silu)
        split = producer(gate, "Split")
        if split is None or producer(up, "Split") is not split:
            fail("gate and up are not outputs of one Split (separate projections: FuseGateUp did not fire)")
        if len(split.outputs) != 2 or split.outputs[0] is not gate or split.outputs[1] is not up:
            fail("the Split does not give gate then up as its only two outputs")
        _halves(split)
        sig = next(n for n in users(gate) if n.op_type == "Sigmoid")
        for v, n in ((gate, 2), (up, 1), (silu, 1), (sig.outputs[0], 1)):
            if len(v.uses()) != n or v.is_graph_output():
                fail(f"{v.name} is read outside SiLU(gate)·up")
        return mul, split

    def rewrite(self, graph: ir.Graph, m: tuple[ir.Node, ir.Node]) -> str:
        mul, split = m
        scope = (mul.name or "mlp").rsplit("/", 1)[0]
        node = new_node(graph, contract.SWIGLU_OP, [split.inputs[0]], f"{scope}/act/{contract.SWIGLU_OP}",
                        domain=contract.DOMAIN)
        graph.insert_before(mul, node)
        take_over(mul.outputs[0], node.outputs[0])
        return scope
