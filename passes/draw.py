"""Draw one decoder layer as an SVG: a layered DAG laid out here (no graphviz needed).

Which nodes belong to layer i: a node that names it (`/model/layers.i/...`) or reads one of its
weights (`model.layers.i.*`) belongs to it; any other node takes the earliest layer among its
readers, and is drawn when it either reads from the layer or feeds only that layer (so the
shared mask and position subgraphs are not drawn into layer 0).
"""

from __future__ import annotations

from html import escape

import onnx_ir as ir

from .base import node_layer

_FUSED = {"RMSNormalization", "Attention", "FusedRoPE", "RotaryEmbedding", "GroupQueryAttention",
          "SkipSimplifiedLayerNormalization", "MatMulNBits"}
_MATMUL = {"MatMul", "Gemm", "DequantizeLinear"}
_SHAPE = {"Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Reshape", "Range",
          "Expand", "ConstantOfShape", "Constant", "Transpose", "Split", "Identity", "Where", "Equal",
          "CastLike", "GatherND", "Max", "Min", "LessOrEqual", "And"}
COLORS = {"fused": "#b7e4c7", "matmul": "#a9c6f5", "shape": "#e6e6e6", "math": "#fff3bf"}
BOX_H, GAP_X, GAP_Y, CHAR_W = 26, 14, 30, 7.2


def category(op: str) -> str:
    if op in _FUSED:
        return "fused"
    if op in _MATMUL:
        return "matmul"
    if op in _SHAPE:
        return "shape"
    return "math"


def pick_layer(graph: ir.Graph) -> int | None:
    """The layer to draw: 0 when the graph's names say which nodes are layer 0, else None."""
    for node in graph:
        if node_layer(node) == 0:
            return 0
    return None


def layer_nodes(graph: ir.Graph, layer: int | None) -> list[ir.Node]:
    if layer is None:
        return []
    nodes = [n for n in graph if n.op_type != "Constant"]
    own: dict[ir.Node, int | None] = {}
    const_only: set[ir.Node] = set()
    for n in nodes:
        # A weight's Transpose / DequantizeLinear / Cast passes its layer on to the MatMul reading it.
        producers = [v.producer() for v in n.inputs if v is not None and not v.is_initializer()]
        if all(p in const_only for p in producers):
            const_only.add(n)
        own[n] = node_layer(n)
        if own[n] is None:
            own[n] = next((own[p] for p in producers if p in const_only and own.get(p) is not None), None)
    tag: dict[ir.Node, int | None] = {}
    for n in reversed(nodes):  # readers first
        if own[n] is not None:
            tag[n] = own[n]
            continue
        readers = [tag.get(u.node) for o in n.outputs for u in o.uses()]
        readers = [t for t in readers if t is not None]
        tag[n] = min(readers) if readers else None
    chosen: list[ir.Node] = []
    taken: set[ir.Node] = set()
    for n in nodes:
        if tag[n] != layer:
            continue
        readers = {tag.get(u.node) for o in n.outputs for u in o.uses()} - {None}
        reads_layer = any(v is not None and v.producer() in taken for v in n.inputs)
        if own[n] is not None or readers == {layer} or reads_layer:
            chosen.append(n)
            taken.add(n)
    return chosen


def layer_picture(graph: ir.Graph, layer: int | None) -> dict:
    """{"nodes": [{id, op, name, detail}], "edges": [[src, dst]]} for the layer's nodes."""
    nodes = layer_nodes(graph, layer)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for n in nodes:
        detail = ""
        if n.op_type == "Attention":
            a = n.attributes
            detail = f"q{a['q_num_heads'].value}/kv{a['kv_num_heads'].value}" if "q_num_heads" in a else ""
        elif n.op_type == "Split":
            detail = f"{len(n.outputs)} outputs"
        out.append({"id": index[n], "op": n.op_type, "name": n.name or "", "detail": detail})
    edges = sorted({(index[v.producer()], index[n]) for n in nodes for v in n.inputs
                    if v is not None and v.producer() in index})
    return {"layer": layer, "nodes": out, "edges": [list(e) for e in edges]}


def _layout(picture: dict) -> tuple[dict, dict, float, float]:
    nodes, edges = picture["nodes"], picture["edges"]
    preds: dict[int, list[int]] = {n["id"]: [] for n in nodes}
    succs: dict[int, list[int]] = {n["id"]: [] for n in nodes}
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    rank: dict[int, int] = {}
    for n in nodes:  # nodes are in topological order
        rank[n["id"]] = 1 + max((rank[p] for p in preds[n["id"]]), default=-1)
    rows: dict[int, list[int]] = {}
    for i, r in rank.items():
        rows.setdefault(r, []).append(i)
    # Barycenter sweeps: order each row by the mean position of its neighbours in the row above/below.
    pos = {i: k for row in rows.values() for k, i in enumerate(row)}
    for sweep in range(4):
        order = sorted(rows) if sweep % 2 == 0 else sorted(rows, reverse=True)
        for r in order:
            def bary(i, near=preds if sweep % 2 == 0 else succs):
                ns = near[i]
                return sum(pos[j] for j in ns) / len(ns) if ns else pos[i]
            rows[r].sort(key=bary)
            for k, i in enumerate(rows[r]):
                pos[i] = k
    width = {n["id"]: max(len(n["op"]), len(n["detail"])) * CHAR_W + 16 for n in nodes}
    row_w = {r: sum(width[i] for i in row) + GAP_X * (len(row) - 1) for r, row in rows.items()}
    total_w = max(row_w.values(), default=100) + 2 * GAP_X
    xy = {}
    for r, row in rows.items():
        x = (total_w - row_w[r]) / 2
        for i in row:
            xy[i] = (x, GAP_Y / 2 + r * (BOX_H + GAP_Y))
            x += width[i] + GAP_X
    total_h = (max(rows, default=0) + 1) * (BOX_H + GAP_Y) + GAP_Y / 2
    return xy, width, total_w, total_h


def render_svg(picture: dict, title: str = "") -> str:
    """An inline SVG of the picture (boxes coloured by kind: fused, matmul, shape, math)."""
    if not picture["nodes"]:
        return f'<p class="empty">no nodes of layer {picture.get("layer")} to draw</p>'
    xy, width, w, h = _layout(picture)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" viewBox="0 0 {w:.0f} {h:.0f}" '
             f'width="{w:.0f}" height="{h:.0f}" role="img" aria-label="{escape(title)}">']
    for a, b in picture["edges"]:
        (xa, ya), (xb, yb) = xy[a], xy[b]
        x1, y1 = xa + width[a] / 2, ya + BOX_H
        x2, y2 = xb + width[b] / 2, yb
        mid = (y1 + y2) / 2
        parts.append(f'<path d="M{x1:.1f},{y1:.1f} C{x1:.1f},{mid:.1f} {x2:.1f},{mid:.1f} {x2:.1f},{y2:.1f}" '
                     'class="edge"/>')
    for n in picture["nodes"]:
        x, y = xy[n["id"]]
        label = escape(n["op"] + (f" {n['detail']}" if n["detail"] else ""))
        parts.append(f'<g class="node {category(n["op"])}"><title>{escape(n["name"])}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{width[n["id"]]:.1f}" height="{BOX_H}" rx="5" '
                     f'fill="{COLORS[category(n["op"])]}"/>'
                     f'<text x="{x + width[n["id"]] / 2:.1f}" y="{y + BOX_H / 2 + 4:.1f}">{label}</text></g>')
    parts.append("</svg>")
    return "".join(parts)
