"""AttentionTo3D on tiny graphs: Attention-23 fed [B,S,H*D] instead of Transposes of [B,S,H,D]."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from fuselm.passes.attention_3d import AttentionTo3D
from onnx import TensorProto
from onnx import helper as oh
from passes_helpers import G, apply, assert_same, ops

B, S, P, D, HID = 1, 3, 2, 8, 16


def layer_graph(heads=4, kv_heads=2, qk_norm=True, head_attrs=True, out_shape=(0, 0, -1), extra_reader=False,
                q_bhsd_input=False, qk_output=False):
    """x -> MatMul(qkv) -> Split -> Reshape [0,0,H,D] -> (RMSNorm over D) -> Transpose -> Attention-23
    (past in, present out) -> Transpose -> Reshape -> MatMul: fuselm's optimized layer, in small."""
    g = G()
    x = g.inp("x", [B, S, HID])
    widths = [heads * D, kv_heads * D, kv_heads * D]
    qkv = g.node("MatMul", [x, g.weight("qkv.weight", [HID, sum(widths)])])
    parts = g.node("Split", [qkv, g.init("sizes", np.array(widths, np.int64))], n_out=3, axis=-1)
    sides = []
    for role, part, h in zip("qkv", parts, (heads, kv_heads, kv_heads), strict=True):
        t = g.node("Reshape", [part, g.init(f"{role}_heads", np.array([0, 0, h, D], np.int64))])
        if qk_norm and role != "v":
            t = g.node("RMSNormalization", [t, g.weight(f"{role}_norm.weight", [D])], axis=-1, epsilon=1e-6)
        sides.append(g.node("Transpose", [t], perm=[0, 2, 1, 3]))
    if q_bhsd_input:
        sides[0] = g.inp("q_bhsd", [B, heads, S, D])
    past = [g.inp(f"past_key_values.0.{kind}", [B, kv_heads, P, D]) for kind in ("key", "value")]
    mask = g.inp("mask", [B, 1, S, P + S], value=np.zeros((B, 1, S, P + S), np.float32))
    attrs = dict(q_num_heads=heads, kv_num_heads=kv_heads) if head_attrs else {}
    n_out = 4 if qk_output else 3
    y, pk, pv, *qk = g.node("Attention", [*sides, mask, *past], n_out=n_out, scale=D ** -0.5, **attrs)
    g.nodes[-1].output[1:3] = ["present.0.key", "present.0.value"]
    out = g.node("Transpose", [y], perm=[0, 2, 1, 3])
    out = g.node("Reshape", [out, g.init("merge", np.array(out_shape, np.int64))])
    g.out(g.node("MatMul", [out, g.weight("o.weight", [heads * D, HID])]), "y", rank=len(out_shape))
    if extra_reader:
        g.out(y, "y_heads", rank=4)
    g.outputs += [oh.make_tensor_value_info(f"present.0.{kind}", TensorProto.FLOAT, [B, kv_heads, P + S, D])
                  for kind in ("key", "value")]
    if qk_output:
        g.out(qk[0], "qk", rank=4)
    return g


@pytest.mark.parametrize("kwargs", [dict(), dict(heads=4, kv_heads=4, qk_norm=False), dict(kv_heads=1),
                                    dict(head_attrs=False, qk_norm=False)])
def test_attention_to_3d_fires(kwargs):
    g = layer_graph(**kwargs)
    before = g.model()
    after, modified, stats = apply(AttentionTo3D(), before)
    assert modified and len(stats.fired) == 1
    assert "Transpose" not in ops(after)
    norms = kwargs.get("qk_norm", True)
    # q/k keep one Reshape into heads (their RMSNorm works on [B,S,H,D]) and get one back; v reads the Split.
    assert ops(after).count("Reshape") == (4 if norms else 0)
    node = next(n for n in after.graph.node if n.op_type == "Attention")
    split = next(n for n in after.graph.node if n.op_type == "Split")
    assert node.input[2] == split.output[2]
    if not norms:
        assert list(node.input[:3]) == list(split.output)
    attrs = {a.name: a.i for a in node.attribute if a.name.endswith("num_heads")}
    assert attrs == {"q_num_heads": kwargs.get("heads", 4), "kv_num_heads": kwargs.get("kv_heads", 2)}
    assert list(node.output[1:]) == ["present.0.key", "present.0.value"]  # the contract's [B, KV, T, D] outputs
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert_same(before, after, g.feeds)
    assert not apply(AttentionTo3D(), after)[1]  # already 3-D: nothing more to do


@pytest.mark.parametrize("case,kwargs,reason", [
    ("Y also read as [B,H,S,D]", dict(extra_reader=True), "Y is not read by one Transpose"),
    ("Y reshaped to something else", dict(out_shape=(-1, 4 * D)), "not read by one Reshape to [B, S, H*Dv]"),
    ("q already [B,H,S,D] from elsewhere", dict(q_bhsd_input=True), "q is not a Transpose"),
    ("qk_matmul_output read", dict(qk_output=True), "qk_matmul_output is read"),
])
def test_attention_to_3d_must_not_fire(case, kwargs, reason):
    before = layer_graph(**kwargs).model()
    after, modified, stats = apply(AttentionTo3D(), before)
    assert not modified and ops(after) == ops(before), case
    assert any(reason in r for _, r in stats.skipped), (case, stats.skipped)


def test_attention_to_3d_refuses_contradicting_head_counts():
    """A q_num_heads that the q tensor's shape contradicts (a damaged graph): left alone, reason given."""
    model = layer_graph(qk_norm=False).model()
    q_heads = next(n for n in model.graph.node if n.op_type == "Reshape").output[0]
    model.graph.value_info.append(oh.make_tensor_value_info(q_heads, TensorProto.FLOAT, [B, S, 4, D]))
    attn = next(n for n in model.graph.node if n.op_type == "Attention")
    next(a for a in attn.attribute if a.name == "q_num_heads").i = 2
    _, modified, stats = AttentionTo3D()(ir.serde.deserialize_model(model))
    assert not modified
    assert any("q has 4 heads but the Attention says 2" in r for _, r in stats.skipped), stats.skipped


def test_attention_to_3d_needs_the_head_counts():
    """No head attributes, and q/k behind their RMSNorm with no shapes: it cannot tell H."""
    after, modified, stats = apply(AttentionTo3D(), layer_graph(head_attrs=False).model())
    assert not modified
    assert any("heads is unknown" in r for _, r in stats.skipped), stats.skipped
