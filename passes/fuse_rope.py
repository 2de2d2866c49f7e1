"""FuseRoPE: rotary embeddings computed from position_ids × inv_freq -> fuselm::FusedRoPE."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fuselm import contract

from .base import (
    Fusion,
    Nodes,
    attr,
    const,
    fail,
    input_at,
    other_input,
    producer,
    rope_node,
    scalar,
    take_over,
)

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


def _behind_views(v: ir.Value, stop=lambda v: False) -> ir.Value:
    """The value behind Cast / Unsqueeze / Reshape / Expand / Identity, or the first one on the way `stop` takes."""
    while not stop(v) and (node := producer(v, "Cast", "Unsqueeze", "Reshape", "Expand", "Identity")) is not None:
        v = node.inputs[0]
    return v


def _positions(v: ir.Value) -> ir.Value:
    """The int64 [B,S] position tensor behind Cast / Unsqueeze / Reshape / Expand."""
    v = _behind_views(v)
    if v.dtype is not None and v.dtype != ir.DataType.INT64:
        fail(f"positions {v.name} are {v.dtype}, not int64")
    if v.shape is not None and v.shape.rank() != 2:
        fail(f"positions {v.name} have rank {v.shape.rank()}, not [batch, seq]")
    return v


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
        inv = const(_behind_views(mm.inputs[0], stop=lambda x: const(x) is not None))
        if inv is None:
            fail("freqs = MatMul without a constant inv_freq")
        return inv.astype(np.float32).ravel(), _positions(mm.inputs[1])
    fail("cos/sin are not computed from position_ids × inv_freq (e.g. gathered from a cached table)")


@dataclass
class _Trig:
    """Where cos (or sin) comes from: an angle tensor fed to Cos/Sin, or a cached table gathered by position."""

    axis: int | None  # the Unsqueeze over the head axis
    scaling: float
    emb: ir.Value | None = None
    table: ir.Value | None = None
    positions: ir.Value | None = None


def _trig(v: ir.Value, op: str, expect_unsqueeze: bool = True) -> _Trig:
    """v = Unsqueeze(Cast?(Mul?(op(emb) | Gather(table, positions), scale)))."""
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
        t = next((i for i in mul.inputs if producer(i, op, "Gather") is not None), None)
        c = scalar(other_input(mul, t)) if t is not None else None
        if c is None:
            fail(f"{op} is scaled by a non-constant")
        scaling, v = float(c), t
    gather = producer(v, "Gather")
    if gather is not None:
        return _Trig(axis, scaling, table=_table(gather, op), positions=gather.inputs[1])
    trig = producer(v, op)
    if trig is None:
        fail(f"no {op} on the rotary angle: cos/sin not computed from position_ids × inv_freq")
    return _Trig(axis, scaling, emb=trig.inputs[0])


def _table(gather: ir.Node, op: str) -> ir.Value:
    """The constant [positions, dim] table a Gather over axis 0 reads (optionally its rows [:n] first)."""
    if attr(gather, "axis", 0) != 0:
        fail(f"{op.lower()} is gathered over axis {attr(gather, 'axis')}, not the positions of a table")
    data = gather.inputs[0]
    cut = producer(data, "Slice")
    if cut is not None:  # older HF: cos_cached[:seq_len][position_ids]
        start, axes = const(cut.inputs[1]), const(input_at(cut, 3))
        if start is None or int(start.ravel()[0]) != 0 or (axes is not None and int(axes.ravel()[0]) != 0):
            fail(f"the {op.lower()} table is sliced other than rows [:n]")
        data = cut.inputs[0]
    if data.const_value is None or data.shape is None or data.shape.rank() != 2:
        fail(f"the {op.lower()} table is not a constant [positions, dim] initializer")
    return data


def inv_freq_from_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_scaling) for tables [positions, rotary_dim/2] holding scaling·cos(p·inv_freq)
    and scaling·sin(p·inv_freq); fail() when they hold anything else. Fits on the first 64 rows, checks
    a sample of all (a long table is mapped, not read whole)."""
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[0] < 2:
        fail(f"cos/sin tables of shapes {cos.shape} / {sin.shape}, not one [positions, rotary_dim/2]")
    n = cos.shape[0]
    head = np.arange(min(n, 64))
    c, s = cos[head].astype(np.float64), sin[head].astype(np.float64)
    scaling = float(c[0, 0])
    if scaling <= 0 or not np.allclose(c[0], scaling, rtol=1e-6) or np.abs(s[0]).max() > 1e-6:
        fail("position 0 of the cos/sin tables is not (scaling, 0)")
    angle = np.unwrap(np.arctan2(s, c), axis=0)  # inv_freq <= 1 rad per position: unwrapping is exact
    p = head.astype(np.float64)[:, None]
    inv = (p * angle).sum(0) / (p * p).sum()
    rows = np.unique(np.concatenate([head, np.linspace(0, n - 1, 256).astype(np.int64)]))
    q = rows.astype(np.float64)[:, None]
    err = max(np.abs(cos[rows] - scaling * np.cos(q * inv)).max(), np.abs(sin[rows] - scaling * np.sin(q * inv)).max())
    if err > 1e-3 * scaling:  # float32 angles of a 32k table are off by ~1e-4; another formula by O(1)
        fail(f"the cos/sin tables are not cos/sin(position × inv_freq) (off by {err:.2g})")
    return inv.astype(np.float32), scaling


