"""OrtSkipRMSNorm (target onnxruntime): residual Add + RMSNormalization -> SkipSimplifiedLayerNormalization."""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from fuselm.graphcheck import ORT_DOMAIN

from .base import Fusion, attr, fail, input_at, new_node, producer, take_over


@dataclass
class NormMatch:
    norm: ir.Node
    add: ir.Node | None  # the residual Add folded in, None for a plain SimplifiedLayerNormalization


def _same_shape(a: ir.Value, b: ir.Value) -> bool:
    """Whether the Add cannot broadcast: both rank 3 with equal dims where shapes are known (the
    passes' graphs often carry none; a residual Add of two computed tensors is then taken as one)."""
    known = [v.shape for v in (a, b) if v.shape is not None]
    if any(s.rank() != 3 for s in known):
        return False
    return len(known) < 2 or all(x == y for x, y in zip(known[0].dims, known[1].dims, strict=True))


class OrtSkipRMSNorm(Fusion):
    """RMSNormalization(Add(a, b), w) -> com.microsoft.SkipSimplifiedLayerNormalization(a, b, w); else
    RMSNormalization(x, w) -> SimplifiedLayerNormalization(x, w) (onnxruntime's, in the ONNX domain).

    The pattern: an RMSNormalization-23 over the last axis with stash_type float32 and a 1-D
    constant weight. When its input is the residual Add of two [B, S, hidden] tensors of the same
    shape (no broadcast, neither constant), the Add goes inside: output 0 is the normalized value,
    output 3 the sum (read by the next residual Add, as onnxruntime-genai's builder wires it). The
    q/k norms over head_dim and the first layer's norm (no residual) become
    SimplifiedLayerNormalization.
    Must not fire (and says why): a norm not over the last axis; stash_type other than float32;
    a weight that is not a 1-D constant; an input that is not float32. The Add stays outside (and
    the norm becomes SimplifiedLayerNormalization) when it broadcasts or is not rank 3 (as far as
    shapes are known), or adds a constant.
    """

    aliases = ("ort-skip-norm", "skip-norm", "skip-rms-norm")
    needs_opset = None
    anchor_ops = ("RMSNormalization",)

    def match(self, norm: ir.Node) -> NormMatch:
        x, w = norm.inputs[0], norm.inputs[1]
        r = x.shape.rank() if x.shape is not None else None
        axis = attr(norm, "axis", -1)
        if axis != -1 and (r is None or axis != r - 1):
            fail(f"normalizes from axis {axis}, not the last one alone")
        if attr(norm, "stash_type", 1) != 1:
            fail("stash_type is not float32")
        if input_at(norm, 2) is not None:
            fail("has a bias input")
        if w is None or w.const_value is None or w.shape is None or w.shape.rank() != 1:
            fail("the weight is not a 1-D constant")
        if x.dtype not in (None, ir.DataType.FLOAT) or w.const_value.dtype != ir.DataType.FLOAT:
            fail(f"input {x.dtype} / weight {w.const_value.dtype}, not float32")
        add = producer(x, "Add")
        if add is not None and (not _same_shape(*add.inputs) or any(i.const_value is not None for i in add.inputs)):
            add = None
        return NormMatch(norm, add)

    def rewrite(self, graph: ir.Graph, m: NormMatch) -> str:
        n = m.norm
        eps = attr(n, "epsilon", 1e-5)
        base = (n.name or "norm").removesuffix("/RMSNormalization")
        if m.add is None:
            new = new_node(graph, "SimplifiedLayerNormalization", [n.inputs[0], n.inputs[1]],
                           f"{base}/SimplifiedLayerNormalization", axis=-1, epsilon=eps, stash_type=1)
        else:
            new = new_node(graph, "SkipSimplifiedLayerNormalization", [*m.add.inputs, n.inputs[1]],
                           f"{base}/SkipSimplifiedLayerNormalization", outputs=4, domain=ORT_DOMAIN, epsilon=eps)
        graph.insert_before(n, new)
        take_over(n.outputs[0], new.outputs[0])
        graph.remove(n, safe=True)
        if m.add is not None:
            total = m.add.outputs[0]
            if total.uses() or total.is_graph_output():
                take_over(total, new.outputs[3])
            graph.remove(m.add, safe=True)
            for i in (1, 2):  # mean and inv_std_var: unread, so no output (as the builder writes it)
                new.outputs[i].name = ""
            graph.opset_imports.setdefault(ORT_DOMAIN, 1)
        return base
