"""OrtGroupQueryAttention (target onnxruntime): FusedRoPE + Attention-23 -> com.microsoft.GroupQueryAttention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from fuselm import contract
from fuselm.graphcheck import ORT_DOMAIN
from fuselm.reference import ort_session

from .base import (
    SMALL_CONST,
    Fusion,
    Nodes,
    Stats,
    attr,
    const,
    fail,
    initializer,
    input_at,
    producer,
    remove_unused,
    small_constant,
    take_over,
)

# GroupQueryAttention's cos/sin caches cover positions 0..max_length-1 (genai_config's max_length).
DEFAULT_MAX_LENGTH = 4096
_MASKED = -1e4  # an additive mask entry at or below this weighs exp(-1e4) = 0 in float32


@dataclass
class Rope:
    node: ir.Node
    x: ir.Value  # FusedRoPE's input [B, S, heads, D], or [B, S, heads·D] when `flat`
    inv_freq: tuple
    scaling: float
    interleaved: int
    positions: ir.Value
    flat: bool = False  # num_heads set: x is [B, S, heads·D]
    norm: tuple[ir.Value, float] | None = None  # FusedRoPE's per-head norm (weight [D], epsilon): GQA has none


@dataclass
class GQAMatch:
    attn: ir.Node
    q: ir.Value | Rope  # [B, S, H·D] before the rotation, or the Rope whose input rewrite views as 3-D
    k: ir.Value | Rope
    heads: int
    kv_heads: int
    head_dim: int
    rope: Rope | None


def _unrotated(v: ir.Value, heads: int, head_dim: int) -> tuple[ir.Value | None, Rope | None]:
    """(the [B, S, heads·D] tensor before FusedRoPE, its FusedRoPE) for v = FusedRoPE(x [B, S, heads·D],
    num_heads=heads) or Reshape(FusedRoPE(x [B, S, heads, D]), [.., heads·D]); the tensor is None when
    rewrite must make it (a 3-D view after FusedRoPE's norm); (v, None) when v is not rotated."""
    rope = v.producer()
    flat = _is_rope(rope) and attr(rope, "num_heads", 0) > 0
    if not flat:
        r = producer(v, "Reshape")
        rope = r.inputs[0].producer() if r is not None else None
        if not _is_rope(rope) or attr(rope, "num_heads", 0):
            return v, None
    if len(rope.outputs[0].uses()) != 1 or rope.outputs[0].is_graph_output():
        fail(f"{rope.name} (FusedRoPE) has other readers")
    x = rope.inputs[0]
    want = [heads * head_dim] if flat else [heads, head_dim]
    if flat and attr(rope, "num_heads") != heads:
        fail(f"{rope.name} (FusedRoPE) has num_heads {attr(rope, 'num_heads')}, the Attention {heads}")
    if x.shape is not None and (x.shape.rank() != 2 + len(want) or any(
            isinstance(d, int) and d != w for d, w in zip(list(x.shape)[2:], want, strict=True))):
        fail(f"FusedRoPE's input {x.name} is not [B, S, {', '.join(map(str, want))}]")
    weight = input_at(rope, 2)
    norm = (weight, float(attr(rope, "epsilon", contract.RMS_EPSILON))) if weight is not None else None
    inv = tuple(attr(rope, "inv_freq", ()))
    found = Rope(rope, x, inv, float(attr(rope, "attention_scaling", 1.0)), int(attr(rope, "interleaved", 0)),
                 rope.inputs[1], flat, norm)
    if norm is not None:
        return None, found  # GQA gets the normalized heads as a 3-D view, made in rewrite
    if flat:
        return x, found
    split = producer(x, "Reshape")  # x = Reshape(y [B, S, heads·D]): hand GQA y itself
    target = const(split.inputs[1]) if split is not None else None
    if target is not None and list(target) == [0, 0, heads, head_dim] and _width(split.inputs[0]) == heads * head_dim:
        return split.inputs[0], found
    return None, found  # a 3-D view of x is made in rewrite (after q/k norms)


def _is_rope(node: ir.Node | None) -> bool:
    return node is not None and node.domain == contract.DOMAIN and node.op_type == contract.ROPE_OP


def _width(v: ir.Value | None) -> int | None:
    """The last dim of a 3-D q/k/v: from its shape, the Reshape target that makes it, or the Split sizes."""
    if v is None:
        return None
    if v.shape is not None and v.shape.rank() == 3 and isinstance(v.shape[-1], int):
        return v.shape[-1]
    n = v.producer()
    if n is not None and n.op_type == "Reshape":
        target = const(n.inputs[1])
        return int(target[-1]) if target is not None and target.shape == (3,) and target[-1] > 0 else None
    if n is not None and n.op_type == "Split" and len(n.inputs) > 1 and attr(n, "axis", 0) in (-1, 2):
        sizes = const(n.inputs[1])
        return int(sizes[list(n.outputs).index(v)]) if sizes is not None else None
    return None


def _ancestors(graph: ir.Graph, v: ir.Value) -> list[ir.Node]:
    """The nodes `v` is computed from, in graph order; fail() when weights feed it."""
    seen: set[ir.Node] = set()
    stack = [v]
    while stack:
        x = stack.pop()
        n = x.producer()
        if n is None:
            if x.const_value is not None and x.const_value.size > SMALL_CONST:
                fail(f"the mask reads the constant {x.name} of {x.const_value.size} elements")
            continue
        if n in seen:
            continue
        if n.domain not in ("", "ai.onnx"):
            fail(f"the mask is computed with {n.domain}::{n.op_type}")
        seen.add(n)
        stack.extend(i for i in n.inputs if i is not None)
    return [n for n in graph if n in seen]


def _probe_model(graph: ir.Graph, mask: ir.Value) -> tuple[onnx.ModelProto, list[ir.Value]]:
    nodes = _ancestors(graph, mask)
    inputs, inits = [], {}
    for n in nodes:
        for i in n.inputs:
            if i is None or i.producer() is not None:
                continue
            if i.is_graph_input():
                if i not in inputs:
                    inputs.append(i)
            elif i.const_value is not None:
                inits[i.name] = ir.serde.serialize_tensor(i.const_value)
                inits[i.name].name = i.name
    g = onnx.helper.make_graph([ir.serde.serialize_node(n) for n in nodes], "mask",
                               [ir.serde.serialize_value(i) for i in inputs], [], initializer=list(inits.values()))
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d in ("", "ai.onnx")]
    model = onnx.helper.make_model(g, opset_imports=opsets, ir_version=10)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    out = onnx.ValueInfoProto()
    out.CopyFrom(inferred.get(mask.name) or ir.serde.serialize_value(mask))
    out.type.tensor_type.ClearField("shape")
    model.graph.output.append(out)
    return model, inputs


