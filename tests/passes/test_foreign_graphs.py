"""Graphs other exporters wrote never crash a pass.

optimum-onnx's export (its own environment: it needs transformers < 4.58, scripts/setup.sh makes
.venv-optimum) optimizes with every fusion that applies and unchanged outputs; a pass that fails or
would leave a cycle is undone and recorded as a skip with its reason, the pipeline goes on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from fuselm.passes.base import Fusion, Pass, Stats, new_node, take_over
from fuselm.passes.pipeline import _run_one
from onnx import TensorProto
from onnx import helper as oh

import fuselm
from fuselm.reference import ort_session

ROOT = Path(__file__).resolve().parents[2]
OPTIMUM_PY = ROOT / ".venv-optimum" / "bin" / "python"


@pytest.fixture(scope="module")
def optimum_graph(tmp_path_factory) -> Path:
    if not OPTIMUM_PY.exists():
        pytest.skip("no .venv-optimum (scripts/setup.sh makes it: optimum-onnx needs transformers < 4.58)")
    out = tmp_path_factory.mktemp("optimum")
    subprocess.run([str(OPTIMUM_PY), str(Path(__file__).with_name("optimum_export.py")), str(out)], check=True,
                   capture_output=True, text=True, timeout=600)
    return out / "onnx" / "model.onnx"


def test_optimum_graph_optimizes_with_every_fusion(optimum_graph, tmp_path):
    data = fuselm.diff(optimum_graph, json_path=tmp_path / "diff.json", quiet=True)
    by_pass = {r["pass"]: r for r in data["passes"]}
    for name in ("FuseRMSNorm", "FuseAttention", "FuseRoPE", "FuseQKV", "FuseGateUp"):
        assert by_pass[name]["fired"] >= 2, (name, by_pass[name].get("skipped"))
    for r in data["passes"]:
        for step in (r.get("drift") or {}).values():
            assert step["logits_rel"] < 1e-5, (r["pass"], step)
    out = fuselm.optimize(optimum_graph, tmp_path / "opt", quiet=True)
    ops = [n.op_type for n in ir.load(out / "model.onnx").graph]
    assert ops.count("Attention") == 2 and ops.count("FusedRoPE") == 4 and "Softmax" not in ops


def _two_relus() -> ir.Model:
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    nodes = [oh.make_node("Relu", ["x"], ["a"], name="good"), oh.make_node("Relu", ["a"], ["b"], name="bad"),
             oh.make_node("Neg", ["b"], ["y"], name="tail")]
    return ir.serde.deserialize_model(oh.make_model(oh.make_graph(nodes, "g", [x], [y]),
                                                    opset_imports=[oh.make_opsetid("", 23)]))


class _ReluToAbs(Fusion):
    """Relu -> Abs; at the node named 'bad' the rewrite reads its own output (a cycle)."""

    needs_opset = None

    def anchors(self, graph):
        return [n for n in graph if n.op_type == "Relu"]

    def match(self, anchor):
        return anchor

    def rewrite(self, graph, relu):
        src = relu.outputs[0] if relu.name == "bad" else relu.inputs[0]
        node = new_node(graph, "Abs", [src], f"{relu.name}/Abs")
        graph.insert_before(relu, node)
        take_over(relu.outputs[0], node.outputs[0])
        return relu.name


class _Crashes(Pass):
    """Raises halfway through, after changing the graph."""

    def apply(self, model, stats: Stats) -> bool:
        next(iter(model.graph)).name = "renamed"
        raise RuntimeError("an internal error")


def test_a_rewrite_that_would_leave_a_cycle_is_undone_and_the_others_kept():
    model, records = _two_relus(), []
    _run_one(_ReluToAbs(), model, set(), records, None)
    ops = {n.name: n.op_type for n in model.graph}
    assert records[0]["fired_at"] == ["good"] and ops["good/Abs"] == "Abs" and ops["bad"] == "Relu"
    assert records[0]["skipped"][0]["at"] == "bad" and "cycle" in records[0]["skipped"][0]["reason"]
    ort_out = ort_session(ir.serde.serialize_model(model)).run(None, {"x": np.array([-1.0, 2.0],
                                                                                                    np.float32)})
    np.testing.assert_array_equal(ort_out[0], [-1.0, -2.0])


def test_a_pass_that_crashes_is_undone_and_recorded():
    model, records = _two_relus(), []
    _run_one(_Crashes(), model, set(), records, None)
    assert [n.name for n in model.graph] == ["good", "bad", "tail"] and records[0]["changed"] is False
    assert "RuntimeError: an internal error" in records[0]["skipped"][0]["reason"]
