"""FuseRoPE: rotary embeddings computed from position_ids × inv_freq -> fuselm::FusedRoPE."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .base import FUSELM_DOMAIN, Fusion, attr, const, fail, new_node, other_input, producer, scalar, take_over

_BHSD = [0, 2, 1, 3]  # [B,H,S,D] <-> [B,S,H,D]; its own inverse


@dataclass
class RopeMatch:
    x: ir.Value  # the rotated tensor as the pattern reads it
    position_ids: ir.Value
    inv_freq: np.ndarray
    scaling: float
    interleaved: int
    heads_first: bool  # x is [B,H,S,D] (HF) rather than [B,S,H,D] (FusedRoPE's layout)
    out: ir.Value
    anchor: ir.Node


def _positions(v: ir.Value) -> ir.Value:
    """The int64 [B,S] position tensor behind Cast / Unsqueeze / Reshape / Expand."""
    while True:
        node = producer(v, "Cast", "Unsqueeze", "Reshape", "Expand", "Identity")
        if node is None:
            break
        v = node.inputs[0]
    if v.dtype is not None and v.dtype != ir.DataType.INT64:
        fail(f"positions {v.name} are {v.dtype}, not int64")
    if v.shape is not None and v.shape.rank() != 2:
        fail(f"positions {v.name} have rank {v.shape.rank()}, not [batch, seq]")
    return v


def _constant_behind(v: ir.Value) -> np.ndarray | None:
    while const(v) is None:
        node = producer(v, "Cast", "Unsqueeze", "Reshape", "Expand", "Identity")
        if node is None:
            return None
        v = node.inputs[0]
    return const(v)


def _freqs(f: ir.Value) -> tuple[np.ndarray, ir.Value]:
    """(inv_freq, position_ids) for freqs = positions × inv_freq, as Mul or HF's MatMul + Transpose."""
    mul = producer(f, "Mul")
    if mul is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            inv = const(a)
            if inv is not None:
                return inv.astype(np.float32).ravel(), _positions(b)
        fail("freqs = Mul without a constant inv_freq")
    tr = producer(f, "Transpose")
    mm = producer(tr.inputs[0], "MatMul") if tr is not None else None
    if mm is not None and list(attr(tr, "perm", [])) == [0, 2, 1]:
        inv = _constant_behind(mm.inputs[0])
        if inv is None:
            fail("freqs = MatMul without a constant inv_freq")
        return inv.astype(np.float32).ravel(), _positions(mm.inputs[1])
    fail("cos/sin are not computed from position_ids × inv_freq (e.g. gathered from a cached table)")


def _trig(v: ir.Value, op: str, expect_unsqueeze: bool = True) -> tuple[ir.Value, float, int | None]:
    """(emb, attention_scaling, unsqueeze axis) for v = Unsqueeze(Cast?(Mul?(op(emb), scale)))."""
    axis = None
    if expect_unsqueeze:
        unsq = producer(v, "Unsqueeze")
        if unsq is None:
            fail(f"{op.lower()} is not unsqueezed over the head axis")
        axes = const(unsq.inputs[1]) if len(unsq.inputs) > 1 else np.array(attr(unsq, "axes"))
        if axes is None or len(np.atleast_1d(axes)) != 1:
            fail(f"{op.lower()} unsqueeze axes are not one constant")
        axis = int(np.atleast_1d(axes)[0]) % 4
        v = unsq.inputs[0]
    cast = producer(v, "Cast")
    if cast is not None:
        v = cast.inputs[0]
    scaling = 1.0
    mul = producer(v, "Mul")
    if mul is not None:
        t = next((i for i in mul.inputs if producer(i, op) is not None), None)
        c = scalar(other_input(mul, t)) if t is not None else None
        if c is None:
            fail(f"{op} is scaled by a non-constant")
        scaling, v = float(c), t
    trig = producer(v, op)
    if trig is None and producer(v, "Gather", "GatherND", "GatherElements") is not None:
        fail(f"{op.lower()} is gathered from a cached table, not computed from position_ids × inv_freq")
    if trig is None:
        fail(f"no {op} on the rotary angle: cos/sin not computed from position_ids × inv_freq")
    return trig.inputs[0], scaling, axis


