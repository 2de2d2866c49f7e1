"""OrtMatMulNBits (target onnxruntime): blocked 4/8-bit DequantizeLinear + MatMul -> com.microsoft.MatMulNBits."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from fuselm import contract
from fuselm.graphcheck import ORT_DOMAIN

from .base import Fusion, attr, fail, input_at, lazy_initializer, new_node, producer, take_over

DEFAULT_ACCURACY_LEVEL = contract.ORT_ACCURACY_LEVEL  # as onnxruntime-genai's builder writes CPU int4
_UNSIGNED = {ir.DataType.UINT4: 4, ir.DataType.UINT8: 8}
_SIGNED = {ir.DataType.INT4: 4, ir.DataType.INT8: 8}


@dataclass
class Blocked:
    """A blocked DequantizeLinear weight seen as MatMulNBits sees it: N rows of K values."""

    q: ir.Value
    scale: ir.Value
    zero: ir.Value | None
    bits: int
    signed: bool
    block: int
    n: int
    k: int
    rows_first: bool  # q is [N, K] blocked along axis 1 (a tied lm_head); else [K, N] along axis 0


def blocked_weight(dq: ir.Node, rows_first: bool) -> Blocked:
    """The weight of a blocked DequantizeLinear over constants, or fail() saying why MatMulNBits cannot take it."""
    q, scale = dq.inputs[0], dq.inputs[1]
    zero = input_at(dq, 2)
    for v, what in ((q, "quantized data"), (scale, "scale"), (zero, "zero point")):
        if v is not None and (v.const_value is None or v.shape is None):
            fail(f"the {what} is not a constant initializer")
    block = attr(dq, "block_size", 0)
    if not block:
        fail("not blocked (block_size 0: per-tensor or per-channel scales; MatMulNBits takes blocks along K)")
    if block < 16 or block & (block - 1):
        fail(f"block_size {block} is not a power of two >= 16 (MatMulNBits' blocks)")
    if q.shape.rank() != 2:
        fail(f"quantized data of rank {q.shape.rank()}, not 2")
    axis = attr(dq, "axis", 1) % 2
    if axis != (1 if rows_first else 0):
        fail(f"blocked along axis {axis}, not along the MatMul's inner (K) dimension")
    dtype = q.const_value.dtype
    bits = _UNSIGNED.get(dtype) or _SIGNED.get(dtype)
    if bits is None:
        fail(f"quantized data is {dtype}, not uint4/int4/uint8/int8")
    if attr(dq, "output_dtype", 0) not in (0, int(ir.DataType.FLOAT)) or scale.const_value.dtype != ir.DataType.FLOAT:
        fail(f"scales are {scale.const_value.dtype}; the lowering takes float32 scales (the float32 graph)")
    if zero is not None and zero.const_value.dtype != dtype:
        fail(f"zero points are {zero.const_value.dtype}, not {dtype}")
    n, k = (q.shape[0], q.shape[1]) if rows_first else (q.shape[1], q.shape[0])
    blocks = -(-k // block)
    want = [n, blocks] if rows_first else [blocks, n]
    if list(scale.shape) != want:
        fail(f"scales of shape {list(scale.shape)}, not {want}")
    return Blocked(q, scale, zero, bits, dtype in _SIGNED, block, n, k, rows_first)


def _unsigned(w: Blocked, v: ir.Value) -> np.ndarray:
    """Data or zero points as uint8 values 0..2^bits-1 in their own layout (signed ones shifted by 2^(bits-1)).
    4-bit arrays hold one value per byte, its two's-complement nibble in the low bits: read as bytes, no cast."""
    a = v.const_value.numpy()
    b = a.view(np.uint8) if a.dtype.itemsize == 1 else a.astype(np.int16).astype(np.uint8)
    if w.bits == 4:
        b = b & 0x0F
    return b ^ np.uint8(1 << (w.bits - 1)) if w.signed else b


def _packed_rows(w: Blocked, v: ir.Value, length: int) -> np.ndarray:
    """[N, ceil(length·bits/8)] uint8: v's values per output row, padded with zeros to `length` along K and
    packed two 4-bit values a byte (low nibble first). A [K, N] weight is packed along K before it is
    transposed, so the (slow, strided) transpose moves bytes, half as many as there are values."""
    a = _unsigned(w, v)
    axis = 1 if w.rows_first else 0
    pad = length + (length % 2 if w.bits == 4 else 0) - a.shape[axis]
    if pad:
        a = np.pad(a, ((0, 0), (0, pad)) if w.rows_first else ((0, pad), (0, 0)))
    if w.bits == 4:
        a = a[:, 0::2] | (a[:, 1::2] << 4) if w.rows_first else a[0::2] | (a[1::2] << 4)
    return a if w.rows_first else np.ascontiguousarray(a.T)


def _lazy(graph: ir.Graph, name: str, dtype: ir.DataType, shape: list[int], build) -> ir.Value:
    """An initializer computed when the model is written; one per name (a tied weight is packed once)."""
    found = graph.initializers.get(name)
    if found is not None and list(found.shape) == shape:
        return found
    return lazy_initializer(graph, name, dtype, shape, build)