def check_causal_mask(graph: ir.Graph, mask: ir.Value, max_length: int = 8192) -> None:
    """fail() unless the mask, run in onnxruntime on probe inputs, is causal (bottom-right, a query at
    position P + s sees keys t <= P + s) and masks attention_mask's zeros: what GroupQueryAttention
    computes from attention_mask's row sums (valid tokens first). Probes: prefill, decode, a chunk
    after a past, a right-padded prompt, and one query at position min(max_length, 8192) - 1 (a sliding
    window)."""
    model, inputs = _probe_model(graph, mask)
    try:
        sess = ort_session(model)
    except Exception as e:
        fail(f"the mask's subgraph does not run alone in onnxruntime ({type(e).__name__})")
    last = min(max_length, 8192) - 1
    for s, p, valid in ((4, 0, 4), (1, 6, 7), (3, 5, 8), (5, 0, 3), (1, last, last + 1)):
        t = p + s
        am = (np.arange(t) < valid).astype(np.int64)[None]
        feeds = {}
        for i in inputs:
            dims = [d if isinstance(d, int) else 1 for d in (i.shape.dims if i.shape is not None else [])]
            if i.name == contract.ATTENTION_MASK:
                feeds[i.name] = am
            elif i.name == contract.INPUT_IDS:
                feeds[i.name] = np.zeros((1, s), np.int64)
            elif i.name == contract.POSITION_IDS:
                feeds[i.name] = np.arange(p, p + s, dtype=np.int64)[None]
            elif contract.is_past(i.name) and len(dims) == 4:
                feeds[i.name] = np.zeros((1, dims[1], p, dims[3]), np.float32)
            else:
                fail(f"the mask reads the graph input {i.name}, not only attention_mask / input_ids / positions / "
                     "the past's shape")
        try:
            (m,) = sess.run(None, feeds)
        except Exception as e:
            fail(f"the mask's subgraph fails on a probe input ({type(e).__name__})")
        want = (np.arange(t)[None] <= (p + np.arange(s))[:, None]) & (am[0][None] > 0)
        rows = min(s, valid - p)  # a right-padded prompt: the pad queries' rows are not compared
        try:
            m = np.broadcast_to(m, (1, 1, s, t))
        except ValueError:
            fail(f"the mask has shape {list(m.shape)} for {s} queries over {t} keys, not [1, 1, {s}, {t}]")
        seen = m[0, 0, :rows] if m.dtype == np.bool_ else (m[0, 0, :rows] == 0)
        if not np.array_equal(seen, want[:rows]):
            fail(f"the mask is not causal + attention_mask padding (differs at {s} queries after {p} past, "
                 f"{valid} valid keys): e.g. a sliding window, bidirectional or custom mask")
        if m.dtype != np.bool_ and np.any(m[0, 0, :rows][~want[:rows]] > _MASKED):
            fail("the mask's masked entries are not large negative numbers")