def _half_split(rot: ir.Value) -> ir.Value:
    """x for rot = Concat(Neg(x[..., h:]), x[..., :h]) (rotate_half)."""
    cat = producer(rot, "Concat")
    if cat is None or len(cat.inputs) != 2 or attr(cat, "axis") not in (-1, 3):
        fail("not rotate_half: no Concat over the last axis")
    neg = producer(cat.inputs[0], "Neg")
    hi = producer(neg.inputs[0], "Slice") if neg is not None else None
    lo = producer(cat.inputs[1], "Slice")
    if hi is None or lo is None or hi.inputs[0] is not lo.inputs[0]:
        fail("not rotate_half: Concat(Neg(Slice(x)), Slice(x)) of one x")
    s_lo, e_lo, s_hi = (const(n.inputs[i]) for n, i in ((lo, 1), (lo, 2), (hi, 1)))
    for n in (lo, hi):
        axes = const(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] is not None else None
        steps = const(n.inputs[4]) if len(n.inputs) > 4 and n.inputs[4] is not None else None
        if axes is None or int(axes.ravel()[0]) not in (-1, 3) or (steps is not None and int(steps.ravel()[0]) != 1):
            fail("not rotate_half: slices not over the last axis with step 1")
    if s_lo is None or e_lo is None or s_hi is None or int(s_lo.ravel()[0]) != 0 \
            or int(e_lo.ravel()[0]) != int(s_hi.ravel()[0]):
        fail("not rotate_half: the halves are not x[..., :h] and x[..., h:]")
    return lo.inputs[0]


