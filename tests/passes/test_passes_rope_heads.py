"""FuseRoPENorm and RoPETo3D on tiny graphs: q/k norm and head Reshapes folded into FusedRoPE."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fuselm.passes.fuse_rope_norm import FuseRoPENorm
from fuselm.passes.rope_3d import RoPETo3D
from passes_helpers import G, apply, assert_same, ops

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.graphcheck import check_graph_file

B, S, D, HID = 1, 4, 16, 24


def heads_graph(norms=(True, True), interleaved=0, rotary=D, norm_axis=-1, extra_reader=None, merge=(0, 0, -1),
                weight_input=False) -> tuple[G, onnx.ModelProto]:
    """x -> MatMul -> Split -> q, k each Reshape [0,0,H,D] -> (RMSNorm over D) -> FusedRoPE -> Reshape [0,0,-1]
    -> one output each: the q/k half of fuselm's optimized layer before these passes."""
    g = G()
    x = g.inp("x", [B, S, HID])
    pos = g.inp("position_ids", [B, S], dtype=onnx.TensorProto.INT64, value=np.arange(3, 3 + S, dtype=np.int64)[None])
    heads = (3, 1)
    qk = g.node("MatMul", [x, g.weight("qk.weight", [HID, sum(heads) * D])])
    parts = g.node("Split", [qk, g.init("sizes", np.array([h * D for h in heads], np.int64))], n_out=2, axis=-1)
    inv = (1.0 / 10000 ** (np.arange(0, rotary, 2) / rotary)).astype(np.float32)
    for role, part, h, norm in zip("qk", parts, heads, norms, strict=True):
        t = g.node("Reshape", [part, g.init(f"{role}_heads", np.array([0, 0, h, D], np.int64))])
        if norm:
            w = g.inp(f"{role}_w", [D]) if weight_input else g.weight(f"{role}_norm.weight", [D])
            t = g.node("RMSNormalization", [t, w], axis=norm_axis, epsilon=1e-6)
            if extra_reader == "norm" and role == "q":
                g.out(t, "q_normed", rank=4)
        r = g.node(contract.ROPE_OP, [t, pos], domain=contract.DOMAIN, inv_freq=inv.tolist(), attention_scaling=1.0,
                   interleaved=interleaved)
        if extra_reader == "rope" and role == "q":
            g.out(r, "q_rotated", rank=4)
        g.out(g.node("Reshape", [r, g.init(f"{role}_merge", np.array(merge, np.int64))]), f"{role}_out",
              rank=len(merge))
    model = g.model()
    model.opset_import.append(onnx.helper.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION))
    model.functions.extend(contract.functions_for(model.graph.node))
    return g, model


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary", [D, D // 2])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_and_heads_fold_into_fused_rope(interleaved, rotary, norm):
    g, before = heads_graph(norms=(norm, norm), interleaved=interleaved, rotary=rotary)
    mid, fired_norm, stats = apply(FuseRoPENorm(), before)
    assert fired_norm == norm and len(stats.fired) == (2 if norm else 0)
    assert_same(before, mid, g.feeds)
    after, modified, stats = apply(RoPETo3D(), mid)
    assert modified and len(stats.fired) == 2
    assert "Reshape" not in ops(after) and "RMSNormalization" not in ops(after)
    ropes = [n for n in after.graph.node if n.op_type == contract.ROPE_OP]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in ropes]
    assert [a["num_heads"] for a in attrs] == [3, 1]
    assert all(len(n.input) == (3 if norm else 2) for n in ropes)
    assert all(abs(a["epsilon"] - 1e-6) < 1e-12 for a in attrs) if norm else all("epsilon" not in a for a in attrs)
    (fn,) = after.functions
    assert fn == contract.fused_rope_function(bool(interleaved), heads=True, normed=norm)
    assert_same(before, after, g.feeds)
    assert not apply(RoPETo3D(), after)[1] and not apply(FuseRoPENorm(), after)[1]  # nothing more to do


@pytest.mark.parametrize("case,kwargs,reason", [
    ("k has no q/k norm", dict(norms=(True, False)), "its input is not an RMSNormalization"),
    ("norm over two axes", dict(norm_axis=-2), "not the head dim alone"),
    ("normalized q read elsewhere", dict(extra_reader="norm"), "read by more than the FusedRoPE"),
    ("weight not a constant", dict(weight_input=True), "not a constant [head_dim]"),
])
def test_rope_norm_must_not_fire(case, kwargs, reason):
    """All or none: one FusedRoPE that cannot take its norm keeps every norm where it is."""
    _, before = heads_graph(**kwargs)
    after, modified, stats = apply(FuseRoPENorm(), before)
    assert not modified and ops(after) == ops(before), case
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)
    if case == "k has no q/k norm":  # q could, but then the graph would mix forms
        assert any("not every FusedRoPE can take its norm" in r for _, r in stats.skipped), stats.skipped


@pytest.mark.parametrize("case,kwargs,fired,reason", [
    ("rotated q read as [B,S,H,D] too", dict(extra_reader="rope", norms=(False, False)), 1, "not read by one Reshape"),
    ("merged to something else", dict(merge=(0, -1), norms=(False, False)), 0, "not read by one Reshape"),
    ("q/k norms still between", dict(), 0, "its input is not a Reshape"),
])
def test_rope_3d_must_not_fire(case, kwargs, fired, reason):
    g, before = heads_graph(**kwargs)
    after, modified, stats = apply(RoPETo3D(), before)
    assert len(stats.fired) == fired and ops(after).count("Reshape") == ops(before).count("Reshape") - 2 * fired, case
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)
    assert_same(before, after, g.feeds)


def test_checker_wants_the_body_of_the_graphs_form(tmp_path):
    """A normed 3-D graph carrying the plain FusedRoPE body (what a runtime would not compute), or mixing
    normed and plain nodes (one body per model), is refused by name."""
    _, before = heads_graph()
    after = apply(RoPETo3D(), apply(FuseRoPENorm(), before)[0])[0]
    onnx.save(after, tmp_path / "ok.onnx")
    check_graph_file(tmp_path / "ok.onnx")
    del after.functions[:]
    after.functions.append(contract.fused_rope_function(interleaved=True, heads=True, normed=True))
    onnx.save(after, tmp_path / "other_body.onnx")
    with pytest.raises(FuselmError, match="not fuselm's definition of that op"):
        check_graph_file(tmp_path / "other_body.onnx")
    rope = next(n for n in after.graph.node if n.op_type == contract.ROPE_OP)
    del rope.input[2]
    with pytest.raises(FuselmError, match="mixes FusedRoPE nodes with and without a norm weight"):
        contract.rope_form(after.graph.node)
