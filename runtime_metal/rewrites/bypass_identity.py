"""BypassIdentity: readers of Identity(x) read x."""

from __future__ import annotations

from fuselm.passes.stats import Stats

from ..graph import Branch, Graph
from .base import Load, Rewrite


class BypassIdentity(Rewrite):
    """Identity(x) -> y: every reader of y reads x, and the Identity goes (other exporters put one between a past
    input and its Concat, which would hide the cache append from KVAppend).

    Must not fire: an Identity whose output is a graph output (the name must stay), or one with no input."""

    aliases = ("identity",)

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        alias: dict[str, str] = {}
        kept = []
        for n in graph.nodes:
            n.inputs = [alias.get(x, x) for x in n.inputs]
            if n.key == ("", "Identity") and n.outputs[0] not in graph.outputs and n.inputs[0]:
                alias[n.outputs[0]] = n.inputs[0]
                stats.fire(n.name)
            else:
                if n.key == ("", "Identity"):
                    stats.skip(n.name, "its output is a graph output" if n.inputs[0] else "it has no input")
                kept.append(n)
        for n in kept:
            for br in n.branches.values():
                _rename_inputs(br, alias)
        graph.nodes = kept
        return bool(alias)


def _rename_inputs(branch: Branch, alias: dict[str, str]) -> None:
    for n in branch.nodes:
        n.inputs = [alias.get(x, x) for x in n.inputs]
        for br in n.branches.values():
            _rename_inputs(br, alias)
    branch.outputs = [alias.get(x, x) for x in branch.outputs]
