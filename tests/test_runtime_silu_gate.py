"""runtime_metal/silu_gate.py: a gated MLP's Sigmoid/Mul/Mul as one SiLUGate op, checked on tiny in-code graphs
against numpy, with the cases where it must not fire, and on a tiny qwen3 (one per layer, same logits as the
three ops)."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.runtime_metal import silu_gate
from fuselm.runtime_metal.backends.numpy_backend import NumpyBackend
from fuselm.runtime_metal.executor import Executor
from fuselm.runtime_metal.graph import Graph, Node
from fuselm.runtime_metal.session import Session


def _graph(extra_reader: bool = False, swap: bool = False) -> Graph:
    nodes = [Node("Sigmoid", "", "sig", ["g"], ["s"]),
             Node("Mul", "", "act", ["s", "g"] if swap else ["g", "s"], ["a"]),
             Node("Mul", "", "gate", ["u", "a"] if swap else ["a", "u"], ["y"])]
    outputs = ["y"]
    if extra_reader:
        nodes.append(Node("Neg", "", "other", ["s"], ["z"]))
        outputs.append("z")
    return Graph(nodes, {}, ["g", "u"], outputs, {"": 23}, {})


@pytest.mark.parametrize("swap", [False, True])
def test_fires_and_computes_silu_times_up(swap):
    g = _graph(swap=swap)
    silu_gate.rewrite(g)
    assert [n.op_type for n in g.nodes] == ["SiLUGate"]
    rng = np.random.default_rng(0)
    x, u = rng.standard_normal((2, 3, 8)).astype(np.float32), rng.standard_normal((2, 3, 8)).astype(np.float32)
    want = x / (1 + np.exp(-x)) * u
    got = Executor(g, NumpyBackend()).run({"g": x, "u": u})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    mx = pytest.importorskip("mlx.core")
    from fuselm.runtime_metal.backends.mlx_backend import MLXBackend

    np.testing.assert_allclose(np.array(MLXBackend().silu_gate(mx.array(x), mx.array(u))), want, rtol=1e-5, atol=1e-6)


def test_does_not_fire_when_an_intermediate_is_read_elsewhere():
    g = _graph(extra_reader=True)
    silu_gate.rewrite(g)
    assert "SiLUGate" not in [n.op_type for n in g.nodes]
    g = _graph()
    g.outputs.append("a")  # the SiLU itself is a graph output
    silu_gate.rewrite(g)
    assert "SiLUGate" not in [n.op_type for n in g.nodes]


def test_one_per_layer_and_the_same_logits(optimized):
    model = optimized("qwen3")
    fused = Session(model, backend="numpy")
    assert sum(n.op_type == "SiLUGate" for n in fused.graph.nodes) == fused.meta["dims"]["layers"]
    plain = Session(model, backend="numpy", fused=False)
    assert "SiLUGate" not in [n.op_type for n in plain.graph.nodes]
    ids = [3, 1, 4, 1, 5]
    for s in (fused, plain):
        s.reset(8)
    np.testing.assert_allclose(fused.logits_to_numpy(fused.prefill(ids)), plain.logits_to_numpy(plain.prefill(ids)),
                               rtol=1e-4, atol=1e-4)
