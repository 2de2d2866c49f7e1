"""What every runtime rewrite shares: the Rewrite base class and what a load gives it.

A rewrite is to the runtime what a pass is to the portable graph (passes/): one class per file, its docstring
says what it rewrites and where it must not fire, and calling it returns (graph, modified, stats). Rewrites run
on the executor's graph (runtime_metal/graph.py) once, at load; `fuselm diff --target mlx` (or torch, numpy)
walks them after the passes, with each one's drift, and `--skip` turns any of them off.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fuselm.passes.stats import Stats

from ..graph import Graph


@dataclass
class Load:
    """What a rewrite may read about the load: the backend the graph will run on, whether fused kernels are on,
    fuselm.json, the model's path (the prepared-weight store is keyed by it) and how to give mapped pages back."""

    backend: object
    fused: bool = True
    meta: dict = field(default_factory=dict)
    path: Path | None = None
    release: object = lambda: None


class Rewrite:
    """Base class: subclasses implement `apply(graph, load, stats) -> modified`."""

    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, graph: Graph, load: Load) -> tuple[Graph, bool, Stats]:
        stats = Stats()
        modified = self.apply(graph, load, stats)
        return graph, modified, stats

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        raise NotImplementedError
