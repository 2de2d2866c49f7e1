"""FuseAttention: HF eager attention with KV cache and GQA expansion -> Attention-23."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .base import (
    Fusion,
    Nodes,
    attr,
    const,
    fail,
    input_at,
    new_node,
    only_user,
    other_input,
    producer,
    scalar,
    small_constant,
    static_shape,
    take_over,
)


@dataclass
class KV:
    """One of key/value: the new [B,KV,S,D] tensor, the past input, and the cache's output."""

    new: ir.Value
    past: ir.Value | None
    present: ir.Value | None  # Concat(past, new) output (present.{i}.key), None without a cache
    kv_heads: int | None
    rep: int | None  # GQA repeat factor, None when unknown
    heads: int | None  # query heads, when the repeat's Reshape says
    expanded: ir.Value | None = None  # repeat_kv's output [B, H, T, D], when there is a repeat


@dataclass
class AttentionMatch:
    q: ir.Value
    key: KV
    value: KV
    mask: ir.Value | None
    scale: float
    heads: int
    kv_heads: int
    out: ir.Value
    softmax_precision: int | None  # float32 when the pattern casts around Softmax
    last: ir.Node
    is_causal: int = 0


def _sink_column(x: ir.Value) -> bool:
    """Whether the Softmax input x is Concat(scores, sink, axis=-1), maybe through Cast and the
    x - ReduceMax(x) shift (gpt-oss's eager attention): the attention-with-sinks form."""
    for _ in range(3):
        node = producer(x, "Cast", "Sub")
        if node is None:
            break
        x = node.inputs[0]
    cat = producer(x, "Concat")
    return cat is not None and len(cat.inputs) == 2 and attr(cat, "axis", 0) in (-1, 3)


def _cache(t: ir.Value) -> tuple[ir.Value, ir.Value | None, ir.Value | None]:
    """(new, past, present) for t = Concat(past, new) along the sequence axis, else (t, None, None)."""
    cat = producer(t, "Concat")
    if cat is None:
        return t, None, None
    if len(cat.inputs) != 2 or attr(cat, "axis") not in (2, -2):
        fail(f"KV Concat {cat.name} is not (past, new) along axis 2")
    past, new = cat.inputs
    if not past.is_graph_input():
        fail(f"KV Concat {cat.name} does not read a past_key_values graph input")
    return new, past, t


