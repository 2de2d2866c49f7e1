"""KVAppend: the cache's Concat becomes an append into the preallocated buffer."""

from __future__ import annotations

from fuselm.passes.stats import Stats

from fuselm import contract

from ..graph import Graph, Node
from ..ops_nn import RUNTIME
from .base import Load, Rewrite


class KVAppend(Rewrite):
    """Concat(past_key_values.i.*, new, axis 2) -> KVAppend(past, new): the same present, written into the
    session's preallocated cache buffer (runtime_metal/kvcache.py) instead of a new tensor each step.

    Must not fire: a Concat of two inputs whose first is not a past input of the graph, or along another axis.
    Without it (skipped, or a graph that reads its cache otherwise) the cache is the graph's presents, fed back."""

    aliases = ("kv-append",)

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        pasts = {x for x in graph.inputs if contract.is_past(x)}
        for i, n in enumerate(graph.nodes):
            if n.key != ("", "Concat") or not n.inputs or n.inputs[0] not in pasts:
                continue
            if len(n.inputs) != 2 or n.attrs.get("axis") not in (2, -2):
                stats.skip(n.name, "not a Concat of the past and one new tensor along the sequence axis (2)")
                continue
            graph.nodes[i] = Node("KVAppend", RUNTIME, n.name, list(n.inputs), list(n.outputs))
            stats.fire(n.name)
        return bool(stats.fired)