def _from_tables(tc: _Trig, ts: _Trig, interleaved: bool) -> tuple[np.ndarray, float, ir.Value]:
    """(inv_freq, scaling, positions) for cos/sin gathered by position from tables of Concat(freqs, freqs)
    (rotate_half) or repeat_interleave(freqs, 2) (interleaved)."""
    if ts.table is None or tc.positions is not ts.positions:
        fail("cos and sin are not gathered from tables by the same positions")
    c, s = tc.table.const_value.numpy(), ts.table.const_value.numpy()
    half = c.shape[-1] // 2
    a, b = (np.s_[:, 0::2], np.s_[:, 1::2]) if interleaved else (np.s_[:, :half], np.s_[:, half:])
    if c.shape[-1] % 2 or not np.array_equal(c[a], c[b]) or not np.array_equal(s[a], s[b]):
        fail("the table's halves differ: not cos/sin of Concat(freqs, freqs) (rotate_half)" if not interleaved
             else "the table's pairs differ: not cos/sin of repeat_interleave(freqs, 2) (interleaved)")
    inv, scaling = inv_freq_from_tables(np.ascontiguousarray(c[a]), np.ascontiguousarray(s[a]))
    return inv, scaling, _positions(tc.positions)


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
        axes, steps = const(input_at(n, 3)), const(input_at(n, 4))
        if axes is None or int(axes.ravel()[0]) not in (-1, 3) or (steps is not None and int(steps.ravel()[0]) != 1):
            fail("not rotate_half: slices not over the last axis with step 1")
    if s_lo is None or e_lo is None or s_hi is None or int(s_lo.ravel()[0]) != 0 \
            or int(e_lo.ravel()[0]) != int(s_hi.ravel()[0]):
        fail("not rotate_half: the halves are not x[..., :h] and x[..., h:]")
    return lo.inputs[0]


def _pair_split(rot: ir.Value) -> ir.Value:
    """x for rot = Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., 0::2], -1)), x's shape)
    (GPT-J / Cohere's rotate_every_two: torch.stack([-x2, x1], -1).flatten(-2))."""
    reshape = producer(rot, "Reshape")
    cat = producer(reshape.inputs[0], "Concat")
    if cat is None or len(cat.inputs) != 2 or attr(cat, "axis") not in (-1, 4):
        fail("not rotate_every_two: no Concat over a new last axis before the Reshape")
    ua, ub = producer(cat.inputs[0], "Unsqueeze"), producer(cat.inputs[1], "Unsqueeze")
    neg = producer(ua.inputs[0], "Neg") if ua is not None else None
    odd = producer(neg.inputs[0], "Slice") if neg is not None else None
    even = producer(ub.inputs[0], "Slice") if ub is not None else None
    if odd is None or even is None or odd.inputs[0] is not even.inputs[0]:
        fail("not rotate_every_two: Concat(Unsqueeze(Neg(Slice(x))), Unsqueeze(Slice(x))) of one x")
    for u in (ua, ub):
        axes = const(input_at(u, 1))
        if axes is None or int(axes.ravel()[0]) not in (-1, 4):
            fail("not rotate_every_two: the halves are not stacked on a new last axis")
    for n, first in ((even, 0), (odd, 1)):
        start, axes, steps = (const(input_at(n, i)) for i in (1, 3, 4))
        if start is None or axes is None or steps is None or int(start.ravel()[0]) != first \
                or int(axes.ravel()[0]) not in (-1, 3) or int(steps.ravel()[0]) != 2:
            fail("not rotate_every_two: the halves are not x[..., 0::2] and x[..., 1::2]")
    return even.inputs[0]


