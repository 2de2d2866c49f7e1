"""Pictures of decoder layers for `fuselm diff`: which nodes a layer holds, a layered-DAG layout
(no graphviz needed), and what a pass removed, added or rewired in each layer.

Which nodes belong to layer i: a node that names it (`/model/layers.i/...`) or reads one of its
weights (`model.layers.i.*`) belongs to it; any other node takes the earliest of the layers it
feeds (through other such nodes), and is drawn when it reads from that layer or feeds only that
layer (so the mask and position subgraphs, which feed every layer, are not drawn into layer 0).
Nodes per layer count the nodes inside it: a mere feeder (the embedding Gather feeds layer 0
only) is drawn but counted as shared, like the mask, the final norm and lm_head.

Marks (`mark_changes`): a node is matched across a pass by its name (else op and first output).
Removed = in the before picture only; added = in the after picture only; rewired = in both, with
other inputs. Each connected group of added nodes is traced back to the removed nodes it
replaced: those reachable forward from the group's inputs AND backward from the nodes reading
its outputs, through removed nodes only (a fused op's inputs lead to the subgraph it replaced).
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from fuselm import contract

from .base import node_layer

_FUSED = {"RMSNormalization", "Attention", contract.ROPE_OP, contract.SWIGLU_OP, "RotaryEmbedding", "GroupQueryAttention",
          "SkipSimplifiedLayerNormalization", "MatMulNBits"}
_MATMUL = {"MatMul", "Gemm", "DequantizeLinear"}
_SHAPE = {"Shape", "Size", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Cast", "Reshape", "Range",
          "Expand", "ConstantOfShape", "Constant", "Transpose", "Split", "Identity", "Where", "Equal",
          "CastLike", "GatherND", "Max", "Min", "LessOrEqual", "And"}
COLORS = {"fused": "#b7e4c7", "matmul": "#a9c6f5", "shape": "#e6e6e6", "math": "#fff3bf"}
MARK_COLORS = {"removed": "#d62828", "added": "#2b9348", "rewired": "#f77f00"}
BOX_H, GAP_X, GAP_Y, CHAR_W = 24, 14, 18, 7.2


def category(op: str) -> str:
    return next((c for c, ops in (("fused", _FUSED), ("matmul", _MATMUL), ("shape", _SHAPE)) if op in ops),
                "math")


def _assign(graph: ir.Graph) -> tuple[dict[ir.Node, int], set[ir.Node]]:
    """(the layer of every drawn node, the nodes inside a layer: not mere feeders such as the
    embedding Gather, which only feeds layer 0 but computes nothing of it)."""
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
    reach: dict[ir.Node, frozenset] = {}  # the layers a node feeds, through nodes of no layer
    for n in reversed(nodes):
        layers: set[int] = set()
        for u in (u for o in n.outputs for u in o.uses()):
            r = own.get(u.node)
            layers |= {r} if r is not None else reach.get(u.node, frozenset())
        reach[n] = frozenset(layers)
    chosen: dict[ir.Node, int] = {}
    inside: set[ir.Node] = set()
    for n in nodes:
        if own[n] is not None:
            chosen[n] = own[n]
            inside.add(n)
            continue
        if not reach[n]:
            continue
        layer = min(reach[n])
        if any(v is not None and v.producer() in inside and chosen[v.producer()] == layer for v in n.inputs):
            chosen[n] = layer
            inside.add(n)
        elif reach[n] == {layer}:
            chosen[n] = layer
    return chosen, inside


def layer_assignment(graph: ir.Graph) -> dict[ir.Node, int]:
    """The decoder layer each drawn node belongs to (nodes in no layer are left out)."""
    return _assign(graph)[0]


def nodes_per_layer(graph: ir.Graph) -> dict:
    """{"layers": [nodes inside layer 0, 1, ...], "per_layer": the largest, "uniform": whether all
    layers have the same, "shared": every other node (embedding, mask, positions, final norm, lm_head)}."""
    chosen, inside = _assign(graph)
    counts = Counter(chosen[n] for n in inside)
    layers = [counts.get(i, 0) for i in range(max(counts, default=-1) + 1)]
    return {"layers": layers, "per_layer": max(layers, default=0), "uniform": len(set(layers)) <= 1,
            "shared": graph.num_nodes() - sum(layers)}


def _picture(nodes: list[ir.Node], layer: int) -> dict:
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    names = Counter(n.name for n in nodes)
    for n in nodes:
        detail = ""
        if n.op_type == "Attention":
            a = n.attributes
            detail = f"q{a['q_num_heads'].value}/kv{a['kv_num_heads'].value}" if "q_num_heads" in a else ""
        elif n.op_type == "Split":
            detail = f"{len(n.outputs)} outputs"
        first = n.outputs[0].name if n.outputs else ""
        key = n.name if n.name and names[n.name] == 1 else f"{n.op_type}:{first}"
        out.append({"id": index[n], "op": n.op_type, "name": n.name or "", "detail": detail, "key": key,
                    "inputs": [v.name or "" if v is not None else "" for v in n.inputs],
                    "outputs": [v.name or "" for v in n.outputs]})
    edges = sorted({(index[v.producer()], index[n]) for n in nodes for v in n.inputs
                    if v is not None and v.producer() in index})
    picture = {"layer": layer, "nodes": out, "edges": [list(e) for e in edges]}
    _layout(picture)
    return picture


def layer_pictures(graph: ir.Graph) -> dict[int, dict]:
    """{layer: picture} for every layer; a picture is {"layer", "nodes": [{id, op, name, detail,
    key, inputs, outputs, x, y, w}], "edges": [[src, dst]], "width", "height"}."""
    by_layer: dict[int, list[ir.Node]] = {}
    for n, i in layer_assignment(graph).items():
        by_layer.setdefault(i, []).append(n)
    return {i: _picture(nodes, i) for i, nodes in sorted(by_layer.items())}


def _layout(picture: dict) -> None:
    """Give every node x, y, w and the picture its width and height (rows by longest path, rows
    ordered by barycenter sweeps)."""
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
    width = {n["id"]: (len(n["op"]) + (len(n["detail"]) + 1 if n["detail"] else 0)) * CHAR_W + 16 for n in nodes}
    row_w = {r: sum(width[i] for i in row) + GAP_X * (len(row) - 1) for r, row in rows.items()}
    total_w = max(row_w.values(), default=100) + 2 * GAP_X
    for r, row in rows.items():
        x = (total_w - row_w[r]) / 2
        for i in row:
            n = nodes[i]
            n["x"], n["y"], n["w"] = round(x), round(GAP_Y / 2 + r * (BOX_H + GAP_Y)), round(width[i])
            x += width[i] + GAP_X
    picture["width"] = round(total_w)
    picture["height"] = round((max(rows, default=0) + 1) * (BOX_H + GAP_Y) + GAP_Y / 2)


def mark_changes(before: dict, after: dict) -> dict:
    """What a pass did to one layer's picture.

    Returns {"removed": [before ids], "added": [after ids], "rewired": [after ids],
    "groups": [{"added": [after ids], "replaced": [before ids]}]}, groups in the after order.
    """
    b_nodes, a_nodes = before["nodes"], after["nodes"]
    b_key, a_key = {n["key"]: n for n in b_nodes}, {n["key"]: n for n in a_nodes}
    removed = {n["id"] for n in b_nodes if n["key"] not in a_key}
    added = {n["id"] for n in a_nodes if n["key"] not in b_key}
    rewired = [n["id"] for n in a_nodes if n["key"] in b_key and n["inputs"] != b_key[n["key"]]["inputs"]]
    b_prod, b_readers = _wiring(b_nodes)
    a_prod, a_readers = _wiring(a_nodes)
    def near(i: int) -> list[int | None]:  # the nodes next to node i of the after picture
        n = a_nodes[i]
        return [a_prod.get(v) for v in n["inputs"]] + [r for v in n["outputs"] for r in a_readers.get(v, [])]

    groups = []
    seen: set[int] = set()
    for start in sorted(added):
        if start in seen:
            continue
        comp = _reach([start], near, added)  # the connected group of added nodes around `start`
        seen |= comp
        inputs = {v for i in comp for v in a_nodes[i]["inputs"] if v and a_prod.get(v) not in comp}
        outputs = {v for i in comp for v in a_nodes[i]["outputs"] if v}
        readers = {r for v in outputs for r in a_readers.get(v, []) if r not in comp}
        # Forward from the group's inputs through removed nodes (in the before picture).
        fwd = _reach([r for v in inputs for r in b_readers.get(v, [])], lambda i: [
            r for v in b_nodes[i]["outputs"] for r in b_readers.get(v, [])], removed)
        # Backward from what reads the group now (and from outputs it took over, e.g. present.*).
        seeds = [b_prod.get(v) for v in outputs]
        for r in readers:
            old = b_key.get(a_nodes[r]["key"])
            if old is not None:
                seeds += [b_prod.get(v) for v in old["inputs"]]
        bwd = _reach(seeds, lambda i: [b_prod.get(v) for v in b_nodes[i]["inputs"]], removed)
        groups.append({"added": sorted(comp), "replaced": sorted(fwd & bwd)})
    return {"removed": sorted(removed), "added": sorted(added), "rewired": rewired, "groups": groups}


def _wiring(nodes: list[dict]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """(value -> the id writing it, value -> the ids reading it) in a picture's nodes."""
    readers: dict[str, list[int]] = {}
    for n in nodes:
        for v in n["inputs"]:
            readers.setdefault(v, []).append(n["id"])
    return {v: n["id"] for n in nodes for v in n["outputs"] if v}, readers


