"""`fuselm split`: a decoder graph cut into pipeline stages at decoder-layer boundaries.

Pattern: a node is free when nothing of the token stream reaches it (weights, the mask, position
values: it reads input_ids only through Shape, and no cache or stream value); every other node
belongs to a decoder layer (its name `/model/layers.{i}/...` or a weight it reads: passes/base.py
`node_layer`; reading `past_key_values.{i}.*` other than through Shape, or writing `present.{i}.*`,
makes it layer i), to the tail (after a layer: the final norm and the head), or comes before the
layers (the embedding: first stage only). Stage k keeps the nodes of its layers (the last stage also
the tail) and recomputes every free node they read from its own inputs, whatever its name says: the
mask is built again in each stage from `attention_mask`, which every stage takes (the choice
"recompute", not "receive"), also when an exporter computed it inside layer 0's scope;
in a later stage `Shape(input_ids)` reads the first two dims of the hidden state instead, and a
`Shape` of another layer's cache reads the stage's own first cache (all layers' caches have one shape).

Stage k > 0 takes `hidden_states` (contract.HIDDEN) where exactly one activation crosses from stage
k-1, which returns it as `hidden_states_out` (contract.NEXT_HIDDEN); the last stage returns `logits`.
Each stage takes `attention_mask`, `position_ids` and the caches and recurrent states of its own layers
(their global names, `past_key_values.14.key` / `past_state.15.conv` in stage 1), and returns their presents.

A layer that reads another layer's keys and values (KV sharing, Gemma 3n / 4: contract.kv_sources from the
graph's metadata) has no cache of its own; its Attention reads the source layer's past and new rows, so the
source and its readers stay in one stage. So does a layer handed a tensor another layer computes (a sparse-attention
layer reusing an earlier layer's top-k selection: `reads_layer` in the metadata).

Must not cut (FuselmError, exit 2): a cut where more than one value crosses or a stage reads from a
stage other than the one before it (a graph whose layers do not chain through one residual value); a cut
between a layer and the layers that read its keys and values; a node whose name and cache disagree on its
layer; layers that are not 0..L-1; more stages than layers.
Weights are balanced by bytes (contiguous layer ranges minimizing the largest stage) unless given.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx_ir as ir

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.genai_config import NAME as GENAI_NAME
from fuselm.modeldir import atomic_output_dir, copy_tokenizer_files, write_meta

from . import graphio
from .base import attach_functions, attr, layer_of_name, node_layer

SPLIT_NAME = contract.SPLIT_NAME


@dataclass
class Stage:
    index: int
    layers: range
    first: bool
    last: bool
    nodes: set[int] = field(default_factory=set)  # node indices (graph order) of the source graph
    initializers: set[str] = field(default_factory=set)
    crossing: str | None = None  # the source value that becomes this stage's HIDDEN input
    shape_rewrites: dict[int, str] = field(default_factory=dict)  # Shape node index -> what it reads now
    bytes: int = 0


class Graph:
    """The source graph classified once: each node free, or carrying the stream in a layer, the tail or before
    the layers (the embedding)."""

    def __init__(self, model: ir.Model):
        self.model = model
        self.nodes = list(model.graph)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        inputs = {v.name for v in model.graph.inputs}
        pasts = sorted((n for n in inputs if contract.is_step_past(n)), key=contract.step_order)
        self.sources = contract.kv_sources(dict(model.metadata_props))  # reader layer -> the layer whose K/V it reads
        # reader layer -> the layer whose tensor it is handed (a shared top-k selection): kept in one stage too
        self.handed = contract.kv_sources(dict(model.metadata_props), "reads_layer")
        self.cached = sorted({contract.parse_cache(n).layer for n in pasts if contract.is_past(n)})
        held = {contract.layer_of(n) for n in pasts} | set(self.sources)  # a KV cache, a recurrent state, a KV source
        # layers without a cache or state (Nemotron-H's MLP blocks) count by their nodes' names, up to the first gap
        named = {x for x in (node_layer(node) for node in self.nodes) if x is not None}
        self.n_layers = max(held, default=-1) + 1
        while self.n_layers in named:
            self.n_layers += 1
        layers = sorted(held | {x for x in named if x < self.n_layers})
        missing = [n for n in (*contract.STEP_INPUTS,) if n not in inputs]
        if missing or not pasts or contract.LOGITS not in {v.name for v in model.graph.outputs}:
            raise FuselmError(f"the graph does not follow the fuselm contract (missing {missing or contract.LOGITS}); "
                              f"split needs {contract.NAMES_TEXT}")
        if layers != list(range(self.n_layers)) or any(src not in self.cached for src in self.sources.values()):
            raise FuselmError(f"the cache inputs name layers {self.cached} (and layers {sorted(self.sources)} read "
                              "another's); split needs layers 0..L-1")
        n = len(self.nodes)
        # act: the node carries the token stream (reads input_ids other than through Shape, a cache, or an
        # act value); every other node is free (weights, mask, positions), recomputed by each stage reading it
        self.act = [False] * n
        self.layer: list[int | None] = [None] * n
        self.tail = [False] * n  # act, after a layer, in none: the final norm and the head (last stage)
        for i, node in enumerate(self.nodes):
            prods = [self._producer(v) for v in node.inputs if v is not None]
            reads = [v.name for v in node.inputs if v is not None]
            self.act[i] = any(p is not None and self.act[p] for p in prods) or \
                any(contract.is_step_present(v.name) for v in node.outputs) or \
                (node.op_type != "Shape" and any(r == contract.INPUT_IDS or contract.is_step_past(r) for r in reads))
            if self.act[i]:
                self.layer[i] = self._layer_of(node)
                if self.layer[i] is None:
                    self.tail[i] = any(p is not None and (self.layer[p] is not None or self.tail[p]) for p in prods)
        # the embedding: act before any layer, first stage only
        self.pre = [a and layer is None and not t for a, layer, t in zip(self.act, self.layer, self.tail, strict=True)]
        self.init_bytes = {name: _nbytes(v) for name, v in model.graph.initializers.items()}

    def _producer(self, v: ir.Value) -> int | None:
        p = v.producer()
        return self.index.get(p) if p is not None else None

    def _layer_of(self, n: ir.Node) -> int | None:
        by_cache = {c for v in n.inputs if v is not None and n.op_type != "Shape"
                    for c in [contract.layer_of(v.name)] if c is not None} | \
                   {c for v in n.outputs for c in [contract.layer_of(v.name)] if c is not None}
        by_name = node_layer(n) if layer_of_name(n.name) is not None or not self._reads_scalar_only(n) else None
        if by_name in self.sources and by_cache == {self.sources[by_name]}:
            by_cache = {by_name}  # a reader's attention over its source's cache is the reader's
        if len(by_cache) > 1 or (by_cache and by_name is not None and by_name not in by_cache):
            raise FuselmError(f"node {n.name!r} ({n.op_type}) is named for layer {by_name} but reads or writes the "
                              f"caches of layers {sorted(by_cache)}; split cannot tell which stage it belongs to")
        layer = by_cache.pop() if by_cache else by_name
        if layer is not None and not 0 <= layer < self.n_layers:
            return None  # a name like `layers.99` that is no decoder layer of this graph
        return layer

    @staticmethod
    def _reads_scalar_only(n: ir.Node) -> bool:
        """The node's only weights are scalars: a pass may have shared such a constant under a layer's name (the
        final norm's exponent as `/model/layers.0/...`), which says nothing of the node's layer."""
        weights = [v for v in n.inputs if v is not None and v.is_initializer()]
        return bool(weights) and all(v.const_value is not None and v.const_value.size <= 1 for v in weights)

    @functools.cache  # noqa: B019 - one Graph per split run
    def stage(self, lo: int, hi: int, first: bool, last: bool) -> Stage:
        """The nodes, weights and crossing value of the stage holding layers lo..hi-1."""
        st = Stage(-1, range(lo, hi), first, last)
        own = set(st.layers)
        todo = [i for i, layer in enumerate(self.layer) if layer in own or (last and self.tail[i])]
        st.nodes = set(todo)
        crossing: set[str] = set()
        while todo:
            i = todo.pop()
            n = self.nodes[i]
            for v in n.inputs:
                if v is None:
                    continue
                if v.is_initializer() or (v.const_value is not None and v.producer() is None and
                                          not v.is_graph_input()):
                    st.initializers.add(v.name)
                    continue
                if v.is_graph_input():
                    c = contract.parse_cache(v.name) or contract.parse_state(v.name)
                    if v.name == contract.INPUT_IDS and not first:
                        if n.op_type != "Shape":
                            raise FuselmError(f"node {n.name!r} ({n.op_type}) of layer {self.layer[i]} reads "
                                              f"{contract.INPUT_IDS}; only the first stage has the token ids")
                        st.shape_rewrites[i] = contract.HIDDEN
                    elif c is not None and c.layer not in own:
                        if n.op_type != "Shape":
                            raise FuselmError(f"node {n.name!r} ({n.op_type}) reads {v.name}, a cache of another "
                                              "stage; split cannot place it")
                        first_cache = next((layer for layer in self.cached if layer in own), None)
                        if first_cache is None or contract.is_state_past(v.name):
                            raise FuselmError(f"node {n.name!r} reads the shape of {v.name}, which the stage of layers "
                                              f"{lo}-{hi - 1} does not hold; split cannot place it")
                        st.shape_rewrites[i] = contract.past_name(first_cache, c.kind)
                    continue
                p = self._producer(v)
                if p is None or p in st.nodes:
                    continue
                if not self.act[p] or (first and self.pre[p]):
                    st.nodes.add(p)
                    todo.append(p)
                else:
                    crossing.add(v.name)
        if first and crossing:
            raise FuselmError(f"the first stage reads {sorted(crossing)} from later layers; the graph's layers are "
                              "not in order")
        early = sorted(c for c in crossing if self.pre[self._producer(self._value(c))])
        if not first and early and len(crossing) > 1:
            raise FuselmError(f"layer {lo} reads {', '.join(early[:4])}, computed from the token ids before the first "
                              "layer (per-layer inputs: Gemma 3n / 4), which only the first stage has; a pipeline hands "
                              "one value from each stage to the next, so this model cannot be split")
        if not first and len(crossing) != 1:
            raise FuselmError(f"{len(crossing)} values cross into layer {lo} ({', '.join(sorted(crossing)[:6])}); "
                              "a stage boundary needs exactly one (the residual stream): choose other --layers")
        st.crossing = crossing.pop() if crossing else None
        st.bytes = sum(self.init_bytes.get(name, 0) for name in st.initializers)
        return st

    def apart(self, lo: int, hi: int) -> tuple[int, int] | None:
        """(reader, source) of a layer in lo..hi-1 whose KV source (or the layer whose tensor it is handed) is
        outside it, or None."""
        pairs = sorted({**self.handed, **self.sources}.items())
        return next(((j, i) for j, i in pairs if lo <= j < hi and not lo <= i < hi), None)

    def plan(self, ranges: list[range]) -> list[Stage]:
        for r in ranges:
            if (pair := self.apart(r.start, r.stop)) is not None:
                what = "the keys and values" if pair[0] in self.sources else "a tensor (a top-k selection)"
                raise FuselmError(f"layer {pair[0]} reads {what} of layer {pair[1]}, which the stage of layers "
                                  f"{r.start}-{r.stop - 1} does not hold; a source and its readers go in one stage: "
                                  "choose other --layers")
        stages = [replace(self.stage(r.start, r.stop, k == 0, k == len(ranges) - 1), index=k)
                  for k, r in enumerate(ranges)]
        for prev, st in zip(stages, stages[1:], strict=False):
            if self._producer(self._value(st.crossing)) not in prev.nodes:
                raise FuselmError(f"stage {st.index} reads {st.crossing} from a stage before stage {prev.index}; "
                                  "a pipeline hands one value from each stage to the next: choose other --layers")
        return stages

    def _value(self, name: str) -> ir.Value:
        for n in self.nodes:
            for v in n.outputs:
                if v.name == name:
                    return v
        raise KeyError(name)

    def balanced(self, n_stages: int) -> list[range]:
        """Contiguous layer ranges minimizing the largest stage's weight bytes."""
        L = self.n_layers
        if not 1 <= n_stages <= L:
            raise FuselmError(f"--stages {n_stages}: the graph has {L} layers; choose 1..{L} stages")

        @functools.cache
        def best(start: int, k: int) -> tuple[float, tuple[int, ...]]:
            # the largest stage's bytes and the cut points of layers start..L-1 in k stages (inf: no cut keeps
            # every KV-sharing reader with its source)
            if k == 1:
                return (float("inf") if self.apart(start, L) else self.stage(start, L, start == 0, True).bytes), ()
            out = (float("inf"), ())
            for cut in range(start + 1, L - k + 2):
                if self.apart(start, cut):
                    continue
                here = self.stage(start, cut, start == 0, False).bytes
                rest, cuts = best(cut, k - 1)
                cand = (max(here, rest), (cut, *cuts))
                if cand[0] < out[0]:
                    out = cand
            return out

        cost, found = best(0, n_stages)
        if cost == float("inf"):
            raise FuselmError(f"--stages {n_stages}: no cut into {n_stages} stages keeps every layer that reads another "
                              f"layer's keys and values or tensor (KV sharing: {self.sources}, handed: {self.handed}) with "
                              "that layer; choose fewer stages")
        cuts = (0, *found, L)
        return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


def parse_layers(text: str, n_layers: int) -> list[range]:
    """'0-13,14-27' -> [range(0, 14), range(14, 28)]; the ranges must cover 0..L-1 in order."""
    ranges = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", part)
        if not m:
            raise FuselmError(f"--layers {text!r}: write ranges like 0-13,14-27")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        ranges.append(range(a, b + 1))
    expect = 0
    for r in ranges:
        if r.start != expect or len(r) == 0:
            raise FuselmError(f"--layers {text!r}: the ranges must be non-empty, in order and cover layers "
                              f"0..{n_layers - 1} with no gap or overlap (got {r.start}-{r.stop - 1} after {expect - 1})")
        expect = r.stop
    if expect != n_layers:
        raise FuselmError(f"--layers {text!r} covers layers 0..{expect - 1}; the graph has {n_layers} (0..{n_layers - 1})")
    return ranges


def _nbytes(v: ir.Value) -> int:
    t = v.const_value
    if t is None:
        return 0
    try:
        return int(t.nbytes)
    except Exception:  # noqa: BLE001 - a tensor type without nbytes
        return 0


def build_stage(onnx_path: Path, st: Stage, next_crossing: str | None, width: int) -> ir.Model:
    """A fresh copy of the source graph reduced to the stage's nodes, with its stage inputs and outputs."""
    model = graphio.load(onnx_path)
    g = model.graph
    nodes = list(g)
    values = {v.name: v for n in nodes for v in n.outputs}
    inputs = {v.name: v for v in g.inputs}
    own = set(st.layers)
    new_inputs = []
    if st.first:
        new_inputs.append(inputs[contract.INPUT_IDS])
    else:
        old = values[st.crossing]
        hidden = ir.Value(name=contract.HIDDEN, type=ir.TensorType(_hidden_dtype(g)),
                          shape=ir.Shape([*inputs[contract.INPUT_IDS].shape, width]))
        index = {n: i for i, n in enumerate(nodes)}
        for use in list(old.uses()):
            if index[use.node] in st.nodes:
                use.node.replace_input_with(use.idx, hidden)
        new_inputs.append(hidden)
    for i, target in st.shape_rewrites.items():
        node = nodes[i]
        if target == contract.HIDDEN:  # Shape(input_ids) -> the [batch, sequence] dims of the hidden state
            s, e = attr(node, "start", 0), attr(node, "end", 2)
            s, e = (s + 2 if s < 0 else s), (e + 2 if e < 0 else min(e, 2))
            node.replace_input_with(0, hidden)
            node.attributes["start"] = ir.AttrInt64("start", s)
            node.attributes["end"] = ir.AttrInt64("end", e)
        else:  # Shape of another stage's cache -> of this stage's first (one shape for every layer)
            node.replace_input_with(0, inputs[target])
    new_inputs += [inputs[contract.ATTENTION_MASK], inputs[contract.POSITION_IDS]]
    new_inputs += sorted((v for v in g.inputs if contract.is_step_past(v.name) and contract.layer_of(v.name) in own),
                         key=lambda v: contract.step_order(v.name))
    outputs = {v.name: v for v in g.outputs}
    if st.last:
        head = outputs[contract.LOGITS]
    else:
        head = values[next_crossing]
        head.name = contract.NEXT_HIDDEN
        if head.type is None:
            head.type = ir.TensorType(_hidden_dtype(g))
            head.shape = ir.Shape([*inputs[contract.INPUT_IDS].shape, width])
    presents = sorted((v for v in g.outputs if contract.is_step_present(v.name) and contract.layer_of(v.name) in own),
                      key=lambda v: contract.step_order(v.name))
    g.outputs.clear()
    g.outputs.extend([head, *presents])
    g.inputs.clear()
    g.inputs.extend(new_inputs)
    for i in reversed(range(len(nodes))):
        if i not in st.nodes:
            g.remove(nodes[i], safe=True)
    for name in list(g.initializers):
        if name not in st.initializers:
            del g.initializers[name]
    for name, fn in list(model.functions.items()):
        if not any(n.domain == fn.domain and n.op_type == fn.name for n in g):
            del model.functions[name]
    attach_functions(model)  # a stage's fuselm functions in the form its own nodes use
    return model


def _hidden_dtype(g: ir.Graph) -> ir.DataType:
    """The activations' type: the contract writes the caches in the compute type."""
    past = next((v for v in g.inputs if contract.is_past(v.name)), None) or \
        next(v for v in g.inputs if contract.is_step_past(v.name))
    return past.dtype


def hidden_size(src: Graph, meta: dict | None) -> int:
    """The residual width: fuselm.json's dims.hidden, else the final norm's weight (a rank-1 weight of the tail)."""
    hidden = ((meta or {}).get("dims") or {}).get("hidden")
    if hidden:
        return int(hidden)
    for i, n in enumerate(src.nodes):
        if src.tail[i]:
            for w in n.inputs:
                if w is not None and w.is_initializer() and w.const_value is not None and len(w.const_value.shape) == 1:
                    return int(w.const_value.shape[0])
    raise FuselmError("cannot tell the hidden size (no dims.hidden in fuselm.json, no final norm weight); split a "
                      "model directory written by `fuselm convert` or `fuselm optimize`")


def split(in_path, out, stages: int | None = None, layers: str | None = None, force: bool = False,
          quiet: bool = False) -> dict:
    """Write OUT/stage0..stageN-1 (model directories) and OUT/split.json; returns the report."""
    if (stages is None) == (layers is None):
        raise FuselmError("pass --stages N or --layers 0-13,14-27 (one of them)")
    onnx_path, meta = graphio.resolve(in_path)
    src = Graph(graphio.load(onnx_path))
    ranges = parse_layers(layers, src.n_layers) if layers is not None else src.balanced(int(stages))
    plan = src.plan(ranges)
    width = hidden_size(src, meta)
    total = sum(src.init_bytes.values())
    report = {"source": str(in_path), "layers": src.n_layers, "source_bytes": total,
              "hidden": contract.HIDDEN, "next_hidden": contract.NEXT_HIDDEN, "stages": []}
    out = Path(out)
    with atomic_output_dir(out, force=force) as tmp:
        for k, st in enumerate(plan):
            nxt = plan[k + 1].crossing if k + 1 < len(plan) else None
            model = build_stage(onnx_path, st, nxt, width)
            d = tmp / f"stage{k}"
            d.mkdir()
            graphio.save_checked(model, d, f"stage {k}",
                                 f"the cut at layer {st.layers.start} is not clean: choose other --layers")
            info = {"stage": k, "of": len(plan), "layers": [st.layers.start, st.layers.stop - 1],
                    "bytes": st.bytes, "first": st.first, "last": st.last, "hidden": width,
                    "input": contract.INPUT_IDS if st.first else contract.HIDDEN,
                    "output": contract.LOGITS if st.last else contract.NEXT_HIDDEN,
                    "cut_value": st.crossing, "nodes": len(st.nodes)}
            stage_meta = {k2: v for k2, v in (meta or {}).items() if k2 != "schema_version"}
            stage_meta["pipeline"] = info
            write_meta(d, stage_meta)
            (d / GENAI_NAME).unlink(missing_ok=True)  # onnxruntime-genai cannot run one stage
            if Path(in_path).is_dir():
                copy_tokenizer_files(in_path, d)
            report["stages"].append(info)
        (tmp / SPLIT_NAME).write_text(json.dumps(report, indent=2) + "\n")
        # a fuselm.json at the top (no model.onnx: no genai_config) marks OUT as fuselm's, for --force and run
        write_meta(tmp, {"stage": "split", "pipeline": {"of": len(plan)}, "dims": (meta or {}).get("dims", {})})
    if not quiet:
        print(format_report(report, out))
    return report


def format_report(report: dict, out) -> str:
    lines = [f"fuselm split: {report['source']} -> {out} ({report['layers']} layers, "
             f"{report['source_bytes'] / 2**20:.2f} MiB of weights)"]
    for s in report["stages"]:
        role = " + ".join(r for r, on in (("embedding", s["first"]), ("norm + head", s["last"])) if on)
        lines.append(f"  stage{s['stage']}: layers {s['layers'][0]}-{s['layers'][1]}"
                     f"{' + ' + role if role else ''}: {s['bytes'] / 2**20:.2f} MiB, {s['nodes']} nodes, "
                     f"{s['input']} -> {s['output']}")
    return "\n".join(lines)