def _partial(x: ir.Value, out: ir.Value, rotary_dim: int) -> tuple[ir.Value, ir.Value]:
    """(X, y) for partial rotary: x = X[..., :rd] and y = Concat(rope(x), X[..., rd:]), so FusedRoPE
    runs on X (it passes the dims past 2·len(inv_freq) through); else (x, out) as they are."""
    head = producer(x, "Slice")
    cat = out.uses()[0].node if len(out.uses()) == 1 and not out.is_graph_output() else None
    if head is None or cat is None or cat.op_type != "Concat" or attr(cat, "axis") not in (-1, 3) \
            or len(cat.inputs) != 2 or cat.inputs[0] is not out:
        if head is not None and _slice_bounds(head) == (0, rotary_dim):
            fail("partial rotary whose rotated part is not concatenated back with the rest of x")
        return x, out
    tail = producer(cat.inputs[1], "Slice")
    if _slice_bounds(head) != (0, rotary_dim) or tail is None or tail.inputs[0] is not head.inputs[0] \
            or _slice_bounds(tail)[0] != rotary_dim or _slice_bounds(tail)[1] < 2**31:
        fail(f"partial rotary: the rotated and passed parts are not x[..., :{rotary_dim}] and x[..., {rotary_dim}:]")
    return head.inputs[0], cat.outputs[0]


def _slice_bounds(n: ir.Node) -> tuple[int, int] | None:
    """(start, end) of a step-1 Slice over the last axis with constant bounds, else None."""
    start, end, axes, steps = (const(input_at(n, i)) for i in range(1, 5))
    if start is None or end is None or axes is None or int(axes.ravel()[0]) not in (-1, 3) \
            or (steps is not None and int(steps.ravel()[0]) != 1):
        return None
    return int(start.ravel()[0]), int(end.ravel()[0])


