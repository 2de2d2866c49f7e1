"""Precisions: blockwise asymmetric quantization and the plan that says how each weight is stored.

Quantized weights (q8 / q4) are uint8 / uint4 with a float32 scale and a zero point of the same
integer type per block of `block_size` consecutive values along the INPUT dimension:
    w ~= (q - zero_point) * scale
stored for a linear layer as [in, out] (`.qweight`), scales and zero points [ceil(in/block), out]
(`.scales`, `.zero_points`) and written as `DequantizeLinear(axis=0, block_size) -> MatMul`.
uint4 is packed two per byte, the first element in the low nibble (ONNX's layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError

from .graph import Builder

PRECISIONS = ("f32", "f16", "q8", "q4")
BLOCK_SIZES = (32, 64, 128)
_BITS = {"q8": 8, "q4": 4}
_QTYPE = {8: TensorProto.UINT8, 4: TensorProto.UINT4}


def quantize(w: np.ndarray, bits: int, block: int, axis: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [rows, cols] in blocks of `block` consecutive values along `axis` -> (q like w, scales,
    zero_points with that axis shrunk to ceil(n/block)); q and zero points are uint8 holding
    `bits`-bit values. axis 0 suits the [in, out] storage of linear weights, 1 the embedding rows
    and HF's [out, in] linear weights (`quantize_linear`).

    Each block's range is widened to include 0, so 0 is exact and the zero point fits. Both axes
    work in place of the layout they get (no float32 transpose: that was most of a convert's time),
    with one arithmetic, so quantize(w.T, axis=0) is quantize(w, axis=1) transposed, bit for bit.
    """
    n = w.shape[axis]
    nblk = -(-n // block)
    if n % block:  # a ragged last block: pad with copies of its first value (changes no min/max)
        first = w[(nblk - 1) * block:][:1] if axis == 0 else w[:, (nblk - 1) * block:][:, :1]
        w = np.concatenate([w, np.repeat(first, nblk * block - n, axis=axis)], axis=axis)
    if axis == 0:  # [nblk, block, cols]: numpy reduces the middle axis vectorised over cols
        blocks = w.reshape(nblk, block, w.shape[1])
        lo, hi = blocks.min(axis=1), blocks.max(axis=1)
        expand = (slice(None), None)
    else:  # [rows, nblk, block]: torch reduces short contiguous runs ~10x faster than numpy
        import torch

        blocks = np.ascontiguousarray(w).reshape(w.shape[0], nblk, block)
        t = torch.from_numpy(blocks)
        lo, hi = t.amin(-1).numpy(), t.amax(-1).numpy()
        expand = (Ellipsis, None)
    scale, zp = _scale_zero_point(lo, hi, float(2**bits - 1))
    q = blocks / scale[expand]
    np.round(q, out=q)
    q += zp[expand]
    np.clip(q, 0, float(2**bits - 1), out=q)
    q = q.reshape(w.shape)
    q = q[:n] if axis == 0 else q[:, :n]
    return q.astype(np.uint8), scale, zp.astype(np.uint8)


def _scale_zero_point(lo: np.ndarray, hi: np.ndarray, qmax: float) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    scale = ((hi - lo) / qmax).astype(np.float32)
    scale[scale == 0] = 1.0  # an all-zero block: any scale is exact
    return scale, np.clip(np.round(-lo / scale), 0, qmax)


def quantize_linear(w: np.ndarray, bits: int, block: int) -> list:
    """An HF Linear weight [out, in] -> (q, scales, zero_points) of its [in, out] storage, blocks along
    in: quantized in HF's layout, then only the uint8 / small results transposed (4-bit ones packed
    first, so the transpose moves half the bytes)."""
    q, s, z = quantize(w, bits, block, axis=1)
    if bits == 4:
        return [_packed_transpose(q), transpose(s), _packed_transpose(z)]
    return [transpose(q), transpose(s), transpose(z)]


@dataclass(frozen=True)
class Packed:
    """uint4 values already packed in ONNX's order (exporter/weights.py writes the bytes as they are):
    `data` uint8 [rows, cols / 2] for a [rows, cols] uint4 tensor."""

    data: np.ndarray


def _packed_transpose(v: np.ndarray) -> Packed | np.ndarray:
    """uint4 values v [out, k] -> v.T [k, out] packed: byte (i, o/2) holds v[o, i] low, v[o+1, i] high,
    i.e. pairs of v's rows packed, then transposed. An odd `out` stays unpacked (the writer packs it)."""
    if v.shape[0] % 2:
        return transpose(v)
    return Packed(transpose(v[0::2] | (v[1::2] << 4)))


def dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray, block: int, axis: int = 0) -> np.ndarray:
    """Inverse of `quantize` (for references and tests)."""
    n = q.shape[axis]
    s = np.repeat(scale, block, axis=axis).take(range(n), axis=axis)
    z = np.repeat(zp.astype(np.float32), block, axis=axis).take(range(n), axis=axis)
    return (q.astype(np.float32) - z) * s


