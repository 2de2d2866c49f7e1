"""LastRows: the lm_head computes only the rows the run reads."""

from __future__ import annotations

from fuselm.passes.stats import Stats

from fuselm import contract

from ..graph import Graph, Node
from ..ops_nn import RUNTIME
from .base import Load, Rewrite

# elementwise ops after the head that keep its rows: soft-capping, scaling, a bias, a cast
LOGIT_TAIL = {"Mul", "Div", "Add", "Sub", "Tanh", "Cast", "Identity"}


class LastRows(Rewrite):
    """head(x) [-> tail] -> logits  becomes  head(LastRows(x)) [-> tail] -> logits: the head's input cut to the
    last rows the run asks for (ctx["logit_rows"]: 1 for a prompt chunk of a generation, k + 1 for a speculative
    verification step, None for all: a scorer). The same cut as passes/ LastPositionLogits, but per run: the
    graph still scores a whole text when asked.

    The head is the MatMul / QMatMul reached from `logits` through at most six LOGIT_TAIL ops that each read one
    value that is not a constant. Must not fire: no `logits` output, another op on that walk, or a head whose
    activation is a constant."""

    aliases = ("last-rows",)

    def apply(self, graph: Graph, load: Load, stats: Stats) -> bool:
        if contract.LOGITS not in graph.outputs:
            stats.skip("logits", "the graph has no logits output (a pipeline stage)")
            return False
        producers = {o: n for n in graph.nodes for o in n.outputs}
        n = producers.get(contract.LOGITS)
        for _ in range(6):
            if n is None:
                break
            if n.key in (("", "MatMul"), (RUNTIME, "QMatMul")):
                x = n.inputs[0]
                if not x or x in graph.constants:
                    break
                last = x + "/last_rows"
                graph.nodes.insert(graph.nodes.index(n), Node("LastRows", RUNTIME, n.name + "/LastRows", [x], [last]))
                n.inputs = [last, *n.inputs[1:]]
                stats.fire(n.name)
                return True
            live = [x for x in n.inputs if x and x not in graph.constants]
            if n.domain or n.op_type not in LOGIT_TAIL or len(live) != 1:
                stats.skip(n.name, f"logits come from {n.op_type}, not from the head's matmul through an "
                                   "elementwise tail")
                return False
            n = producers.get(live[0])
        stats.skip("logits", "no head matmul within six ops of the logits")
        return False