class FuseRoPE(Fusion):
    """x·cos + rotate_half(x)·sin, cos/sin from position_ids × inv_freq -> fuselm::FusedRoPE(x, pos).

    As HF models traced by torch.onnx (or optimum) write it: freqs = Cast(position_ids) × inv_freq
    (a Mul, or HF's MatMul of the expanded buffers then Transpose), emb = Concat(freqs, freqs),
    cos = Cos(emb) [· attention_scaling] [Cast], unsqueezed over the head axis; rotate_half as
    Concat(Neg(x[..., h:]), x[..., :h]). Also an opset-23 `RotaryEmbedding` whose cos/sin caches
    are Cos/Sin of such freqs (what onnxscript's rewriter leaves). `inv_freq` and
    `attention_scaling` are read from the constants; x in HF's [B,H,S,D] layout gets a Transpose
    on each side (FusedRoPE works on [B,S,H,D]). The op ships with its FunctionProto.
    Also cos/sin gathered by position from cached tables (optimum, older HF: `cos_cached[position_ids]`,
    rows [:n] first or not): inv_freq and attention_scaling are recovered from the tables. Partial
    rotary (x[..., :rd] rotated, Concat with x[..., rd:]): FusedRoPE runs on the whole x with
    rd/2 frequencies and replaces the Concat.
    Must not fire (and says why): cos/sin not from positions × a constant inv_freq, nor tables of
    cos/sin(position × inv_freq) of Concat(freqs, freqs); cos and sin from different angles, tables
    or scalings; halves that are not x[..., :h] / x[..., h:]; a partial rotary whose parts are not
    x[..., :rd] / x[..., rd:]; cos/sin not unsqueezed over the head axis; positions that are not
    int64 [batch, seq]. The interleaved form (GPT-J / Cohere's rotate_every_two: Reshape(Concat(
    Unsqueeze(-x[..., 1::2]), Unsqueeze(x[..., 0::2]))) with angle repeat_interleave(freqs, 2) by
    Unsqueeze + Expand/Tile + Reshape, or its tables) gets interleaved=1; its must-not-fire cases:
    slices that are not x[..., 0::2] / x[..., 1::2], an angle that is not freqs repeated twice. Nor a rotary of the
    other layout than the graph's FusedRoPE nodes (or the first one fused) have: one function body per graph
    (DeepSeek-V3.2's rotate-half indexer beside its interleaved attention stays in standard ops).
    """

    aliases = ("fuse-rope", "rope")
    needs_opset = None
    functions = True
    layout: bool | None = None  # interleaved or not: the one layout the graph's FusedRoPE nodes have

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        for n in graph:
            if n.domain not in ("", "ai.onnx"):
                continue
            if n.op_type == "RotaryEmbedding":
                yield n
            elif n.op_type == "Add" and all(producer(v, "Mul") is not None for v in n.inputs) and \
                    any(producer(i, "Concat", "Reshape") is not None for v in n.inputs for i in producer(v).inputs):
                yield n

    def match(self, anchor: ir.Node) -> RopeMatch:
        m = self._match_standard(anchor) if anchor.op_type == "RotaryEmbedding" else self._match_products(anchor)
        if self.layout is not None and bool(m.interleaved) != self.layout:
            fail("the graph's other FusedRoPE nodes use the other rotary layout (fuselm::FusedRoPE has one function "
                 "body per graph)")
        return m

    def _match_products(self, anchor: ir.Node) -> RopeMatch:
        m1, m2 = (producer(v) for v in anchor.inputs)
        pairs = [(c, s, r) for c, s in ((m1, m2), (m2, m1))
                 for r in s.inputs if producer(r, "Concat", "Reshape") is not None]
        if not pairs:
            fail("neither product has a rotate_half factor")
        cos_mul, sin_mul, rot = pairs[0]
        interleaved = producer(rot, "Reshape") is not None
        x = _pair_split(rot) if interleaved else _half_split(rot)
        cos_b = other_input(cos_mul, x)
        if cos_b is None:
            fail("x·cos does not read the tensor rotate_half reads")
        sin_b = other_input(sin_mul, rot)
        tc, ts = _trig(cos_b, "Cos"), _trig(sin_b, "Sin")
        if tc.axis != ts.axis or tc.axis not in (1, 2):
            fail(f"cos/sin unsqueezed at axes {tc.axis}/{ts.axis}, not the head axis (1 for [B,H,S,D], 2 for [B,S,H,D])")
        if tc.scaling != ts.scaling:
            fail(f"cos and sin scaled differently ({tc.scaling} vs {ts.scaling})")
        scaling = tc.scaling
        if tc.table is not None:
            inv, table_scaling, pos = _from_tables(tc, ts, interleaved)
            scaling *= table_scaling
        else:
            if ts.emb is None:
                fail("sin is gathered from a table but cos is computed")
            inv, pos = self._angle(tc.emb, interleaved)
            inv_s, pos_s = self._angle(ts.emb, interleaved)
            if pos_s is not pos or not np.array_equal(inv, inv_s):
                fail("cos and sin are computed from different angles")
        if not interleaved:
            half = producer(rot, "Concat").inputs[1].producer()
            h = int(const(half.inputs[2]).ravel()[0])
            if h != len(inv):
                fail(f"rotate_half splits at {h} but inv_freq has {len(inv)} entries")
        x, out = _partial(x, anchor.outputs[0], 2 * len(inv))
        return RopeMatch(x, pos, inv, scaling, int(interleaved), tc.axis == 1, out, anchor)

    @staticmethod
    def _angle(emb: ir.Value, interleaved: bool) -> tuple[np.ndarray, ir.Value]:
        if interleaved:  # repeat_interleave(freqs, 2, -1): Reshape(Expand | Tile(Unsqueeze(freqs, -1)))
            reshape = producer(emb, "Reshape")
            rep = producer(reshape.inputs[0], "Expand", "Tile") if reshape is not None else None
            unsq = producer(rep.inputs[0], "Unsqueeze") if rep is not None else None
            times = const(rep.inputs[1]) if rep is not None else None
            axes = const(input_at(unsq, 1)) if unsq is not None else None
            r = unsq.inputs[0].shape.rank() + 1 if unsq is not None and unsq.inputs[0].shape is not None else None
            last = axes is not None and (int(axes.ravel()[0]) == -1 or (r is not None and int(axes.ravel()[0]) == r - 1))
            if unsq is None or times is None or int(times.ravel()[-1]) != 2 or np.any(times.ravel()[:-1] > 1) or not last:
                fail("the interleaved rotation's angle is not repeat_interleave(freqs, 2, -1)")
            return _freqs(unsq.inputs[0])
        cat = producer(emb, "Concat")
        if cat is None or len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
            fail("the angle is not Concat(freqs, freqs)")
        return _freqs(cat.inputs[0])

    def _match_standard(self, node: ir.Node) -> RopeMatch:
        if input_at(node, 3) is not None:
            fail("RotaryEmbedding with position_ids indexes a cached cos/sin table")
        x = node.inputs[0]
        if x.shape is None or x.shape.rank() != 4:
            fail("RotaryEmbedding input is not 4-D [B,H,S,D]")
        tc = _trig(node.inputs[1], "Cos", expect_unsqueeze=False)
        ts = _trig(node.inputs[2], "Sin", expect_unsqueeze=False)
        if tc.emb is None or ts.emb is None:
            fail("RotaryEmbedding's cos/sin are gathered from a table, not computed from position_ids × inv_freq")
        if tc.scaling != ts.scaling:
            fail(f"cos and sin scaled differently ({tc.scaling} vs {ts.scaling})")
        scale_c = tc.scaling
        inv, pos = _freqs(tc.emb)
        inv_s, pos_s = _freqs(ts.emb)
        if pos_s is not pos or not np.array_equal(inv, inv_s):
            fail("cos and sin are computed from different angles")
        dim = attr(node, "rotary_embedding_dim", 0)
        head_dim = x.shape[3] if isinstance(x.shape[3], int) else None
        if dim and dim != 2 * len(inv) or (head_dim is not None and 2 * len(inv) != head_dim):
            fail(f"inv_freq has {len(inv)} entries but the rotary dim is {dim or head_dim} (partial rotary)")
        return RopeMatch(x, pos, inv, scale_c, int(attr(node, "interleaved", 0)), True, node.outputs[0], node)

    def apply(self, model: ir.Model, stats) -> bool:
        # the layout the graph's FusedRoPE nodes already use, else the first fused one's
        self.layout = next((bool(attr(n, "interleaved", 0)) for n in model.graph
                            if n.domain == contract.DOMAIN and n.op_type == contract.ROPE_OP), None)
        return super().apply(model, stats)

    def rewrite(self, graph: ir.Graph, m: RopeMatch) -> str:
        scope = _scope(m)
        new = Nodes(graph)
        src = m.x
        if m.heads_first:
            tr = producer(m.x, "Transpose")
            if tr is not None and list(attr(tr, "perm", [])) == _BHSD:
                src = tr.inputs[0]
            else:
                src = new.add("Transpose", [m.x], f"{scope}/in/Transpose", perm=_BHSD)
        new.append(rope_node(graph, src, m.position_ids, f"{scope}/{contract.ROPE_OP}", m.inv_freq, m.scaling,
                             m.interleaved))
        self.layout = bool(m.interleaved)
        out = new[-1].outputs[0]
        if m.heads_first:
            out = new.add("Transpose", [out], f"{scope}/out/Transpose", perm=_BHSD)
        graph.insert_before(m.anchor, new)
        take_over(m.out, out)
        return scope


def _scope(m: RopeMatch) -> str:
    """Name the node after what reads it: /model/layers.i/attn/{q,k} when an Attention does."""
    for use in m.out.uses():
        node = use.node
        if node.op_type == "Attention" and use.idx in (0, 1):
            base = (node.name or "attn").rsplit("/", 1)[0]
            return f"{base}/{'qk'[use.idx]}_rope"
        if node.op_type == "Concat" and contract.is_present(node.outputs[0].name):
            layer = contract.parse_cache(node.outputs[0].name).layer
            return f"/model/layers.{layer}/attn/k_rope"
    return f"{m.anchor.name or 'rope'}/rope"
