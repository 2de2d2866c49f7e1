"""UpgradeOpset: graphs at opset 14-22 are converted to 23 before the fusions; numbers unchanged."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from fuselm.passes.check import drift, run_steps
from fuselm.passes.upgrade_opset import UpgradeOpset
from onnx import TensorProto
from onnx import helper as oh
from passes_helpers import G, apply, assert_same

import fuselm
from fuselm.errors import FuselmError


def _rms_norm_at(opset: int) -> onnx.ModelProto:
    """A hand-written RMSNorm as opset-14 exporters write it: ReduceMean's axes as an attribute."""
    g = G()
    x = g.inp("x", [2, 3, 8])
    sq = g.node("Mul", [x, x])
    if opset < 18:
        mean = g.node("ReduceMean", [sq], axes=[-1], keepdims=1)
    else:
        mean = g.node("ReduceMean", [sq, g.init("axes", np.array([-1], np.int64))], keepdims=1)
    add = g.node("Add", [mean, g.init("eps", np.array(1e-6, np.float32))])
    inv = g.node("Reciprocal", [g.node("Sqrt", [add])])
    y = g.node("Mul", [g.node("Mul", [x, inv]), g.weight("w", [8])])
    g.out(y, "y")
    m = g.model()
    m.opset_import[0].version = opset
    return m


@pytest.mark.parametrize("opset", [14, 17, 18, 20, 22])
def test_upgrade_then_rms_norm_fires(opset):
    from fuselm.passes.fuse_rms_norm import FuseRMSNorm

    m = _rms_norm_at(opset)
    up, modified, stats = apply(UpgradeOpset(), m)
    assert modified and up.opset_import[0].version == 23
    assert stats.fired == [f"default-domain opset {opset} -> 23"] and stats.counts["opset_from"] == opset
    mean = next(n for n in up.graph.node if n.op_type == "ReduceMean")
    assert len(mean.input) == 2 and not any(a.name == "axes" for a in mean.attribute)  # the 18 signature
    assert_same(m, up, G().feeds | {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)})
    fused, modified, _ = apply(FuseRMSNorm(), up)
    assert modified and [n.op_type for n in fused.graph.node] == ["RMSNormalization", "Identity"]


def test_upgrade_does_not_fire_at_23():
    _, modified, stats = apply(UpgradeOpset(), _rms_norm_at(23))
    assert not modified and not stats.fired


@pytest.mark.parametrize("opset", [13, 24])
def test_upgrade_refuses_opsets_outside_14_23(opset):
    with pytest.raises(FuselmError, match=rf"opset {opset}; fuselm reads opsets 14\.\.23"):
        apply(UpgradeOpset(), _rms_norm_at(opset))


def test_a_node_the_converter_refuses_is_named(monkeypatch):
    """onnx's converter answers a bare RuntimeError; the message names the node and its op (found by
    converting one node at a time)."""
    real = onnx.version_converter.convert_version

    def refuse_reciprocal(model, target):
        if any(n.op_type == "Reciprocal" for n in model.graph.node):
            raise RuntimeError("convert.cc: no adapter")
        return real(model, target)

    monkeypatch.setattr(onnx.version_converter, "convert_version", refuse_reciprocal)
    with pytest.raises(FuselmError, match=r"cannot upgrade node 'n5_Reciprocal' \(Reciprocal\) from opset 17 to 23"):
        apply(UpgradeOpset(), _rms_norm_at(17))


@pytest.mark.slow
@pytest.mark.parametrize("kind,opset,attn,onnxscript_optimize", [
    ("torchscript", None, "eager", False),  # dynamo=False at its default opset (20)
    ("torchscript", 14, "eager", False),  # optimum's exporter and opset, the contract's names
    ("dynamo", None, "sdpa", True),  # torch's defaults at the default opset: SDPA decomposed
])
def test_passes_on_other_exporters_at_their_default_opsets(make_ckpt, tmp_path, kind, opset, attn, onnxscript_optimize):
    """torch.onnx graphs below opset 23 in the graph contract's (= optimum's) layout: `fuselm optimize`
    upgrades them (and says so in fuselm.json), fires RoPE (TorchScript's slice bounds computed from
    Shape), attention (eager with the past concat and repeat_kv, or SDPA's decomposition) and
    RMSNorm; onnxruntime gives the same logits and cache before and after."""
    import json

    from torch_export import export_hf

    src = export_hf(make_ckpt("qwen3"), tmp_path / "src" / "model.onnx", opset=opset, dynamo=kind == "dynamo",
                    attn_implementation=attn, optimize=onnxscript_optimize)
    assert onnx.load(str(src), load_external_data=False).opset_import[0].version < 23
    out = fuselm.optimize(src, tmp_path / "opt", quiet=True)
    meta = json.loads((out / "fuselm.json").read_text())
    first = meta["passes"][0]
    assert first["pass"] == "UpgradeOpset" and first["fired_at"][0].endswith("-> 23")
    ops = Counter(n.op_type for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node)
    # the q/k norms go into FusedRoPE (9 - 4 RMSNormalization), the SiLU gates into SwiGLU
    assert ops["RMSNormalization"] == 5 and ops["FusedRoPE"] == 4 and ops["Attention"] == 2 and ops["SwiGLU"] == 2, ops
    assert ops["Softmax"] == ops["Cos"] == ops["Neg"] == ops["ReduceMean"] == 0
    before = run_steps(src)
    after = run_steps(out / "model.onnx", steps=before)
    for step, d in drift(before, after).items():
        assert d["logits_rel"] <= 1e-5 and d["all_outputs_rel"] <= 1e-5, (step, d)


def test_optimize_reports_the_upgrade(capsys):
    """The summary line says the graph was converted, and from which opset."""
    import tempfile
    from pathlib import Path

    g = G()
    ids = g.inp("input_ids", [1, 3], dtype=TensorProto.INT64, value=np.array([[1, 2, 3]], np.int64))
    emb = g.node("Gather", [g.weight("embed", [8, 4]), ids])
    g.out(emb, "logits")
    m = g.model()
    m.opset_import[0].version = 18
    with tempfile.TemporaryDirectory() as d:
        onnx.save(m, f"{d}/model.onnx")
        fuselm.optimize(f"{d}/model.onnx", Path(d) / "out")
    assert "default-domain opset 18 -> 23" in capsys.readouterr().out.replace("\n", " ")


def test_opset_import_stays_default_domain_only():
    up, _, _ = apply(UpgradeOpset(), _rms_norm_at(14))
    assert [(o.domain, o.version) for o in up.opset_import] == [("", 23)]
    assert oh.printable_graph(up.graph)  # a well-formed graph
