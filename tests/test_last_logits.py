"""passes/last_logits.py: the head on the last position only (auto's prepared copy, which only generates)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuselm.passes import graphio
from fuselm.passes.last_logits import LastPositionLogits
from fuselm.runtime_metal.engines.ort import OrtEngine

import fuselm
from fuselm.options import Options

pytest.importorskip("onnxruntime")


def _logits_dims(model_dir):
    g = onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph
    out = next(o for o in g.output if o.name == "logits")
    return [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim], g


@pytest.mark.parametrize("target", [None, "onnxruntime"])
def test_last_position_logits_are_the_full_graphs_last_row(exported, tmp_path, target):
    """The same tokens and, at every step, the same logits as the graph computing every position; the prompt's
    other positions are gone ([batch, logits_to_keep, vocab], 1 unless fed); run twice it fires once; fed
    logits_to_keep = 3, the last three rows equal the full graph's (a speculative verification step's)."""
    src = exported("qwen3", "q4")
    full = fuselm.optimize(src, tmp_path / "full", target=target, quiet=True)
    last = fuselm.optimize(src, tmp_path / "last", target=target, last_logits=True, quiet=True)
    dims, g = _logits_dims(last)
    assert dims[1] == "logits_rows" and _logits_dims(full)[0][1] != "logits_rows"
    assert sum(n.op_type == "Slice" and n.name.endswith("LastPosition") for n in g.node) == 1
    assert [i.name for i in g.input if i.name == "logits_to_keep"] and "logits_to_keep" in {t.name for t in g.initializer}
    _, modified, stats = LastPositionLogits()(graphio.load(last / "model.onnx"))
    assert not modified and "last positions already" in stats.skipped[0][1]
    got = {}
    for name, d in (("full", full), ("last", last)):
        trace = OrtEngine(d, d, Options(threads=1), loop="ort").trace([5, 9, 2, 7, 11, 3], 6)
        got[name] = trace.tokens, np.stack(trace.logits)
    assert got["last"][0] == got["full"][0]
    np.testing.assert_allclose(got["last"][1], got["full"][1], rtol=0, atol=1e-5)
    rows = {}
    for name, d in (("full", full), ("last", last)):
        engine = OrtEngine(d, d, Options(threads=1), loop="ort")
        engine.reset(16)
        rows[name] = engine.forward([5, 9, 2, 7, 11, 3], rows=3)
    assert rows["last"].shape == rows["full"].shape == (3, rows["full"].shape[1])
    np.testing.assert_allclose(rows["last"], rows["full"], rtol=0, atol=1e-5)


def test_last_position_logits_must_not_fire_past_a_tail(tmp_path):
    """logits written by something after the head (a softcap's Tanh, a Cast) are not the head's: skipped, said why."""
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 8], np.ones(32, np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="lm_head"), helper.make_node("Tanh", ["h"], ["logits"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 8])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), str(path))
    model, modified, stats = LastPositionLogits()(graphio.load(path))
    assert not modified and "not by the head" in stats.skipped[0][1]
