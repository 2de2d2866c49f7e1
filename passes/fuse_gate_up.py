"""FuseGateUp: gate and up projections of one tensor feeding SiLU(gate)·up -> one MatMul + Split."""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from .base import Fusion, fail, producer
from .projections import Projection, check_compatible, fuse, parse_projection


def silu_input(value: ir.Value | None) -> ir.Value | None:
    """x when `value` is SiLU(x) written as Mul(x, Sigmoid(x)) (either order), else None."""
    mul = producer(value, "Mul")
    if mul is None:
        return None
    for x, s in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        sig = producer(s, "Sigmoid")
        if sig is not None and sig.inputs[0] is x:
            return x
    return None


def projection_of(value: ir.Value | None) -> Projection | None:
    """The projection whose output is `value` (MatMul with a constant weight, maybe + bias)."""
    node = producer(value, "MatMul", "Add")
    if node is not None and node.op_type == "Add":
        node = producer(node.inputs[0], "MatMul") or producer(node.inputs[1], "MatMul")
    if node is None:
        return None
    try:
        p = parse_projection(node)
    except Exception:
        return None
    return p if p.output is value else None


def is_gate_up_pair(a: Projection, b: Projection) -> bool:
    """Whether a and b (either way round) form SiLU(gate)·up."""
    for gate, up in ((a, b), (b, a)):
        for use in up.output.uses():
            mul = use.node
            if mul.op_type == "Mul" and silu_input(mul.inputs[1 - use.idx]) is gate.output:
                return True
    return False


class FuseGateUp(Fusion):
    """SiLU(x·Wg [+bg]) · (x·Wu [+bu])  ->  Split(x·[Wg|Wu] [+ [bg|bu]]) -> SiLU(gate) · up.

    The activation stays as it was (Sigmoid and Mul after the Split): runtimes fuse it with the
    product themselves. Weights concatenate along the output dim exactly as in FuseQKV (plain,
    transposed, or blocked DequantizeLinear with equal bits and block size).
    Must not fire (and says why): gate and up read different tensors; the activation is not
    SiLU (e.g. GELU or a plain sigmoid gate); weights differ in form, dtype or quantization;
    gate and up widths differ; only one of them has a bias.
    """

    aliases = ("fuse-gate-up", "gate-up", "gateup")

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        for node in graph:
            if node.op_type != "Mul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
                continue
            if silu_input(node.outputs[0]) is not None:  # the SiLU's own Mul
                continue
            if any(projection_of(v) is not None for v in node.inputs):
                yield node

    def match(self, mul: ir.Node) -> tuple[Projection, Projection]:
        g_side = next((i for i in (0, 1) if silu_input(mul.inputs[i]) is not None), None)
        if g_side is None:
            fail("neither factor is SiLU(gate) = gate·Sigmoid(gate)")
        gate = projection_of(silu_input(mul.inputs[g_side]))
        up = projection_of(mul.inputs[1 - g_side])
        if gate is None:
            fail("the SiLU input is not a projection with a constant weight")
        if up is None:
            fail("the factor beside SiLU(gate) is not a projection with a constant weight")
        if gate.input is not up.input:
            fail(f"gate and up read different tensors ({gate.input.name} vs {up.input.name})")
        check_compatible([gate, up])
        if gate.weight.out_dim != up.weight.out_dim:
            fail(f"gate and up widths differ ({gate.weight.out_dim} vs {up.weight.out_dim})")
        return gate, up

    def rewrite(self, graph: ir.Graph, match: tuple[Projection, Projection]) -> str:
        return fuse(graph, list(match), "gate_proj", "gate_up_proj")
