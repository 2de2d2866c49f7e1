"""The runtime's load-time rewrites: a literal list, run once per load (`prepare`) and walked by `fuselm diff
--target mlx` (torch, numpy) with each one's drift (`stages`).

Order matters: identities go first (they hide the cache's Concat), quantized weights are folded before the head is
cut (LastRows looks for QMatMul) and before constants are folded (a folded DequantizeLinear would be a float copy),
the mask classification last (it reads the graph as the executor will run it).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import replace

import numpy as np

from fuselm.errors import FuselmError

from ..graph import Graph, from_model, unpack_or_drop_packed, values
from .base import Load, Rewrite
from .bypass_identity import BypassIdentity
from .causal_masks import CausalMasks
from .fold_constants import FoldConstants
from .kv_append import KVAppend
from .last_rows import LastRows
from .qkv_heads import QKVHeads
from .quantized_weights import FoldQuantizedWeights

REWRITES: list[Rewrite] = [
    BypassIdentity(),
    FoldQuantizedWeights(),
    KVAppend(),
    FoldConstants(),
    LastRows(),
    QKVHeads(),
    CausalMasks(),
]


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def resolve_skip(skip) -> set[str]:
    """Class names of the rewrites named in `skip` (class names or their aliases, any case, - or _); names that
    are no rewrite are left to the caller (they may be passes)."""
    table = {_key(alias): r.name for r in REWRITES for alias in (r.name, *r.aliases)}
    return {table[_key(s)] for s in skip or () if _key(s) in table}


def check_skip(skip) -> set[str]:
    """resolve_skip, refusing a name that is no rewrite."""
    chosen = resolve_skip(skip)
    names = {_key(a) for r in REWRITES for a in (r.name, *r.aliases)}
    for s in skip or ():
        if _key(s) not in names:
            valid = ", ".join(f"{r.name} ({r.aliases[0]})" for r in REWRITES)
            raise FuselmError(f"--skip {s!r}: no such runtime rewrite; valid rewrites: {valid}")
    return chosen


def run(graph: Graph, load: Load, skip: set[str] = frozenset(), on_rewrite=None) -> list[dict]:
    """Apply every rewrite not in `skip` in order; one record per rewrite (as passes/pipeline.py's), and
    `on_rewrite(record, graph)` after each that ran."""
    records = []
    for r in REWRITES:
        doc = (type(r).__doc__ or "").strip().split("\n\n")[0]
        record = {"pass": r.name, "doc": " ".join(line.strip() for line in doc.splitlines()), "runtime": True}
        if r.name in skip:
            record.update(skipped_by_user=True, changed=False)
        else:
            before = Counter(n.op_type for n in graph.nodes)
            t0 = time.perf_counter()
            _, changed, stats = r(graph, load)
            after = Counter(n.op_type for n in graph.nodes)
            record.update(skipped_by_user=False, changed=changed, seconds=time.perf_counter() - t0,
                          nodes_before=sum(before.values()), nodes_after=sum(after.values()),
                          ops_before=dict(sorted(before.items())), ops_after=dict(sorted(after.items())),
                          **stats.as_dict())
        if isinstance(r, FoldQuantizedWeights):  # what the folds left: unread constants dropped, 4-bit ones unpacked
            unpack_or_drop_packed(graph)
            load.release()
        records.append(record)
        if on_rewrite is not None and not record["skipped_by_user"]:
            on_rewrite(record, graph)
    return records


def prepare(lm, backend, fused: bool = True, skip=()) -> Graph:
    """The executor's graph of a loaded model on `backend`: converted (runtime_metal/graph.py), then rewritten by
    REWRITES (but those in `skip`); the records are kept in `graph.rewrites`."""
    graph = from_model(lm, fused)
    load = Load(backend, fused, lm.meta or {}, lm.path, lm.release_pages)
    graph.rewrites = run(graph, load, check_skip(skip))
    return graph


def split_skip(skip) -> tuple[set[str], list[str]]:
    """(the rewrites `skip` names, the other names in it: passes)."""
    table = {_key(alias) for r in REWRITES for alias in (r.name, *r.aliases)}
    return resolve_skip(skip), [s for s in skip or () if _key(s) not in table]


def stages(path, outputs: dict | None, backend: str, skip=()) -> list[dict]:
    """`fuselm diff --target BACKEND`: the graph at `path` (the passes' last stage) on a runtime_metal backend
    (f32, the host's device), first with no rewrite, then after each rewrite, run on the feeds of `outputs`
    (passes/check.py run_steps: a prefill and a decode step with past) with the drift of each stage from the one
    before (the first: from onnxruntime's run in `outputs`); one record per stage as passes/pipeline.py's."""
    from fuselm.passes import check

    from ..backends import make_backend
    from ..executor import Executor
    from ..loader import load as load_model

    lm = load_model(path)
    b = make_backend(backend, None, dtype="f32")
    graph = from_model(lm, fused=True)
    load = Load(b, True, lm.meta or {}, None, lm.release_pages)
    state = {"outputs": outputs}

    def measure(record: dict, g: Graph) -> None:
        if state["outputs"] is None:
            record["drift"] = {"error": "no numeric check (the graph's inputs are outside the contract)"}
            return
        t0 = time.perf_counter()
        ex = Executor(g, b)
        ex.ctx["logit_rows"] = None
        got = {}
        try:
            for step, ran in state["outputs"].items():
                out = ex.run({k: b.asarray(v) for k, v in ran["feeds"].items()})
                got[step] = {"feeds": ran["feeds"], "outputs": {n: np.asarray(b.to_numpy(out[n])) for n in g.outputs}}
            record["drift"] = check.drift(state["outputs"], got)
            state["outputs"] = got
        except Exception as e:  # noqa: BLE001 - reported on the stage that broke, as the passes' are
            record["drift"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        record["check_seconds"] = time.perf_counter() - t0

    ops = Counter(n.op_type for n in graph.nodes)
    first = {"pass": f"Runtime({b.name})", "runtime": True, "changed": True, "skipped_by_user": False,
             "doc": f"the graph as fuselm's {b.name} backend runs it, before any rewrite (functions it has no "
                    "kernel for inlined); drift from onnxruntime on the same graph",
             "nodes_before": sum(ops.values()), "nodes_after": sum(ops.values()), "ops_before": dict(sorted(ops.items())),
             "ops_after": dict(sorted(ops.items())), "fired": 0, "fired_at": [], "skipped": [], "counts": {},
             "seconds": 0.0, "checker": "n/a (the runtime's graph)"}
    measure(first, replace(graph, constants={k: values(v) for k, v in graph.constants.items()}))  # 4-bit unpacked

    def after(record: dict, g: Graph) -> None:
        record["checker"] = "n/a (the runtime's graph)"
        if record["changed"]:
            measure(record, g)
        else:
            record["drift"] = None

    return [first, *run(graph, load, check_skip(skip), after)]
