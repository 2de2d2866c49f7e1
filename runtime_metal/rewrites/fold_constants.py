"""FoldConstants: nodes whose inputs are all constants are computed once, on the host."""

from __future__ import annotations

import numpy as np
from fuselm.passes.stats import Stats

from fuselm.errors import FuselmError

from ..backends.numpy_backend import NumpyBackend
from ..graph import Graph, call, values
from ..ops import OPS
from ..ops_nn import RUNTIME
from .base import Load, Rewrite


class FoldConstants(Rewrite):
    """A node whose every input is a constant (an initializer, or a value folded before it) is run once with the
    host backend (numpy) and its outputs become constants: an exported graph's shape arithmetic, a dequantized
    constant nobody folded into a quantized matmul. (passes/ RemoveDeadShapeOp folds the same in the portable
    graph; this covers graphs the passes have not seen.)

    Must not fire: fused ops and ops that read the run's context (their kernels are the point), runtime ops,
    ops with subgraphs, an op the host backend does not implement (kept, and said why)."""

    aliases = ("fold-constants",)

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        host = NumpyBackend()
        consts, kept = graph.constants, []
        for n in graph.nodes:
            spec = OPS.get(n.key)
            if spec is None or n.branches or n.domain == RUNTIME or spec.fused or spec.wants_context or \
                    not all((x in consts) for x in n.inputs if x):
                kept.append(n)
                continue
            try:
                out = call(spec, host, n, [values(consts[x]) if x else None for x in n.inputs])
            except NotImplementedError:
                stats.skip(n.name, f"the host backend has no {n.op_type}")
                kept.append(n)
                continue
            except FuselmError:
                raise
            except Exception as e:  # attributes the checker lets through (an axis out of range) fail here
                raise FuselmError(f"node {n.name!r} ({n.op_type}) fails on its constant inputs ({type(e).__name__}: "
                                  f"{str(e)[:300]}); the graph is invalid, or uses the op in a form the runtime does "
                                  "not support") from e
            for name, v in zip(n.outputs, out, strict=False):
                if name:
                    consts[name] = np.asarray(v)
            stats.counts[n.op_type] += 1
            stats.fire(n.name)
        graph.nodes = kept
        return bool(stats.fired)