def nbits_tensors(graph: ir.Graph, w: Blocked) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(B [N, blocks, block·bits/8] uint8, scales [N, blocks], zero points [N·ceil(blocks·bits/8)] uint8)
    in MatMulNBits' layout, built lazily from the DequantizeLinear's initializers."""
    blocks = -(-w.k // w.block)
    blob = w.block * w.bits // 8
    base = w.q.name.removesuffix(".qweight")

    def data() -> np.ndarray:
        return _packed_rows(w, w.q, blocks * w.block).reshape(w.n, blocks, blob)

    def scales() -> np.ndarray:
        s = w.scale.const_value.numpy()
        return np.ascontiguousarray(s if w.rows_first else s.T)

    def zeros() -> np.ndarray:
        if w.zero is None:  # DequantizeLinear's default zero point is 0 (the middle, for signed data)
            z = np.full((w.n, blocks), (1 << (w.bits - 1)) if w.signed else 0, dtype=np.uint8)
            if w.bits == 4:
                z = np.pad(z, ((0, 0), (0, blocks % 2)))
                z = z[:, 0::2] | (z[:, 1::2] << 4)
            return z.reshape(-1)
        return _packed_rows(w, w.zero, blocks).reshape(-1)

    zlen = w.n * -(-blocks * w.bits // 8)
    return (_lazy(graph, f"{base}.nbits", ir.DataType.UINT8, [w.n, blocks, blob], data),
            _lazy(graph, f"{base}.nbits_scales", ir.DataType.FLOAT, [w.n, blocks], scales),
            _lazy(graph, f"{base}.nbits_zero_points", ir.DataType.UINT8, [zlen], zeros))


@dataclass
class NBitsMatch:
    matmul: ir.Node
    weight: Blocked


class OrtMatMulNBits(Fusion):
    """MatMul(x, DequantizeLinear(q, scale, zp)) -> com.microsoft.MatMulNBits(x, B, scales, zero_points).

    The pattern: a MatMul whose right-hand side is a blocked DequantizeLinear of constants, either
    q [K, N] blocked along axis 0 (every projection, also the fused QKV and gate/up ones) or
    Transpose(DequantizeLinear(q [N, K] blocked along axis 1), [1, 0]) (a tied lm_head reading the
    embedding table). uint4/int4/uint8/int8 data (signed data shifted to unsigned with its zero
    point), float32 scales, block_size a power of two >= 16: MatMulNBits(bits, block_size, K, N,
    accuracy_level) with B packed [N, blocks, block·bits/8] (low nibble first), scales [N, blocks]
    and packed zero points, all computed when the model is written (a tied weight once).
    `accuracy_level` 4 (the default, as onnxruntime-genai's builder writes CPU int4) computes with
    int8 activations; 1 keeps float32 activations (exact against the dequantized MatMul).
    Must not fire (and says why): a DequantizeLinear that is not blocked (per-tensor or per-channel
    scales), blocks along the wrong axis, a block size MatMulNBits does not take, non-constant or
    non-float32 scales, zero points of another type, a weight not 2-D, a DequantizeLinear that is a
    graph output. One that other nodes also read stays for them (a tied embedding's Gather).
    """

    aliases = ("ort-matmul-nbits", "matmul-nbits", "nbits")
    needs_opset = None

    def __init__(self, accuracy_level: int = DEFAULT_ACCURACY_LEVEL):
        if accuracy_level not in range(5):
            from fuselm.errors import FuselmError

            raise FuselmError(f"accuracy level {accuracy_level}: MatMulNBits takes 0..4 (4: int8 activations, "
                              "onnxruntime-genai's CPU default; 1: float32)")
        self.accuracy_level = accuracy_level

    def anchors(self, graph: ir.Graph) -> Iterable[ir.Node]:
        return [n for n in graph if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")
                and producer(n.inputs[1], "DequantizeLinear", "Transpose") is not None]

    def match(self, mm: ir.Node) -> NBitsMatch:
        w = mm.inputs[1]
        tr = producer(w, "Transpose")
        if tr is not None:
            if list(attr(tr, "perm", [1, 0])) != [1, 0]:
                fail(f"the weight is transposed with perm {attr(tr, 'perm')}, not [1, 0]")
            dq = producer(tr.inputs[0], "DequantizeLinear")
            if dq is None:
                fail("the transposed weight is not a DequantizeLinear")
        else:
            dq = producer(w, "DequantizeLinear")
        # A DequantizeLinear others read too stays for them (a tied embedding's Gather, which
        # OrtGatherBlockQuantized lowers next: both then share the packed tensors).
        if dq.outputs[0].is_graph_output():
            fail(f"{dq.name} (DequantizeLinear) is a graph output")
        x = mm.inputs[0]
        if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
            fail(f"the activations are {x.dtype}; the lowering takes float32")
        return NBitsMatch(mm, blocked_weight(dq, rows_first=tr is not None))

    def rewrite(self, graph: ir.Graph, m: NBitsMatch) -> str:
        w = m.weight
        b, s, z = nbits_tensors(graph, w)
        name = m.matmul.name or "MatMul"
        node = new_node(graph, "MatMulNBits", [m.matmul.inputs[0], b, s, z], f"{name}NBits", domain=ORT_DOMAIN,
                        K=w.k, N=w.n, bits=w.bits, block_size=w.block, accuracy_level=self.accuracy_level)
        graph.insert_before(m.matmul, node)
        take_over(m.matmul.outputs[0], node.outputs[0])
        graph.remove(m.matmul, safe=True)
        graph.opset_imports.setdefault(ORT_DOMAIN, 1)
        return name
