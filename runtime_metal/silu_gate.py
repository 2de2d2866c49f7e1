"""Load-time rewrite: a gated MLP's SiLU gate as one backend op (MLX: one compiled kernel, as mlx-lm's swiglu).

Pattern (the exporter's SiLU, passes/fuse_gate_up.py leaves it after the gate/up Split):
    s = Sigmoid(gate);  a = Mul(gate, s) (either order);  y = Mul(a, up) (either order)
becomes
    y = SiLUGate(gate, up)
A compiled decode piece fuses the three ops anyway; a prompt chunk runs them eagerly, and then each of s and
a is its own [S, intermediate] array, held on a GPU until its command buffer completes: the prefill's peak
memory (mlx-lm computes the gate in one compiled kernel). Backends without a kernel of their own run the same
three ops (`Backend.silu_gate`).

Must not fire: s or a read by any other node or a graph output, a Sigmoid that is not the plain op, the
two Muls not in this shape (a Mul of gate and s, whose result is multiplied by one other value).
"""

from __future__ import annotations

from .graph import Graph, Node
from .ops import op
from .ops_nn import RUNTIME


@op("SiLUGate", domain=RUNTIME)
def SiLUGate(b, gate, up):
    return b.silu_gate(gate, up)


def rewrite(graph: Graph) -> None:
    """Apply the pattern wherever it matches (see the module docstring)."""
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for x in n.inputs:
            readers.setdefault(x, []).append(n)
    drop: set[int] = set()
    replace: dict[int, Node] = {}
    for sig in graph.nodes:
        if sig.key != ("", "Sigmoid") or len(sig.inputs) != 1:
            continue
        gate, s = sig.inputs[0], sig.outputs[0]
        act = readers.get(s, [])
        if len(act) != 1 or act[0].key != ("", "Mul") or sorted(act[0].inputs) != sorted([gate, s]) or \
                s in graph.outputs:
            continue
        a = act[0].outputs[0]
        mul = readers.get(a, [])
        if len(mul) != 1 or mul[0].key != ("", "Mul") or a in graph.outputs or len(mul[0].inputs) != 2 or \
                mul[0].inputs[0] == mul[0].inputs[1]:
            continue
        up = mul[0].inputs[1 - mul[0].inputs.index(a)]
        drop.update((id(sig), id(act[0])))
        replace[id(mul[0])] = Node("SiLUGate", RUNTIME, mul[0].name, [gate, up], list(mul[0].outputs))
    graph.nodes = [replace.get(id(n), n) for n in graph.nodes if id(n) not in drop]