def _reach(seeds: list, step, within: set[int] | None = None) -> set[int]:
    """The ids reachable from `seeds` by `step(id) -> ids`, seeds included, through ids `within` only."""
    found: set[int] = set()
    todo = [s for s in seeds if within is None or s in within]
    while todo:
        i = todo.pop()
        if i not in found:
            found.add(i)
            todo += [j for j in step(i) if within is None or j in within]
    return found


def describe(before: dict, after: dict, marks: dict) -> list[dict]:
    """The groups in words: [{"added": ["RMSNormalization"], "replaced": ["Pow", ...]}]."""
    return [{"added": [after["nodes"][i]["op"] for i in g["added"]],
             "replaced": [before["nodes"][i]["op"] for i in g["replaced"]]} for g in marks["groups"]]


class Stages:
    """The pictures `fuselm diff` keeps: every layer at every stage the graph changed, and per
    pass the marks of each layer."""

    def __init__(self, graph: ir.Graph):
        # the layer drawn first: 0 when the graph's names say which nodes are layer 0
        self.first_layer = 0 if any(node_layer(n) == 0 for n in graph) else None
        self.stages = [layer_pictures(graph)]
        self.counts = [nodes_per_layer(graph)]

    def record(self, record: dict, graph: ir.Graph | None) -> None:
        """Annotate a pass's record; `graph` is the graph after the pass when it changed it, else None."""
        before = len(self.stages) - 1
        record["stage_before"] = before
        record["nodes_per_layer_before"] = self.counts[before]
        if graph is not None:
            self.stages.append(layer_pictures(graph))
            self.counts.append(nodes_per_layer(graph))
        after = len(self.stages) - 1
        record["stage_after"] = after
        record["nodes_per_layer_after"] = self.counts[after]
        old, new = self.stages[before], self.stages[after]
        empty = {"layer": None, "nodes": [], "edges": [], "width": 0, "height": 0}
        record["marks"] = {} if after == before else {
            i: mark_changes(old.get(i, empty), new.get(i, empty)) for i in sorted(set(old) | set(new))}
        first = self.first_layer
        if first is not None:
            marks = record["marks"].get(first)
            record["picture_before"] = _annotated(old.get(first, empty), marks, "before")
            record["picture_after"] = _annotated(new.get(first, empty), marks, "after")
            if marks is not None:
                record["changes_drawn_layer"] = describe(old.get(first, empty), new.get(first, empty), marks)


def _annotated(picture: dict, marks: dict | None, side: str) -> dict:
    """The picture for the JSON report: nodes {id, op, name, detail} with their "mark" and "groups"."""
    mark: dict[int, str] = {}
    groups: dict[int, list[int]] = {}
    if marks is not None:
        if side == "before":
            mark.update((i, "removed") for i in marks["removed"])
        else:
            mark.update((i, "rewired") for i in marks["rewired"])
            mark.update((i, "added") for i in marks["added"])
        for k, g in enumerate(marks["groups"], 1):
            for i in g["replaced" if side == "before" else "added"]:
                groups.setdefault(i, []).append(k)
    nodes = [{"id": n["id"], "op": n["op"], "name": n["name"], "detail": n["detail"],
              **({"mark": mark[n["id"]]} if n["id"] in mark else {}),
              **({"groups": groups[n["id"]]} if n["id"] in groups else {})} for n in picture["nodes"]]
    return {"layer": picture.get("layer"), "nodes": nodes, "edges": picture["edges"]}