def transpose(w: np.ndarray) -> np.ndarray:
    """A contiguous w.T (torch's blocked transpose is ~4x faster than numpy's on big matrices, uint8 ones too)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(w)).T.contiguous().numpy()


def pack_uint4(values: np.ndarray) -> bytes:
    """uint4 values (uint8 holding 0..15) -> ONNX packing: two per byte, first in the low nibble."""
    v = np.asarray(values, dtype=np.uint8).ravel()
    if v.size % 2:
        v = np.concatenate([v, np.zeros(1, np.uint8)])
    return (v[0::2] | (v[1::2] << 4)).tobytes()


def unpack_uint4(data: bytes, count: int) -> np.ndarray:
    b = np.frombuffer(data, np.uint8)
    return np.stack([b & 0x0F, b >> 4], axis=1).ravel()[:count]


@dataclass(frozen=True)
class Precision:
    """How one class of tensors is stored: f32, f16 or quantized (bits, block)."""

    kind: str  # f32 | f16 | q8 | q4
    block: int = 32

    @property
    def bits(self) -> int:
        return {"f32": 32, "f16": 16}.get(self.kind) or _BITS[self.kind]

    def describe(self) -> dict:
        if self.kind in _BITS:
            return {"bits": self.bits, "block_size": self.block, "symmetric": False,
                    "dtype": f"uint{self.bits}", "scale_dtype": "float32", "zero_point_dtype": f"uint{self.bits}"}
        return {"bits": self.bits, "dtype": {"f32": "float32", "f16": "float16"}[self.kind]}


class Plan:
    """Emits the storage of each weight (initializers + the nodes that make it float32).

    `shapes` holds every checkpoint tensor's HF shape; the builders below register WeightJobs.
    Norm weights and biases always stay float32 (tiny, and HF computes them in float32).
    """

    def __init__(self, linear: Precision, embed: Precision, lm_head: Precision, shapes: dict[str, tuple]):
        self.linear, self.embed, self.lm_head, self.shapes = linear, embed, lm_head, shapes
        self._table: tuple[str, ...] | None = None  # the quantized embedding's initializers (q, scales, zp)
        self._table_dq: str | None = None  # their DequantizeLinear over the whole table, when there is one

    def shares_table(self, tied: bool) -> bool:
        """A tied head at the embedding's precision reads the embedding's tensor (stored once)."""
        return tied and self.lm_head == self.embed

    def vector(self, b: Builder, name: str, layer: int | None) -> str:
        return b.weight(name, layer, lambda w: [w], [(name, TensorProto.FLOAT, self.shapes[name], False)])[0]

    def linear_weight(self, b: Builder, name: str, scope: str, layer: int | None,
                      precision: Precision | None = None, out_name: str | None = None) -> str:
        """An HF Linear weight [out, in] as a float32 [in, out] value for MatMul."""
        p = precision or self.linear
        out_name = out_name or name
        n_out, n_in = self.shapes[name]
        if p.kind == "f32":
            return b.weight(name, layer, lambda w: [transpose(w)], [(out_name, TensorProto.FLOAT, (n_in, n_out), True)])[0]
        if p.kind == "f16":
            w16 = b.weight(name, layer, lambda w: [transpose(w.astype(np.float16))],
                           [(out_name, TensorProto.FLOAT16, (n_in, n_out), True)])[0]
            return b.op("Cast", w16, name=f"{scope}/Cast", to=TensorProto.FLOAT)
        nblk = -(-n_in // p.block)

        def encode(w, p=p):
            return quantize_linear(w, p.bits, p.block)

        qtype = _QTYPE[p.bits]
        q, s, z = b.weight(name, layer, encode, [(f"{out_name}.qweight", qtype, (n_in, n_out), True),
                                                 (f"{out_name}.scales", TensorProto.FLOAT, (nblk, n_out), True),
                                                 (f"{out_name}.zero_points", qtype, (nblk, n_out), True)])
        return b.op("DequantizeLinear", q, s, z, name=f"{scope}/DequantizeLinear", axis=0, block_size=p.block)

    def embedding(self, b: Builder, name: str, ids: str, scope: str | None = None) -> str:
        """Gather of the embedding table [vocab, hidden] -> float32 [B,S,hidden]. `scope`: another table gathered
        by the ids (Gemma's per-layer embeddings) under its own node scope, never shared with the head."""
        p, head_table, scope = self.embed, scope is None, scope or "/model/embed_tokens"
        vocab, hidden = self.shapes[name]
        if p.kind == "f32":
            w = b.weight(name, None, lambda w: [w], [(name, TensorProto.FLOAT, (vocab, hidden), False)])[0]
            return b.op("Gather", w, ids, name=f"{scope}/Gather", axis=0)
        if p.kind == "f16":
            w = b.weight(name, None, lambda w: [w.astype(np.float16)], [(name, TensorProto.FLOAT16, (vocab, hidden), False)])[0]
            rows = b.op("Gather", w, ids, name=f"{scope}/Gather", axis=0)
            return b.op("Cast", rows, name=f"{scope}/Cast", to=TensorProto.FLOAT)
        nblk = -(-hidden // p.block)
        qtype = _QTYPE[p.bits]
        q, s, z = b.weight(name, None, lambda w: list(quantize(w, p.bits, p.block, axis=1)),
                           [(f"{name}.qweight", qtype, (vocab, hidden), False),
                            (f"{name}.scales", TensorProto.FLOAT, (vocab, nblk), False),
                            (f"{name}.zero_points", qtype, (vocab, nblk), False)])
        if head_table:
            self._table = (q, s, z)
        if p.bits == 8:
            # Gather the quantized rows first, then dequantize only those (axis 2 of [B,S,hidden]).
            q, s, z = (b.op("Gather", t, ids, name=f"{scope}/{part}/Gather", axis=0)
                       for t, part in zip((q, s, z), ("qweight", "scales", "zero_points"), strict=True))
            return b.op("DequantizeLinear", q, s, z, name=f"{scope}/DequantizeLinear", axis=2, block_size=p.block)
        # ONNX Gather has no 4-bit types: dequantize the table, then gather (a runtime folds this).
        table = b.op("DequantizeLinear", q, s, z, name=f"{scope}/DequantizeLinear", axis=1, block_size=p.block)
        if head_table:
            self._table_dq = table
        return b.op("Gather", table, ids, name=f"{scope}/Gather", axis=0)

    def logits(self, b: Builder, x: str, embed_name: str, head_name: str | None) -> str:
        """lm_head MatMul. head_name None = tied: share the embedding's tensor when it has the same
        precision (MatMul on the Transpose of the [vocab, hidden] table: for a quantized table,
        of its DequantizeLinear, blocks along hidden either way), else write a copy under
        `lm_head.weight`."""
        return b.op("MatMul", x, self.head_weight(b, embed_name, head_name), name="/model/lm_head/MatMul", out=contract.LOGITS)

    def head_weight(self, b: Builder, embed_name: str, head_name: str | None) -> str:
        """The lm_head weight as float32 [hidden, vocab] (see `logits`)."""
        scope = "/model/lm_head"
        if self.shares_table(head_name is None):
            if self.embed.kind in ("f32", "f16"):
                table = embed_name
                if self.embed.kind == "f16":
                    table = b.op("Cast", table, name=f"{scope}/Cast", to=TensorProto.FLOAT)
            else:  # the 8-bit embedding dequantizes gathered rows only: the head needs its own DQ
                table = self._table_dq or b.op("DequantizeLinear", *self._table, name=f"{scope}/DequantizeLinear",
                                               axis=1, block_size=self.embed.block)
            return b.op("Transpose", table, name=f"{scope}/Transpose", perm=[1, 0])
        return self.linear_weight(b, head_name or embed_name, scope, None, self.lm_head, out_name="lm_head.weight")


def precisions(quant: str, block_size: int, lm_head: str | None, embed: str | None,
               tied: bool = False) -> tuple[Precision, Precision, Precision]:
    """(linear, embed, lm_head) precisions from the CLI flags, with the documented defaults
    (chosen by bench/head_formats.py; README "Defaults"): the lm_head q8 when quantizing, else as --quant;
    the embedding of a
    tied checkpoint at the head's precision (one stored tensor serves both), of an untied one f16
    when quantizing, else as --quant."""
    for flag, value in (("--quant", quant), ("--lm-head", lm_head), ("--embed", embed)):
        if value is not None and value not in PRECISIONS:
            raise FuselmError(f"{flag} {value!r} is not a precision; choose one of {', '.join(PRECISIONS)}")
    if block_size not in BLOCK_SIZES:
        raise FuselmError(f"--block-size {block_size} is not supported; choose one of {', '.join(map(str, BLOCK_SIZES))}")
    quantized = quant in _BITS
    head = lm_head or ("q8" if quantized else quant)  # q4 flattened a trained tiny model's greedy text
    emb = embed or (head if tied else "f16" if quantized else quant)
    return Precision(quant, block_size), Precision(emb, block_size), Precision(head, block_size)
