"""FromGenAI: onnxruntime-genai's contrib ops -> standard ONNX ops of the same meaning (+ FusedRoPE).

onnxruntime-genai's builder (`python -m onnxruntime_genai.models.builder`) writes its decoders with
onnxruntime contrib ops that no other runtime knows. Each has a standard equivalent at opset 23;
this pass rewrites them so the fusions and every runtime read the graph as fuselm's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from fuselm import contract
from fuselm.errors import FuselmError, shown
from fuselm.graphcheck import ORT_DOMAIN, ORT_ONNX_DOMAIN_CONTRIB

from .base import (
    Nodes,
    Pass,
    Reject,
    Stats,
    attach_functions,
    attr,
    fail,
    input_at,
    lazy_initializer,
    new_node,
    producer,
    rope_node,
    small_constant,
    take_over,
)
from .fuse_rope import inv_freq_from_tables

# onnxruntime-genai writes the graph contract's names except position_ids (GQA derives positions
# from the mask); the mapped graph takes it as an input, as the contract says.
POSITIONS = contract.POSITION_IDS


@dataclass
class _Shared:
    """Values several rewrites read: made once, on first use."""

    graph: ir.Graph
    positions: ir.Value | None = None
    mask: ir.Value | None = None

    def position_ids(self) -> ir.Value:
        if self.positions is None:
            found = next((v for v in self.graph.inputs if v.name == POSITIONS), None)
            if found is None:
                ids = next((v for v in self.graph.inputs if v.name == contract.INPUT_IDS), None)
                dims = list(ids.shape.dims) if ids is not None and ids.shape is not None else ["batch_size", "sequence_length"]
                found = ir.Value(name=POSITIONS, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(dims))
                self.graph.inputs.append(found)
            self.positions = found
        return self.positions

    def key_mask(self) -> ir.Value:
        """The boolean [B, 1, S, T] mask (True = attend): key t is not padding and t <= T - S + s
        (causal, aligned bottom-right as GroupQueryAttention is); onnxruntime's Attention-23 takes a
        mask with the query length, not one broadcast over it."""
        if self.mask is None:
            g = self.graph
            am = next((v for v in g.inputs if v.name == contract.ATTENTION_MASK), None)
            ids = next((v for v in g.inputs if v.name == contract.INPUT_IDS), None)
            if am is None or ids is None:
                fail("the graph has no attention_mask / input_ids input to build the mask from")
            s, new = "/model/attn_mask", Nodes(g)
            zero, one, axis1, axes12 = (small_constant(g, f"{s}/{n}", np.array(v, dtype=np.int64)) for n, v in
                                        (("zero", 0), ("one", 1), ("axis1", [1]), ("axes12", [1, 2])))
            shapes = [new.add("Shape", [x], f"{s}/Shape_{n}", start=1, end=2)
                      for x, n in ((am, "total"), (ids, "seq"))]
            total, seq = (new.add("Squeeze", [x], f"{s}/Squeeze_{i}") for i, x in enumerate(shapes))
            keys = new.add("Range", [zero, total, one], f"{s}/Range_keys")
            rows = new.add("Range", [zero, seq, one], f"{s}/Range_rows")
            qpos = new.add("Add", [rows, new.add("Sub", [total, seq], f"{s}/Sub_past")], f"{s}/Add_qpos")
            col = new.add("Unsqueeze", [qpos, axis1], f"{s}/Unsqueeze_qpos")
            causal = new.add("LessOrEqual", [keys, col], f"{s}/LessOrEqual")
            pad = new.add("Unsqueeze", [new.add("Cast", [am], f"{s}/Cast", to=int(ir.DataType.BOOL)), axes12],
                          f"{s}/Unsqueeze_pad")
            self.mask = new.add("And", [pad, causal], f"{s}/And")
            g.insert_before(next(iter(g)), new)
        return self.mask


def _const_init(v: ir.Value | None, what: str) -> ir.Value:
    """The initializer behind `v` (through Reshape, as genai shares a packed weight with the embedding)."""
    while v is not None and v.const_value is None:
        r = producer(v, "Reshape")
        if r is None:
            fail(f"{what} is not a constant initializer")
        v = r.inputs[0]
    if v is None:
        fail(f"{what} is missing")
    return v


# ---- RMSNorm --------------------------------------------------------------------------------

def _simplified_ln(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """SimplifiedLayerNormalization(x, w) -> RMSNormalization(x, w): the same op under its standard name."""
    if len(n.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in n.outputs[1:]):
        fail("its inv_std_var output is read (RMSNormalization has no such output)")
    rms = new_node(graph, "RMSNormalization", [n.inputs[0], n.inputs[1]], f"{n.name}/RMSNormalization",
                   axis=attr(n, "axis", -1), epsilon=attr(n, "epsilon", 1e-5), stash_type=attr(n, "stash_type", 1))
    graph.insert_before(n, rms)
    take_over(n.outputs[0], rms.outputs[0])
    return n.name


def _skip_simplified_ln(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """SkipSimplifiedLayerNormalization(x, skip, w[, bias]) -> s = x + skip [+ bias]; RMSNormalization(s, w).
    Output 3 (the sum) is s; outputs 1 and 2 (mean, inv_std_var) must be unread."""
    for i in (1, 2):
        if len(n.outputs) > i and (n.outputs[i].uses() or n.outputs[i].is_graph_output()):
            fail(f"its output {i} (mean / inv_std_var) is read")
    new = Nodes(graph)
    total = new.add("Add", [n.inputs[0], n.inputs[1]], f"{n.name}/Add")
    if input_at(n, 3) is not None:
        total = new.add("Add", [total, n.inputs[3]], f"{n.name}/Add_bias")
    rms = new.add("RMSNormalization", [total, n.inputs[2]], f"{n.name}/RMSNormalization",
                  axis=-1, epsilon=attr(n, "epsilon", 1e-5), stash_type=1)
    graph.insert_before(n, new)
    take_over(n.outputs[0], rms)
    if len(n.outputs) > 3:
        take_over(n.outputs[3], total)
    return n.name


# ---- blocked 4/8-bit weights ----------------------------------------------------------------

def _unpack(packed: np.ndarray, rows: int, bits: int) -> np.ndarray:
    """[rows, ...] uint8 holding `bits`-bit values (low nibble first) -> [rows, values] uint8."""
    b = packed.reshape(rows, -1).astype(np.uint8)
    if bits == 8:
        return b
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(rows, -1)


def _blocked_weight(graph: ir.Graph, n: ir.Node, data: ir.Value, scales: ir.Value, zeros: ir.Value | None,
                    bits: int, rows: int, cols: int, block: int, transpose: bool, base: str) -> ir.Node:
    """DequantizeLinear over genai's [rows, blocks, bytes] layout: rows = N (MatMulNBits, stored
    transposed to [K, N], blocks along axis 0) or the vocabulary (GatherBlockQuantized, axis 1)."""
    if bits not in (4, 8):
        fail(f"bits = {bits}; DequantizeLinear takes uint4 / uint8")
    n_blocks = -(-cols // block)
    qtype = ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8
    npq = ml_dtypes.uint4 if bits == 4 else np.uint8
    if scales.const_value.size != rows * n_blocks:
        fail(f"scales hold {scales.const_value.size} values, not {rows} × {n_blocks} blocks")
    if zeros is not None:
        if zeros.const_value.dtype != ir.DataType.UINT8:
            fail(f"zero points are {zeros.const_value.dtype}, not packed uint8 (float zero points have no standard form)")
    out_shape = [cols, rows] if transpose else [rows, cols]
    sc_shape = [n_blocks, rows] if transpose else [rows, n_blocks]

    def orient(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.T) if transpose else a

    def weight() -> np.ndarray:
        return orient(_unpack(data.const_value.numpy(), rows, bits)[:, :cols]).astype(npq)

    def scale() -> np.ndarray:
        return orient(scales.const_value.numpy().reshape(rows, n_blocks))

    def zero() -> np.ndarray:
        if zeros is None:
            return np.full(sc_shape, 1 << (bits - 1), dtype=npq)  # the contrib ops' default: the middle
        return orient(_unpack(zeros.const_value.numpy(), rows, bits)[:, :n_blocks]).astype(npq)

    q = lazy_initializer(graph, f"{base}.qweight", qtype, out_shape, weight)
    s = lazy_initializer(graph, f"{base}.scales", scales.const_value.dtype, sc_shape, scale)
    z = lazy_initializer(graph, f"{base}.zero_points", qtype, sc_shape, zero)
    return new_node(graph, "DequantizeLinear", [q, s, z], f"{n.name}/DequantizeLinear",
                    axis=0 if transpose else 1, block_size=block)


def _weight_base(v: ir.Value) -> str:
    name = v.name or "weight"
    for suffix in ("_Q4", "_Q8", "_Q2"):
        name = name.removesuffix(suffix)
    return name


def _matmul_nbits(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """MatMulNBits(A, B, scales[, zero_points][, g_idx][, bias]) -> MatMul(A, DequantizeLinear(W, s, z)) [+ bias]."""
    if input_at(n, 4) is not None:
        fail("g_idx (act-order) has no blocked DequantizeLinear form")
    k, cols = attr(n, "K"), attr(n, "N")
    data = _const_init(n.inputs[1], "the packed weight")
    scales = _const_init(n.inputs[2], "the scales")
    zeros = _const_init(n.inputs[3], "the zero points") if input_at(n, 3) is not None else None
    dq = _blocked_weight(graph, n, data, scales, zeros, attr(n, "bits", 4), cols, k, attr(n, "block_size"),
                         True, _weight_base(data))
    new = Nodes(graph, [dq])
    out = new.add("MatMul", [n.inputs[0], dq.outputs[0]], f"{n.name.removesuffix('_Q4').removesuffix('_Q8')}")
    if input_at(n, 5) is not None:
        out = new.add("Add", [out, n.inputs[5]], f"{new[-1].name}/Add")
    graph.insert_before(n, new)
    take_over(n.outputs[0], out)
    return n.name


def _gather_block_quantized(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """GatherBlockQuantized(data, indices, scales[, zero_points]) (the int4 embedding) ->
    Gather(DequantizeLinear(table), indices)."""
    if attr(n, "gather_axis", 0) != 0 or attr(n, "quantize_axis", 1) not in (1, -1):
        fail("only a gather over rows of a table quantized along its last axis has this form")
    data = _const_init(n.inputs[0], "the packed table")
    scales = _const_init(n.inputs[2], "the scales")
    zeros = _const_init(n.inputs[3], "the zero points") if input_at(n, 3) is not None else None
    bits, block = attr(n, "bits", 4), attr(n, "block_size", 128)
    rows = scales.const_value.shape[0]
    cols = scales.const_value.size // rows * block
    if data.const_value.size * 8 // bits != rows * cols:
        fail(f"the table holds {data.const_value.size} bytes, not {rows} × {cols} {bits}-bit values")
    dq = _blocked_weight(graph, n, data, scales, zeros, bits, rows, cols, block, False, _weight_base(data) + ".embed")
    gather = new_node(graph, "Gather", [dq.outputs[0], n.inputs[1]], f"{n.name}/Gather", axis=0)
    graph.insert_before(n, [dq, gather])
    take_over(n.outputs[0], gather.outputs[0])
    return n.name


# ---- rotary embeddings and attention --------------------------------------------------------

def rope_from_cache(cos: ir.Value | None, sin: ir.Value | None) -> tuple[np.ndarray, float]:
    """(inv_freq, attention_scaling) for GQA / RotaryEmbedding cos/sin caches [positions, rotary_dim/2]."""
    if cos is None or sin is None or cos.const_value is None or sin.const_value is None:
        fail("the cos/sin caches are not constants")
    return inv_freq_from_tables(cos.const_value.numpy(), sin.const_value.numpy())


def _rope(new: Nodes, x: ir.Value, heads: int, head_dim: int, inv: np.ndarray, scaling: float,
          interleaved: int, pos: ir.Value, scope: str) -> ir.Value:
    """[B, S, heads·D] -> Reshape -> FusedRoPE -> Reshape -> [B, S, heads·D], the nodes added to `new`."""
    to4 = small_constant(new.graph, f"{scope}/shape4", np.array([0, 0, heads, head_dim], dtype=np.int64))
    to3 = small_constant(new.graph, f"{scope}/shape3", np.array([0, 0, heads * head_dim], dtype=np.int64))
    r1 = new.add("Reshape", [x, to4], f"{scope}/Reshape")
    new.append(rope_node(new.graph, r1, pos, f"{scope}/{contract.ROPE_OP}", inv, scaling, interleaved))
    return new.add("Reshape", [new[-1].outputs[0], to3], f"{scope}/Reshape_1")


def _static_last(v: ir.Value | None) -> int | None:
    return v.shape[-1] if v is not None and v.shape is not None and isinstance(v.shape[-1], int) else None


def _gqa(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """GroupQueryAttention(q, k, v | packed qkv, past_k, past_v, seqlens_k, total_len, cos, sin) ->
    [Split] -> FusedRoPE on q and k (inv_freq from the caches) -> Attention-23 (3-D q/k/v, the
    past, a boolean causal + padding mask from attention_mask)."""
    heads, kv_heads = attr(n, "num_heads"), attr(n, "kv_num_heads")
    if not heads or not kv_heads or heads % kv_heads:
        fail(f"num_heads {heads} is not a multiple of kv_num_heads {kv_heads}")
    if attr(n, "local_window_size", -1) != -1:
        fail("local_window_size (sliding window) has no Attention-23 attribute")
    if attr(n, "smooth_softmax", 0) or attr(n, "qk_output", 0):
        fail("smooth_softmax / qk_output have no Attention-23 equivalent")
    for i, what in ((10, "attention_bias"), (11, "head_sink")):
        if input_at(n, i) is not None:
            fail(f"a {what} input has no Attention-23 equivalent here")
    if len(n.outputs) < 3 or input_at(n, 3) is None or input_at(n, 4) is None:
        fail("no past_key / past_value inputs and present outputs")
    q, k, v = n.inputs[0], input_at(n, 1), input_at(n, 2)
    width = _static_last(q)
    if width is None:
        fail("the query's last dim is not static (head size unknown)")
    packed = k is None
    head_dim = width // (heads + 2 * kv_heads) if packed else width // heads
    scope = n.name.rsplit("/", 1)[0] if "/" in (n.name or "") else (n.name or "attn")
    new = Nodes(graph)
    if packed:
        sizes = small_constant(graph, f"{scope}/qkv_sizes",
                               np.array([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dtype=np.int64))
        q, k, v = new.add("Split", [q, sizes], f"{scope}/qkv/Split", outputs=3, axis=-1)
    if attr(n, "do_rotary", 0):
        inv, scaling = rope_from_cache(input_at(n, 7), input_at(n, 8))
        if 2 * len(inv) > head_dim:
            fail(f"the cos/sin caches rotate {2 * len(inv)} dims, more than the head size {head_dim}")
        pos = input_at(n, 9) if input_at(n, 9) is not None else shared.position_ids()
        inter = attr(n, "rotary_interleaved", 0)
        q = _rope(new, q, heads, head_dim, inv, scaling, inter, pos, f"{scope}/q_rope")
        k = _rope(new, k, kv_heads, head_dim, inv, scaling, inter, pos, f"{scope}/k_rope")
    scale = attr(n, "scale", 0.0) or None
    softcap = attr(n, "softcap", 0.0) or None
    att = new.add("Attention", [q, k, v, shared.key_mask(), n.inputs[3], n.inputs[4]], f"{scope}/Attention",
                  outputs=3, q_num_heads=heads, kv_num_heads=kv_heads, scale=scale, softcap=softcap)
    graph.insert_before(n, new)
    for old, out in zip(n.outputs[:3], att, strict=True):
        take_over(old, out)
    for past, present in ((n.inputs[3], att[1]), (n.inputs[4], att[2])):
        _static_head_dim(past, kv_heads, head_dim)
        _static_head_dim(present, kv_heads, head_dim)
    return scope


def _static_head_dim(v: ir.Value, kv_heads: int, head_dim: int) -> None:
    """The builder writes the cache's head dim symbolic ('kv_cache_dim'); the contract has it static."""
    if v.shape is not None and v.shape.rank() == 4:
        dims = list(v.shape.dims)
        v.shape = ir.Shape([dims[0], kv_heads, dims[2], head_dim])


