"""OrtGatherBlockQuantized (target onnxruntime): the quantized embedding -> com.microsoft.GatherBlockQuantized."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from fuselm.graphcheck import ORT_DOMAIN

from .base import Fusion, attr, fail, new_node, producer, small_constant, take_over
from .ort_matmul_nbits import Blocked, blocked_weight, nbits_tensors


@dataclass
class GatherMatch:
    out: ir.Value  # the embedding rows
    ids: ir.Value
    weight: Blocked
    nodes: list[ir.Node]


def _gathered_rows(dq: ir.Node) -> tuple[ir.Value, list[ir.Node], list[ir.Value]]:
    """(ids, Gathers, [table, scales, zero points]) for DequantizeLinear(Gather(q, ids), Gather(s, ids),
    Gather(z, ids)) (fuselm's exporter: only the rows looked up are dequantized)."""
    gathers = [producer(v, "Gather") for v in dq.inputs if v is not None]
    if len(gathers) < 2 or any(g is None for g in gathers):
        fail("the DequantizeLinear's inputs are not all Gathers")
    ids = gathers[0].inputs[1]
    if any(g.inputs[1] is not ids or attr(g, "axis", 0) != 0 for g in gathers):
        fail("the Gathers do not read the same indices along axis 0")
    return ids, gathers, [g.inputs[0] for g in gathers]


_OTHER = {"DequantizeLinear": "Gather", "Gather": "DequantizeLinear"}  # anchor -> what makes its input 0


class OrtGatherBlockQuantized(Fusion):
    """Gather of a blocked-quantized table -> com.microsoft.GatherBlockQuantized(data, ids, scales, zero_points).

    The patterns: DequantizeLinear(Gather(q, ids), Gather(scales, ids), Gather(zero_points, ids))
    blocked along the last axis (fuselm's exporter), or Gather(DequantizeLinear(q [V, H] blocked
    along axis 1), ids) (as FromGenAI maps the builder's op back). q uint4/int4/uint8/int8 [V, H],
    float32 scales [V, blocks]: data, scales and zero points in MatMulNBits' packed layout (a
    Reshape to [V, ·] of the same initializers, so a tied lm_head and the embedding share one copy
    on disk, as onnxruntime-genai's builder does; `map_tables_apart` gives the embedding its own
    initializers over those bytes when the graph is written), gather_axis 0, quantize_axis 1.
    Must not fire (and says why): the Gathers read different indices or another axis; a table that
    is not blocked along its rows' last axis, or whose block size GatherBlockQuantized does not take
    (a power of two >= 16); non-float32 scales; a table of another rank or type.
    """

    aliases = ("ort-gather-quantized", "gather-block-quantized", "gbq")
    needs_opset = None

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        for n in graph:
            if n.domain in ("", "ai.onnx") and n.op_type in _OTHER and \
                    producer(n.inputs[0], _OTHER[n.op_type]) is not None:
                yield n

    def match(self, anchor: ir.Node) -> GatherMatch:
        if anchor.op_type == "Gather":
            dq = producer(anchor.inputs[0], "DequantizeLinear")
            if attr(anchor, "axis", 0) != 0:
                fail(f"gathers along axis {attr(anchor, 'axis')}, not the table's rows")
            if len(dq.outputs[0].uses()) != 1:
                fail("the dequantized table has other readers")
            return GatherMatch(anchor.outputs[0], anchor.inputs[1], blocked_weight(dq, rows_first=True),
                               [anchor, dq])
        ids, gathers, (q, scale, *zero) = _gathered_rows(anchor)
        if any(len(g.outputs[0].uses()) != 1 for g in gathers):
            fail("a gathered part has other readers")
        if q.shape is None or ids.shape is None:
            fail("the table's or the indices' rank is unknown")
        rank = ids.shape.rank() + q.shape.rank() - 1  # of the gathered rows
        if attr(anchor, "axis", 1) % rank != rank - 1:
            fail(f"blocked along axis {attr(anchor, 'axis', 1)}, not the rows' last axis")
        # The same weight as a [V, H] table blocked along axis 1: check it as one.
        table = ir.node("DequantizeLinear", [q, scale, *zero], attributes={
            "axis": 1, "block_size": attr(anchor, "block_size", 0),
            **({"output_dtype": attr(anchor, "output_dtype")} if attr(anchor, "output_dtype") else {})})
        try:
            w = blocked_weight(table, rows_first=True)
        finally:
            for i in range(len(table.inputs)):  # detach the probe node from the initializers' uses
                table.replace_input_with(i, None)
        return GatherMatch(anchor.outputs[0], ids, w, [anchor, *gathers])

    def rewrite(self, graph: ir.Graph, m: GatherMatch) -> str:
        w = m.weight
        b, s, z = nbits_tensors(graph, w)
        scope = (m.nodes[0].name or "/model/embed_tokens").rsplit("/", 1)[0]
        rows = small_constant(graph, f"{scope}/rows_shape", np.array([w.n, -1], dtype=np.int64))
        data = new_node(graph, "Reshape", [b, rows], f"{scope}/data/Reshape")
        zeros = new_node(graph, "Reshape", [z, rows], f"{scope}/zero_points/Reshape")
        gbq = new_node(graph, "GatherBlockQuantized", [data.outputs[0], m.ids, s, zeros.outputs[0]],
                       f"{scope}/GatherBlockQuantized", domain=ORT_DOMAIN, bits=w.bits, block_size=w.block,
                       gather_axis=0, quantize_axis=1)
        graph.insert_before(m.nodes[0], [data, zeros, gbq])
        take_over(m.out, gbq.outputs[0])
        graph.opset_imports.setdefault(ORT_DOMAIN, 1)
        return scope


def map_tables_apart(path: str | Path) -> int:
    """Give GatherBlockQuantized its own initializers over the same bytes of the data file where it shares
    them with another reader (the tied lm_head's MatMulNBits); returns how many were added.

    onnxruntime maps each external initializer by itself: the head's copy is prepacked and its mapping
    dropped, the embedding's stays mapped and only the rows looked up are read. One initializer read by
    both keeps the whole table resident beside the packed copy.
    Rewrites model.onnx only; the data file keeps one copy of the table."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    readers = Counter(name for n in graph.node for name in n.input)
    added = 0
    for gbq in [n for n in graph.node if n.domain == ORT_DOMAIN and n.op_type == "GatherBlockQuantized"]:
        for i, name in enumerate(gbq.input):
            node, slot = gbq, i
            if (reshape := made_by.get(name)) is not None and reshape.op_type == "Reshape":
                node, slot, name = reshape, 0, reshape.input[0]  # the data and zero points come through a Reshape
            t = inits.get(name)
            if t is None or t.data_location != onnx.TensorProto.EXTERNAL or readers[name] < 2 \
                    or f"{name}.gather" in inits:
                continue
            own = onnx.TensorProto()
            own.CopyFrom(t)
            own.name = f"{name}.gather"
            graph.initializer.append(own)
            inits[own.name] = own
            node.input[slot] = own.name
            readers[name] -= 1
            added += 1
    if added:
        onnx.save(model, str(path))
    return added