def _repeat_kv(t: ir.Value) -> KV:
    """Undo HF repeat_kv: Reshape(Expand(Unsqueeze(x, 2), [.., rep, ..]), [B, H, T, D]) or x itself."""
    reshape = producer(t, "Reshape")
    if reshape is None:
        new, past, present = _cache(t)
        kv = _dim(t, 1) or _dim(past, 1)
        return KV(new, past, present, kv, 1, kv)
    expand = producer(reshape.inputs[0], "Expand")
    unsq = producer(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsq is None:
        fail("K/V is reshaped but not as repeat_kv (Unsqueeze -> Expand -> Reshape)")
    axes = const(unsq.inputs[1]) if len(unsq.inputs) > 1 else np.array(attr(unsq, "axes"))
    if axes is None or list(np.atleast_1d(axes)) != [2]:
        fail(f"repeat_kv Unsqueeze is over axes {None if axes is None else list(np.atleast_1d(axes))}, not [2]")
    base = unsq.inputs[0]
    new, past, present = _cache(base)
    kv = _dim(base, 1) or _dim(past, 1)
    target = const(expand.inputs[1])
    rep = int(target[2]) if target is not None and len(target) == 5 and target[2] > 0 else _dim(expand.outputs[0], 2)
    shape = const(reshape.inputs[1])
    heads = int(shape[1]) if shape is not None and len(shape) == 4 and shape[1] > 0 else _dim(t, 1)
    if shape is not None and len(shape) != 4:
        fail(f"repeat_kv Reshape target {list(shape)} is not 4-D")
    return KV(new, past, present, kv, rep, heads, t)


def _is_scores(v: ir.Value) -> bool:
    """Whether v is MatMul(Q, Kᵀ) (Kᵀ a Transpose, or SDPA's Reshape / scaled Kᵀ), maybe scaled by a Mul or Div."""
    node = producer(v, "Mul", "Div")
    candidates = list(node.inputs) if node is not None else [v]
    return any(producer(c, "MatMul") is not None and producer(producer(c).inputs[1], "Transpose", "Reshape", "Mul")
               is not None for c in candidates)


def _layer_tag(v: ir.Value) -> str:
    return re.sub(r"(key|value)$", "", v.name or "")


def _dim(v: ir.Value | None, i: int) -> int | None:
    s = static_shape(v)
    return s[i] if s is not None and len(s) > i else None


class FuseAttention(Fusion):
    """softmax(Q·Kᵀ·scale + mask)·V over the cache -> Attention(Q, K, V, mask, past_k, past_v).

    The pattern (HF eager attention, and fuselm's exporter): K = Concat(past_key, k) along the
    sequence axis (its output is `present.{i}.key`), GQA expansion as repeat_kv (Unsqueeze at 2,
    Expand, Reshape) or none when heads == kv_heads; Transpose(K) with perm [0,1,3,2]; MatMul;
    scale as Mul or Div by a constant on the scores; an optional Add of a mask; Softmax over the
    last axis (maybe between Casts to float32); MatMul with the expanded V. The fused node reads
    q [B,H,S,D], the new k/v [B,KV,S,D], the same mask, and the past inputs; its present outputs
    take over the graph outputs' names, so the graph's inputs and outputs stay as they were.
    Also an Attention-23 without a cache whose K/V are repeat_kv(Concat(past, new)) (what
    onnxscript's rewriter leaves in a default torch.onnx export) gets the cache moved inside; and
    torch's SDPA decomposition (opsets < 23): sqrt(scale) multiplied into Q and into Kᵀ, Kᵀ as
    Reshape(Transpose(Reshape(K, [-1, T, D]), [0, 2, 1]), [B, H, D, T]), and
    Where(IsNaN(p), 0, p) after Softmax.
    Must not fire (and says why): attention sinks (gpt-oss: a learned per-head logit Concat-ed to the
    scores as one more column before Softmax, maybe through the x - ReduceMax(x) shift, and sliced off
    after it; DESIGN.md's attention-with-sinks form): Attention-23 has no sinks, so that graph keeps
    its standard ops; Softmax not over the last axis; scores not MatMul(Q, Kᵀ);
    the scale not a constant; K and V caches from different layers or a past that is not a graph
    input; an expansion that is not repeat_kv; head counts that do not divide; an intermediate
    (scores, probabilities) read elsewhere.
    """

    aliases = ("fuse-attention", "attention", "attn")

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [n for n in graph if n.domain in ("", "ai.onnx") and (
            n.op_type == "Softmax" or (n.op_type == "Attention" and len(n.inputs) <= 4 and len(n.outputs) == 1))]

    def match(self, anchor: ir.Node) -> AttentionMatch:
        if anchor.op_type == "Attention":
            return self._match_cacheless(anchor)
        return self._match_eager(anchor)

    def _match_cacheless(self, node: ir.Node) -> AttentionMatch:
        """An Attention-23 without past inputs whose K/V are repeat_kv(Concat(past, new))
        (what onnxscript's rewriter leaves): move the cache and the GQA expansion into the op."""
        if any(attr(node, a) for a in ("softcap", "qk_matmul_output_mode")):
            fail("Attention uses softcap or a qk output mode")
        key, value = _repeat_kv(node.inputs[1]), _repeat_kv(node.inputs[2])
        if key.past is None or value.past is None:
            fail("Attention's K/V do not come from a past_key_values Concat")
        if _layer_tag(key.past) != _layer_tag(value.past):
            fail(f"K and V caches belong to different layers ({key.past.name}, {value.past.name})")
        q = node.inputs[0]
        heads = _dim(q, 1) or key.heads
        kv_heads = key.kv_heads or (heads // key.rep if heads and key.rep else None)
        # K/V from repeat_kv are 4-D, so Q is too (Attention-23 takes all 3-D or all 4-D).
        if not heads or not kv_heads or heads % kv_heads:
            fail("cannot tell the number of query and key/value heads of a 4-D Attention")
        mask = input_at(node, 3)
        scale = attr(node, "scale")
        if scale is None:
            head_dim = _dim(q, 3) or _dim(key.new, 3) or _dim(key.past, 3)
            scale = float(head_dim) ** -0.5 if head_dim else None
        if scale is None:
            fail("Attention has no scale attribute and head_dim is not static")
        return AttentionMatch(q, key, value, mask, float(scale), heads, kv_heads, node.outputs[0],
                              attr(node, "softmax_precision"), node, attr(node, "is_causal", 0))

    def _match_eager(self, softmax: ir.Node) -> AttentionMatch:
        if attr(softmax, "axis", -1) not in (-1, 3):
            fail(f"Softmax over axis {attr(softmax, 'axis')}, not the last")
        if _sink_column(softmax.inputs[0]):
            fail("attention sinks: a column is concatenated to the scores before Softmax; Attention-23 has no sinks")
        probs = _nan_guard(softmax.outputs[0])
        softmax_f32 = False
        cast_out = only_user(probs, "Cast")
        if cast_out is not None:
            probs, softmax_f32 = cast_out.outputs[0], True
        pv = only_user(probs, "MatMul")
        if pv is None or pv.inputs[0] is not probs:
            fail("Softmax output is not the left input of a MatMul alone")
        scores = softmax.inputs[0]
        cast_in = producer(scores, "Cast")
        if cast_in is not None:
            scores, softmax_f32 = cast_in.inputs[0], True
        mask = None
        add = producer(scores, "Add")
        if add is not None:
            sides = [i for i in (0, 1) if _is_scores(add.inputs[i])]
            if len(sides) != 1:
                fail("the Add before Softmax is not scores + mask")
            scores, mask = add.inputs[sides[0]], add.inputs[1 - sides[0]]
            if mask.dtype is not None and mask.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16,
                                                             ir.DataType.BFLOAT16, ir.DataType.BOOL):
                fail(f"the mask has dtype {mask.dtype}, not float or bool")
        scale = 1.0
        scale_node = producer(scores, "Mul", "Div")
        if scale_node is not None:
            qk_out = next((v for v in scale_node.inputs if producer(v, "MatMul") is not None), None)
            if qk_out is None:
                fail("the scale does not multiply Q·Kᵀ")
            c = scalar(other_input(scale_node, qk_out))
            if c is None or c == 0:
                fail("the scale is not a non-zero constant")
            if scale_node.op_type == "Div" and scale_node.inputs[1] is qk_out:
                fail("scores divide a constant, not the other way round")
            scale = float(c) if scale_node.op_type == "Mul" else 1.0 / float(c)
            scores = qk_out
        qk = producer(scores, "MatMul")
        if qk is None:
            fail("the scores are not MatMul(Q, Kᵀ)")
        for v in [qk.outputs[0], *(n.outputs[0] for n in (scale_node, add) if n is not None)]:
            if len(v.uses()) != 1 or v.is_graph_output():
                fail(f"intermediate {v.name} has another reader")
        q, kt = qk.inputs
        if scale_node is None:  # torch's SDPA decomposition: sqrt(scale) on Q and on Kᵀ
            (q, sq), (kt, sk) = _scaled(q), _scaled(kt)
            scale = sq * sk
        key, value = _repeat_kv(_untransposed(kt)), _repeat_kv(pv.inputs[1])
        if (key.past is None) != (value.past is None):
            fail("only one of K and V reads a cache")
        if key.past is not None and _layer_tag(key.past) != _layer_tag(value.past):
            fail(f"K and V caches belong to different layers ({key.past.name}, {value.past.name})")
        q_heads = _dim(q, 1) or key.heads or value.heads
        if key.kv_heads and key.rep and not q_heads:
            q_heads = key.kv_heads * key.rep
        q_heads = q_heads or _heads_from_output(pv.outputs[0], _dim(key.past, 3) or _dim(key.new, 3))
        kv_heads = key.kv_heads or value.kv_heads or (q_heads // key.rep if q_heads and key.rep else None)
        if not q_heads or not kv_heads:
            fail("cannot tell the number of query and key/value heads from shapes or constants")
        if q_heads % kv_heads or (key.rep and key.rep * kv_heads != q_heads):
            fail(f"{q_heads} query heads do not match {kv_heads} kv heads × repeat {key.rep}")
        return AttentionMatch(q, key, value, mask, scale, q_heads, kv_heads, pv.outputs[0],
                              int(ir.DataType.FLOAT) if softmax_f32 else None, pv)

    def rewrite(self, graph: ir.Graph, m: AttentionMatch) -> str:
        prefix = _scope(m)
        inputs = [m.q, m.key.new, m.value.new, m.mask]
        if m.key.past is not None:
            inputs += [m.key.past, m.value.past]
        while inputs and inputs[-1] is None:
            inputs.pop()
        n_out = 3 if m.key.past is not None else 1
        node = new_node(graph, "Attention", inputs, f"{prefix}/Attention", outputs=n_out,
                        q_num_heads=m.heads, kv_num_heads=m.kv_heads, scale=m.scale, is_causal=m.is_causal,
                        softmax_precision=m.softmax_precision)
        graph.insert_before(m.last, node)
        take_over(m.out, node.outputs[0])
        if m.last.op_type == "Attention":
            graph.remove(m.last, safe=True)
        if n_out == 3:
            for kv in (m.key, m.value):
                _shapes_from_inputs(graph, kv, kv.rep or m.heads // m.kv_heads, prefix)
            take_over(m.key.present, node.outputs[1])
            take_over(m.value.present, node.outputs[2])
        return prefix


def _shapes_from_inputs(graph: ir.Graph, kv: KV, rep: int, prefix: str) -> None:
    """Shape(Concat(past, new)) or Shape(repeat_kv(...)) read outside the attention (HF's mask code takes the
    key length from the updated cache: optimum's export) would read the fused node's present output and
    close a cycle through the mask: compute it as Shape(past)·[1, rep, 1, 1] + Shape(new)·[0, 0, 1, 0]."""
    for value, factor in ((kv.present, 1), (kv.expanded, rep)):
        for use in list(value.uses()) if value is not None else ():
            shape = use.node
            if shape.op_type != "Shape" or shape.domain not in ("", "ai.onnx"):
                continue
            new = Nodes(graph)
            past = new.add("Shape", [kv.past], f"{shape.name}/past")
            length = new.add("Shape", [kv.new], f"{shape.name}/new")
            if factor != 1:
                heads = small_constant(graph, f"{prefix}/kv_rep", np.array([1, factor, 1, 1], np.int64))
                past = new.add("Mul", [past, heads], f"{shape.name}/heads")
            axis2 = small_constant(graph, f"{prefix}/kv_len_axis", np.array([0, 0, 1, 0], np.int64))
            length = new.add("Mul", [length, axis2], f"{shape.name}/new_len")
            total = new.add("Add", [past, length], f"{shape.name}/total")
            start, end = attr(shape, "start", 0), attr(shape, "end", None)
            if start != 0 or end is not None:
                starts = small_constant(graph, f"{prefix}/shape_start", np.array([start], np.int64))
                ends = small_constant(graph, f"{prefix}/shape_end", np.array([4 if end is None else end], np.int64))
                total = new.add("Slice", [total, starts, ends], f"{shape.name}/slice")
            graph.insert_before(shape, new)
            take_over(shape.outputs[0], total)


def _heads_from_output(y: ir.Value, head_dim: int | None) -> int | None:
    """Query heads from what reads the attention output: Transpose(0, 2, 1, 3) -> Reshape -> MatMul by
    a [heads·D, hidden] weight (TorchScript computes every reshape target, so no shape says it)."""
    tr = only_user(y, "Transpose")
    reshape = only_user(tr.outputs[0], "Reshape") if tr is not None and list(attr(tr, "perm", [])) == [0, 2, 1, 3] else None
    mm = only_user(reshape.outputs[0], "MatMul") if reshape is not None else None
    w = mm.inputs[1] if mm is not None else None
    dq = producer(w, "DequantizeLinear")
    w = dq.inputs[0] if dq is not None else w
    rows = w.shape[0] if w is not None and w.shape is not None and w.shape.rank() == 2 else None
    if not head_dim or not isinstance(rows, int) or rows % head_dim:
        return None
    return rows // head_dim


def _nan_guard(p: ir.Value) -> ir.Value:
    """Where(IsNaN(p), 0, p) after Softmax (torch's SDPA decomposition: a fully masked row gives 0,
    not NaN), or p itself. The graph's finite masks never mask a whole row, so Attention agrees."""
    readers = {u.node.op_type: u.node for u in p.uses()}
    if len(p.uses()) != 2 or set(readers) != {"IsNaN", "Where"} or p.is_graph_output():
        return p
    isnan, where = readers["IsNaN"], readers["Where"]
    if where.inputs[0] is not isnan.outputs[0] or where.inputs[2] is not p or scalar(where.inputs[1]) != 0 \
            or len(isnan.outputs[0].uses()) != 1:
        fail("Softmax is read by IsNaN / Where, but not as Where(IsNaN(p), 0, p)")
    return where.outputs[0]


def _scaled(v: ir.Value) -> tuple[ir.Value, float]:
    """(x, c) for v = Mul(x, c) with a scalar constant c read only here, else (v, 1)."""
    mul = producer(v, "Mul")
    if mul is None or len(v.uses()) != 1:
        return v, 1.0
    for x, c in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        if scalar(c) is not None:
            if scalar(c) == 0:
                fail("Q or Kᵀ is scaled by zero")
            return x, float(scalar(c))
    fail("Q or Kᵀ is multiplied by a non-constant before Q·Kᵀ")


def _untransposed(kt: ir.Value) -> ir.Value:
    """K [B, H, T, D] for Kᵀ = Transpose(K, [0, 1, 3, 2]), or torch's SDPA decomposition
    Reshape(Transpose(Reshape(K, [-1, T, D]), [0, 2, 1]), [B, H, D, T])."""
    tr = producer(kt, "Transpose")
    if tr is not None and list(attr(tr, "perm", [])) == [0, 1, 3, 2]:
        return tr.inputs[0]
    back = producer(kt, "Reshape")
    tr = producer(back.inputs[0], "Transpose") if back is not None else None
    flat = producer(tr.inputs[0], "Reshape") if tr is not None else None
    if flat is not None and list(attr(tr, "perm", [])) == [0, 2, 1] and static_shape(flat.inputs[1]) == (3,) \
            and static_shape(back.inputs[1]) == (4,) and all(len(n.outputs[0].uses()) == 1 for n in (flat, tr)):
        target = const(flat.inputs[1])
        if target is not None and int(target[0]) not in (-1, 0):
            fail("K is flattened to 3-D, but not over its batch and head axes")
        return flat.inputs[0]
    fail("K is not transposed (perm [0, 1, 3, 2], or SDPA's Reshape-Transpose-Reshape) before Q·Kᵀ")


def _scope(m: AttentionMatch) -> str:
    """A node scope naming the layer: from the past input's name or the existing node names."""
    for v in (m.key.past, m.key.present):
        g = re.search(r"\.(\d+)\.key$", (v.name if v is not None else "") or "")
        if g:
            return f"/model/layers.{g.group(1)}/attn"
    name = m.last.name or "attention"
    return name.rsplit("/", 2)[0] if name.count("/") >= 2 else name