class FuseRoPE(Fusion):
    """x·cos + rotate_half(x)·sin, cos/sin from position_ids × inv_freq -> fuselm::FusedRoPE(x, pos).

    As HF models traced by torch.onnx (or optimum) write it: freqs = Cast(position_ids) × inv_freq
    (a Mul, or HF's MatMul of the expanded buffers then Transpose), emb = Concat(freqs, freqs),
    cos = Cos(emb) [· attention_scaling] [Cast], unsqueezed over the head axis; rotate_half as
    Concat(Neg(x[..., h:]), x[..., :h]). Also an opset-23 `RotaryEmbedding` whose cos/sin caches
    are Cos/Sin of such freqs (what onnxscript's rewriter leaves). `inv_freq` and
    `attention_scaling` are read from the constants; x in HF's [B,H,S,D] layout gets a Transpose
    on each side (FusedRoPE works on [B,S,H,D]). The op ships with its FunctionProto.
    Must not fire (and says why): cos/sin not from positions × a constant inv_freq (e.g. gathered
    from a cached table); cos and sin from different angles or scalings; halves that are not
    x[..., :h] / x[..., h:]; inv_freq that does not cover head_dim (partial rotary); cos/sin not
    unsqueezed over the head axis; positions that are not int64 [batch, seq].
    """

    aliases = ("fuse-rope", "rope")
    needs_opset = None

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        for n in graph:
            if n.domain not in ("", "ai.onnx"):
                continue
            if n.op_type == "RotaryEmbedding":
                yield n
            elif n.op_type == "Add" and all(producer(v, "Mul") is not None for v in n.inputs) and \
                    any(producer(i, "Concat") is not None for v in n.inputs for i in producer(v).inputs):
                yield n

    def match(self, anchor: ir.Node) -> RopeMatch:
        if anchor.op_type == "RotaryEmbedding":
            return self._match_standard(anchor)
        m1, m2 = (producer(v) for v in anchor.inputs)
        pairs = [(c, s, r) for c, s in ((m1, m2), (m2, m1))
                 for r in s.inputs if producer(r, "Concat") is not None]
        if not pairs:
            fail("neither product has a rotate_half factor")
        cos_mul, sin_mul, rot = pairs[0]
        x = _half_split(rot)
        cos_b = other_input(cos_mul, x)
        if cos_b is None:
            fail("x·cos does not read the tensor rotate_half reads")
        sin_b = other_input(sin_mul, rot)
        emb_c, scale_c, axis_c = _trig(cos_b, "Cos")
        emb_s, scale_s, axis_s = _trig(sin_b, "Sin")
        if axis_c != axis_s or axis_c not in (1, 2):
            fail(f"cos/sin unsqueezed at axes {axis_c}/{axis_s}, not the head axis (1 for [B,H,S,D], 2 for [B,S,H,D])")
        if scale_c != scale_s:
            fail(f"cos and sin scaled differently ({scale_c} vs {scale_s})")
        inv, pos = self._angle(emb_c)
        inv_s, pos_s = self._angle(emb_s)
        if pos_s is not pos or not np.array_equal(inv, inv_s):
            fail("cos and sin are computed from different angles")
        half = producer(rot, "Concat").inputs[1].producer()
        h = int(const(half.inputs[2]).ravel()[0])
        if h != len(inv):
            fail(f"rotate_half splits at {h} but inv_freq has {len(inv)} entries (partial rotary)")
        return RopeMatch(x, pos, inv, scale_c, 0, axis_c == 1, anchor.outputs[0], anchor)

    @staticmethod
    def _angle(emb: ir.Value) -> tuple[np.ndarray, ir.Value]:
        cat = producer(emb, "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
            fail("the angle is not Concat(freqs, freqs)")
        return _freqs(cat.inputs[0])

    def _match_standard(self, node: ir.Node) -> RopeMatch:
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            fail("RotaryEmbedding with position_ids indexes a cached cos/sin table")
        x = node.inputs[0]
        if x.shape is None or x.shape.rank() != 4:
            fail("RotaryEmbedding input is not 4-D [B,H,S,D]")
        f_c, scale_c, _ = _trig(node.inputs[1], "Cos", expect_unsqueeze=False)
        f_s, scale_s, _ = _trig(node.inputs[2], "Sin", expect_unsqueeze=False)
        if scale_c != scale_s:
            fail(f"cos and sin scaled differently ({scale_c} vs {scale_s})")
        inv, pos = _freqs(f_c)
        inv_s, pos_s = _freqs(f_s)
        if pos_s is not pos or not np.array_equal(inv, inv_s):
            fail("cos and sin are computed from different angles")
        dim = attr(node, "rotary_embedding_dim", 0)
        head_dim = x.shape[3] if isinstance(x.shape[3], int) else None
        if dim and dim != 2 * len(inv) or (head_dim is not None and 2 * len(inv) != head_dim):
            fail(f"inv_freq has {len(inv)} entries but the rotary dim is {dim or head_dim} (partial rotary)")
        return RopeMatch(x, pos, inv, scale_c, int(attr(node, "interleaved", 0)), True, node.outputs[0], node)

    def apply(self, model: ir.Model, stats) -> bool:
        modified = super().apply(model, stats)
        if modified:
            attach_function(model)
        return modified

    def rewrite(self, graph: ir.Graph, m: RopeMatch) -> str:
        scope = _scope(m)
        new = []
        src = m.x
        if m.heads_first:
            tr = producer(m.x, "Transpose")
            if tr is not None and list(attr(tr, "perm", [])) == _BHSD:
                src = tr.inputs[0]
            else:
                t = new_node(graph, "Transpose", [m.x], f"{scope}/in/Transpose", perm=_BHSD)
                new.append(t)
                src = t.outputs[0]
        rope = new_node(graph, "FusedRoPE", [src, m.position_ids], f"{scope}/FusedRoPE", domain=FUSELM_DOMAIN,
                        inv_freq=[float(v) for v in m.inv_freq], attention_scaling=float(m.scaling),
                        interleaved=m.interleaved)
        new.append(rope)
        out = rope.outputs[0]
        if m.heads_first:
            t = new_node(graph, "Transpose", [out], f"{scope}/out/Transpose", perm=_BHSD)
            new.append(t)
            out = t.outputs[0]
        graph.insert_before(m.anchor, new)
        take_over(m.out, out)
        return scope


def attach_function(model: ir.Model) -> None:
    """Attach fuselm::FusedRoPE's FunctionProto (the exporter's, one definition) when the graph uses it."""
    from fuselm.exporter.rope import DOMAIN, DOMAIN_VERSION, OP, fused_rope_function

    if not any(n.domain == DOMAIN and n.op_type == OP for n in model.graph):
        return
    model.opset_imports.setdefault(DOMAIN, DOMAIN_VERSION)
    if (DOMAIN, OP, "") not in model.functions:
        fn = ir.serde.deserialize_function(fused_rope_function())
        model.functions[fn.identifier()] = fn


def _scope(m: RopeMatch) -> str:
    """Name the node after what reads it: /model/layers.i/attn/{q,k} when an Attention does."""
    for use in m.out.uses():
        node = use.node
        if node.op_type == "Attention" and use.idx in (0, 1):
            base = (node.name or "attn").rsplit("/", 1)[0]
            return f"{base}/{'qk'[use.idx]}_rope"
        if node.op_type == "Concat" and node.outputs[0].name and node.outputs[0].name.startswith("present."):
            layer = node.outputs[0].name.split(".")[1]
            return f"/model/layers.{layer}/attn/k_rope"
    return f"{m.anchor.name or 'rope'}/rope"