def _rotary(graph: ir.Graph, n: ir.Node, shared: _Shared) -> str:
    """com.microsoft RotaryEmbedding(x [B, S, H·D], position_ids [B, S], cos, sin) -> FusedRoPE."""
    if attr(n, "is_packed_batching", 0):
        fail("packed batching has no FusedRoPE form")
    x, pos = n.inputs[0], n.inputs[1]
    if x.shape is None or x.shape.rank() != 3:
        fail("the input is not 3-D [batch, seq, hidden]")
    if pos.shape is not None and pos.shape.rank() != 2:
        fail("position_ids are not [batch, seq] (a scalar offset has no FusedRoPE form)")
    inv, scaling = rope_from_cache(input_at(n, 2), input_at(n, 3))
    heads, width = attr(n, "num_heads", 0), _static_last(x)
    if width is None:
        fail("the hidden size is not static")
    rot = attr(n, "rotary_embedding_dim", 0) or 2 * len(inv)
    if rot != 2 * len(inv):
        fail(f"rotary_embedding_dim {rot} does not match the caches' {2 * len(inv)}")
    heads = heads or width // rot
    if width % heads:
        fail(f"hidden {width} is not a multiple of num_heads {heads}")
    new = Nodes(graph)
    out = _rope(new, x, heads, width // heads, inv, scaling, attr(n, "interleaved", 0), pos, n.name or "rope")
    graph.insert_before(n, new)
    take_over(n.outputs[0], out)
    return n.name


MAPPED: dict[str, Callable[[ir.Graph, ir.Node, _Shared], str]] = {
    "SimplifiedLayerNormalization": _simplified_ln,
    "SkipSimplifiedLayerNormalization": _skip_simplified_ln,
    "MatMulNBits": _matmul_nbits,
    "GatherBlockQuantized": _gather_block_quantized,
    "GroupQueryAttention": _gqa,
    "RotaryEmbedding": _rotary,
}


class FromGenAI(Pass):
    """onnxruntime contrib ops (as onnxruntime-genai's builder writes them) -> standard ops.

    SimplifiedLayerNormalization -> RMSNormalization; SkipSimplifiedLayerNormalization -> Add (+ bias
    Add) + RMSNormalization (its sum output is the Add); MatMulNBits -> blocked DequantizeLinear
    (uint4/uint8, weights re-laid [K, N] when written) + MatMul (+ bias Add); GatherBlockQuantized
    -> DequantizeLinear + Gather; GroupQueryAttention -> [Split of packed qkv] + FusedRoPE on q and k
    (inv_freq and attention_scaling recovered from its cos/sin caches) + Attention-23 (3-D, the past,
    a boolean [B, 1, S, T] mask: causal bottom-right and attention_mask's padding); RotaryEmbedding -> FusedRoPE. A
    `position_ids` graph input is added when the graph has none (the contract's input; GQA derived
    positions from the mask, which agrees for unpadded rows).
    Refuses (FuselmError naming node and op, exit 2): a contrib op not in this list, and one whose
    meaning has no standard form here: g_idx, float zero points, bits other than 4/8; sliding
    window, smooth softmax, attention bias or head sinks; cos/sin caches that are not
    cos/sin(position × inv_freq); packed batching. Does nothing on a graph without contrib ops.
    """

    aliases = ("from-genai", "genai")

    def apply(self, model: ir.Model, stats: Stats) -> bool:
        graph = model.graph
        nodes = [n for n in graph if n.domain == ORT_DOMAIN
                 or (n.domain in ("", "ai.onnx") and n.op_type in ORT_ONNX_DOMAIN_CONTRIB)]
        if not nodes:
            return False
        shared = _Shared(graph)
        for n in nodes:
            mapper = MAPPED.get(n.op_type)
            try:
                if mapper is None:
                    fail("fuselm maps only " + ", ".join(MAPPED))
                stats.fire(mapper(graph, n, shared))
            except Reject as r:
                raise FuselmError(f"node {shown(n.name, 80)} ({n.domain or 'ai.onnx'}::{n.op_type}) has no standard "
                                  f"ONNX equivalent fuselm can map: {r}. The file is fine; export the model with "
                                  "torch.onnx or `fuselm convert` the checkpoint instead") from None
            graph.remove(n, safe=True)
            stats.counts[n.op_type] += 1
        _fix_constant_shapes(graph)
        if not any(x.domain == ORT_DOMAIN for x in graph):
            model.opset_imports.pop(ORT_DOMAIN, None)
        attach_functions(model)
        return True


def _fix_constant_shapes(graph: ir.Graph) -> None:
    """The builder's value_info gives some Constant outputs the wrong rank ([1] as a scalar): take the
    constant's own shape, so the checker's shape inference agrees."""
    for n in graph:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx") and "value" in n.attributes:
            n.outputs[0].shape = ir.Shape(n.attributes["value"].as_tensor().shape)