class OrtGroupQueryAttention(Fusion):
    """Attention-23(q, k, v, mask, past_k, past_v) with FusedRoPE on q and k -> com.microsoft.GroupQueryAttention.

    The pattern: a 3-D Attention-23 (AttentionTo3D's form: q [B, S, H·D], k/v [B, S, KV·D]) with
    the past inputs and present graph outputs, q and k each FusedRoPE(x [B, S, heads·D], position_ids[,
    norm weight], num_heads) or Reshape(FusedRoPE(x [B, S, heads, D], ...), [.., heads·D]) (q/k norms,
    FusedRoPE's own included, stay before it as RMSNormalization, outside GQA, as its schema says), or
    neither rotated. GQA gets do_rotary=1, rotary_interleaved from FusedRoPE, cos/sin caches
    [max_length, rotary_dim/2] = attention_scaling·cos/sin(p × inv_freq) computed from FusedRoPE's
    attributes, the graph's position_ids (input 9), seqlens_k = ReduceSum(attention_mask) - 1 and
    total_sequence_length = attention_mask's length (computed once in the graph, as
    onnxruntime-genai's builder does), the scale and softcap. past and present are in the
    contract's [B, KV, T, D] layout, so onnxruntime-genai can give both one buffer of max_length
    (past_present_share_buffer). GQA takes key validity from attention_mask's row sums: equal to the
    standard graph without padding or with right padding (valid tokens first, as onnxruntime-genai
    feeds a batch), not for a left-padded batch.
    Must not fire (and says why): a 4-D Attention; no past or present outputs; is_causal=1; the
    qk output read; a mask that, run in onnxruntime on probe inputs, is not causal + padding (a
    sliding window, a bidirectional or custom mask); only one of q and k rotated, or by different
    FusedRoPEs; a head size onnxruntime's CPU kernel does not take (not a multiple of 16); a
    rotary dim > the head size or not a multiple of 16 (GQA's caches); not float32.
    """

    aliases = ("ort-gqa", "gqa", "group-query-attention")
    needs_opset = None
    anchor_ops = ("Attention",)

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH):
        self.max_length = max_length


    def apply(self, model: ir.Model, stats: Stats) -> bool:
        self._masks: dict[ir.Value, str | None] = {}
        self._shared: dict = {}
        modified = super().apply(model, stats)
        if modified:
            model.opset_imports.setdefault(ORT_DOMAIN, 1)
            remove_unused(model)
            if not any(n.domain == contract.DOMAIN for n in model.graph):  # FusedRoPE went into GQA
                model.opset_imports.pop(contract.DOMAIN, None)
                for key in [k for k in model.functions if k[0] == contract.DOMAIN]:
                    del model.functions[key]
        return modified

    def match(self, node: ir.Node) -> GQAMatch:
        q, k, v, mask, past_k, past_v = (input_at(node, i) for i in range(6))
        if any(x is not None and x.shape is not None and x.shape.rank() != 3 for x in (q, k, v)):
            fail("not the 3-D form (q/k/v [B, S, heads·D]); AttentionTo3D makes it")
        if past_k is None or past_v is None or not past_k.is_graph_input() or not past_v.is_graph_input() \
                or len(node.outputs) < 3 or not all(o.is_graph_output() for o in node.outputs[1:3]):
            fail("no past inputs and present graph outputs (GQA owns the cache)")
        if len(node.outputs) > 3 and (node.outputs[3].uses() or node.outputs[3].is_graph_output()):
            fail("its qk_matmul_output is read")
        if attr(node, "is_causal", 0):
            fail("is_causal=1 (the pass reads the causal structure from the mask)")
        if any(x.dtype not in (None, ir.DataType.FLOAT) for x in (q, k, v)):
            fail("q/k/v are not float32")
        heads, kv_heads = attr(node, "q_num_heads"), attr(node, "kv_num_heads")
        cache = list(past_k.shape.dims) if past_k.shape is not None and past_k.shape.rank() == 4 else []
        head_dim = cache[3] if cache and isinstance(cache[3], int) else None
        if not heads or not kv_heads or heads % kv_heads or not head_dim or cache[1] != kv_heads:
            fail(f"head counts {heads}/{kv_heads} and the past's shape {cache} do not make whole heads")
        widths = [_width(x) for x in (q, k, v)]
        if any(w not in (None, h * head_dim) for w, h in zip(widths, (heads, kv_heads, kv_heads), strict=True)):
            fail(f"q/k/v widths {widths} are not {heads}/{kv_heads}/{kv_heads} heads of {head_dim}")
        if head_dim % 16:
            fail(f"head size {head_dim} is not a multiple of 16 (onnxruntime's CPU GroupQueryAttention)")
        if mask is None:
            fail("no mask input: the graph does not read attention_mask here")
        if mask not in self._masks:
            try:
                check_causal_mask(node.graph, mask, self.max_length)
                self._masks[mask] = None
            except Exception as e:
                self._masks[mask] = str(e)
        if self._masks[mask] is not None:
            fail(self._masks[mask])
        q_in, rq = _unrotated(q, heads, head_dim)
        k_in, rk = _unrotated(k, kv_heads, head_dim)
        if (rq is None) != (rk is None):
            fail("only one of q and k is rotated by a FusedRoPE")
        if rq is not None:
            if (rq.inv_freq, rq.scaling, rq.interleaved) != (rk.inv_freq, rk.scaling, rk.interleaved) \
                    or rq.positions is not rk.positions:
                fail("q and k are rotated by FusedRoPEs of different frequencies, scaling or positions")
            if 2 * len(rq.inv_freq) > head_dim:
                fail(f"rotary dim {2 * len(rq.inv_freq)} exceeds the head size {head_dim}")
            if len(rq.inv_freq) % 8:
                fail(f"rotary dim {2 * len(rq.inv_freq)} is not a multiple of 16 (GQA's cos/sin caches)")
        # q/k as GQA reads them: the tensor before the rotation, or the Rope (a 3-D view made in rewrite)
        return GQAMatch(node, q_in if q_in is not None else rq, k_in if k_in is not None else rk, heads, kv_heads,
                        head_dim, rq)

    def rewrite(self, graph: ir.Graph, m: GQAMatch) -> str:
        node = m.attn
        scope = (node.name or "attn").rsplit("/", 1)[0]
        new = Nodes(graph)
        q, k = m.q, m.k
        if m.rope is not None:
            q, k = (self._flat(new, x, heads, m.head_dim, f"{scope}/{t}_rope")
                    for x, heads, t in ((q, m.heads, "q"), (k, m.kv_heads, "k")))
        seqlens, total = self._lengths(graph)
        inputs = [q, k, node.inputs[2], node.inputs[4], node.inputs[5], seqlens, total]
        rope = {}
        if m.rope is not None:
            cos, sin = self._caches(graph, m.rope)
            inputs += [cos, sin, m.rope.positions]
            rope = {"do_rotary": 1, "rotary_interleaved": m.rope.interleaved}
        outs = new.add("GroupQueryAttention", inputs, f"{scope}/GroupQueryAttention", outputs=3,
                       domain=ORT_DOMAIN, num_heads=m.heads, kv_num_heads=m.kv_heads,
                       scale=attr(node, "scale"), softcap=attr(node, "softcap"), local_window_size=-1, **rope)
        graph.insert_before(node, new)
        for old, out in zip(node.outputs[:3], outs, strict=True):
            take_over(old, out)
        graph.remove(node, safe=True)
        return scope

    @staticmethod
    def _flat(new: Nodes, x: ir.Value | Rope, heads: int, head_dim: int, scope: str) -> ir.Value:
        """The rotated tensor's input as [B, S, heads·D]: a Reshape of FusedRoPE's input (after the q/k norm
        before it), or of FusedRoPE's own norm over head_dim (RMSNormalization on a [B, S, heads, D] view)."""
        if isinstance(x, ir.Value):
            return x
        heads4 = x.x
        if x.flat:
            shape4 = small_constant(new.graph, f"{scope}/shape4", np.array([0, 0, heads, head_dim], np.int64))
            heads4 = new.add("Reshape", [heads4, shape4], f"{scope}/heads/Reshape")
        if x.norm is not None:
            heads4 = new.add("RMSNormalization", [heads4, x.norm[0]], f"{scope}/norm/RMSNormalization",
                             axis=-1, epsilon=x.norm[1], stash_type=1)
        shape = small_constant(new.graph, f"{scope}/shape3", np.array([0, 0, heads * head_dim], np.int64))
        return new.add("Reshape", [heads4, shape], f"{scope}/Reshape")

    def _lengths(self, graph: ir.Graph) -> tuple[ir.Value, ir.Value]:
        """seqlens_k = int32(ReduceSum(attention_mask, 1) - 1) [B] and total_sequence_length =
        int32(attention_mask's length), made once at the top of the graph."""
        if "lengths" not in self._shared:
            am = next((v for v in graph.inputs if v.name == contract.ATTENTION_MASK), None)
            if am is None:
                fail("the graph has no attention_mask input")
            s, new, i32 = "/model/attn_mask/gqa", Nodes(graph), int(ir.DataType.INT32)
            one = small_constant(graph, f"{s}/one", np.array([1], dtype=np.int64))
            total_sum = new.add("ReduceSum", [am, one], f"{s}/ReduceSum", keepdims=0)
            one_scalar = small_constant(graph, f"{s}/one_scalar", np.array(1, dtype=np.int64))
            minus = new.add("Sub", [total_sum, one_scalar], f"{s}/Sub")
            seqlens = new.add("Cast", [minus], f"{s}/seqlens_k", to=i32)
            shape = new.add("Shape", [am], f"{s}/Shape", start=1, end=2)
            squeeze = new.add("Squeeze", [shape], f"{s}/Squeeze")
            total = new.add("Cast", [squeeze], f"{s}/total_sequence_length", to=i32)
            graph.insert_before(next(iter(graph)), new)
            self._shared["lengths"] = (seqlens, total)
        return self._shared["lengths"]

    def _caches(self, graph: ir.Graph, rope: Rope) -> tuple[ir.Value, ir.Value]:
        """cos/sin caches [max_length, rotary_dim/2] for one (inv_freq, attention_scaling), shared by every layer."""
        key = ("caches", rope.inv_freq, rope.scaling)
        if key not in self._shared:
            angle = np.arange(self.max_length, dtype=np.float64)[:, None] * np.asarray(rope.inv_freq, np.float32)
            caches = [initializer(graph, f"/model/rope/{n}_cache",
                                  (rope.scaling * f(angle)).astype(np.float32)) for n, f in (("cos", np.cos),
                                                                                             ("sin", np.sin))]
            self._shared[key] = tuple(caches)
        return self._shared[key]

