"""Precisions: blockwise asymmetric quantization and the plan that says how each weight is stored.

Quantized weights (q8 / q4) are uint8 / uint4 with a float32 scale and a zero point of the same
integer type per block of `block_size` consecutive values along the INPUT dimension:
    w ~= (q - zero_point) * scale
stored for a linear layer as [in, out] (`.qweight`), scales and zero points [ceil(in/block), out]
(`.scales`, `.zero_points`) and written as `DequantizeLinear(axis=0, block_size) -> MatMul`.
uint4 is packed two per byte, the first element in the low nibble (ONNX's layout).

How a block's scale and zero point are chosen is the method (the format stays the same):
- `rtn`: the block's min/max range (round to nearest);
- `mse`: the range, shrunk by up to 10 %, that gives the least squared error of the dequantized block,
  each value's error weighted by its importance: the mean square of the input it multiplies, measured on
  a calibration text (`Recipe.importance`, exporter/calibrate.py), or without calibration its own
  magnitude plus the block's RMS (llama.cpp's weighting: large weights matter more); 8-bit blocks keep
  min/max (with 255 steps clipping did not pay on any block measured, and the search costs time);
- `gptq`: GPTQ (columns quantized in order, each one's error spread over the columns not yet quantized
  through the inverse of the input's second-moment matrix), each block's range chosen as `mse` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError

from .graph import Builder

PRECISIONS = ("f32", "f16", "q8", "q4")
METHODS = ("rtn", "mse", "gptq")
SHRINK = tuple(1.0 - 0.02 * k for k in range(6))  # the ranges `mse` tries: min/max shrunk by 0 .. 10 %
BLOCK_SIZES = (32, 64, 128)
_BITS = {"q8": 8, "q4": 4}
_QTYPE = {8: TensorProto.UINT8, 4: TensorProto.UINT4}


def quantize(w: np.ndarray, bits: int, block: int, axis: int = 0, method: str = "rtn",
             importance: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [rows, cols] in blocks of `block` consecutive values along `axis` -> (q like w, scales,
    zero_points with that axis shrunk to ceil(n/block)); q and zero points are uint8 holding
    `bits`-bit values. axis 0 suits the [in, out] storage of linear weights, 1 the embedding rows
    and HF's [out, in] linear weights (`quantize_linear`).

    Each block's range is widened to include 0, so 0 is exact and the zero point fits. Both axes
    work in place of the layout they get (no float32 transpose: that was most of a convert's time),
    with one arithmetic, so quantize(w.T, axis=0) is quantize(w, axis=1) transposed, bit for bit.
    method `mse` searches each block's range (module docstring), its errors weighted by `importance`
    ([n] along `axis`) when given; `gptq` needs the input's second moments: `gptq` below.
    """
    if method == "mse" and axis == 0:  # the search runs on blocks along rows; the transposes are uint8 / small
        q, s, z = quantize(transpose(w), bits, block, 1, method, importance)
        return transpose(q), transpose(s), transpose(z)
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
    if method == "mse" and bits < 8:
        scale, zp = _search(blocks, scale, zp, lo, hi, float(2**bits - 1), importance, n)
    elif method not in ("rtn", "mse"):
        raise ValueError(f"quantize: method {method!r} (gptq runs through `gptq`)")
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


def _search(blocks: np.ndarray, scale, zp, lo, hi, qmax: float, importance, n: int):
    """Each block's (scale, zero point) among the SHRINK ranges with the least weighted squared error.
    blocks [rows, nblk, block]; the candidates are min/max's arithmetic on the shrunk range, so the
    first one is `rtn`'s result exactly. In place on two buffers (the stream's encode threads run it)."""
    import torch

    t = torch.from_numpy(blocks)
    if importance is None:  # a value's error counts by its magnitude plus the block's RMS (llama.cpp)
        weight = t.abs() + t.square().mean(-1, keepdim=True).sqrt_()
    else:
        imp = np.asarray(importance, np.float32)
        imp = np.concatenate([imp, np.zeros(blocks.shape[1] * blocks.shape[2] - n, np.float32)])  # ragged: padding
        weight = torch.from_numpy(imp.reshape(1, *blocks.shape[1:]))
    lo_t, hi_t = torch.from_numpy(np.minimum(lo, 0)), torch.from_numpy(np.maximum(hi, 0))
    best_s, best_z = torch.from_numpy(scale), torch.from_numpy(np.asarray(zp, np.float32))
    r, d = torch.empty_like(t), torch.empty_like(t)

    def error(s, z):  # sum of weight * (s (clamp(round(t/s) + z) - z) - t)^2 = s^2 sum weight (q - z - t/s)^2
        torch.mul(t, (1.0 / s)[..., None], out=r)
        torch.round(r, out=d)
        d.add_(z[..., None]).clamp_(0, qmax).sub_(z[..., None]).sub_(r).square_().mul_(weight)
        return d.sum(-1).mul_(s.square())

    best_e = error(best_s, best_z)
    for p in SHRINK[1:]:
        s = (hi_t - lo_t) * p / qmax
        s = torch.where(s == 0, torch.ones_like(s), s)
        z = torch.clamp(torch.round(-lo_t * p / s), 0, qmax)
        e = error(s, z)
        better = e < best_e
        best_s, best_z, best_e = torch.where(better, s, best_s), torch.where(better, z, best_z), torch.minimum(e, best_e)
    return best_s.numpy(), best_z.numpy()


def gptq(w: np.ndarray, hessian: np.ndarray, bits: int, block: int, damp: float = 0.01, columns: int = 128,
         search: bool = True):
    """GPTQ (Frantar et al. 2022) of an HF Linear weight w [rows, in] given H = E[x xᵀ] of its input [in, in]:
    -> (q, scales, zero_points) as `quantize(w, axis=1)` returns them. Columns are quantized in order, each
    block's range chosen when the block is reached, by `mse` (weighted by diag(H)) or, `search` off, its min/max;
    each column's rounding error is spread over the later columns through the Cholesky factor of H⁻¹ (lazy
    updates `columns` wide)."""
    import torch

    rows, n = w.shape
    qmax = float(2**bits - 1)
    W = torch.from_numpy(np.array(w, np.float32))
    H = torch.from_numpy(np.array(hessian, np.float32))
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    diag = torch.diagonal(H).clone()
    H += damp * diag.mean() * torch.eye(n)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    nblk = -(-n // block)
    Q = torch.zeros(rows, n)
    S, Z = np.zeros((rows, nblk), np.float32), np.zeros((rows, nblk), np.float32)
    for c0 in range(0, n, columns):
        c1 = min(n, c0 + columns)
        Wc, Err, Uc = W[:, c0:c1].clone(), torch.zeros(rows, c1 - c0), U[c0:c1, c0:c1]
        for i in range(c1 - c0):
            col = c0 + i
            if col % block == 0:  # this block's range, from its columns as the earlier errors left them
                b = col // block
                part = Wc[:, i:i + block].numpy()
                width = part.shape[1]
                if width < block:  # a ragged last block, padded as `quantize` pads it
                    part = np.concatenate([part, np.repeat(part[:, :1], block - width, axis=1)], axis=1)
                _, s_b, z_b = quantize(part, bits, block, axis=1, method="mse" if search else "rtn",
                                       importance=np.pad(diag[col:col + width].numpy(), (0, block - width)))
                S[:, b], Z[:, b] = s_b[:, 0], z_b[:, 0]
                s, z = torch.from_numpy(S[:, b]), torch.from_numpy(Z[:, b].astype(np.float32))
            x = Wc[:, i]
            q = torch.clamp(torch.round(x / s) + z, 0, qmax)
            Q[:, col] = q
            err = (x - (q - z) * s) / Uc[i, i]
            Wc[:, i:] -= err[:, None] * Uc[i, i:][None]
            Err[:, i] = err
        W[:, c1:] -= Err @ U[c0:c1, c1:]
    return Q.numpy().astype(np.uint8), S, Z.astype(np.uint8)


def quantize_linear(w: np.ndarray, bits: int, block: int, method: str = "rtn", importance: np.ndarray | None = None,
                    hessian: np.ndarray | None = None) -> list:
    """An HF Linear weight [out, in] -> (q, scales, zero_points) of its [in, out] storage, blocks along
    in: quantized in HF's layout, then only the uint8 / small results transposed (4-bit ones packed
    first, so the transpose moves half the bytes). `gptq` needs `hessian`."""
    if method == "gptq":
        q, s, z = gptq(w, hessian, bits, block)
    else:
        q, s, z = quantize(w, bits, block, axis=1, method=method, importance=importance)
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
    """Inverse of `quantize`."""
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


@dataclass(frozen=True)
class Precision:
    """How one class of tensors is stored: f32, f16 or quantized (bits, block, the method that picks each
    block's scale and zero point). `recipe`: what a calibration pass measured and the tensors it stores
    otherwise (mixed precision), shared by the three classes of a convert."""

    kind: str  # f32 | f16 | q8 | q4
    block: int = 32
    method: str = "rtn"
    recipe: Recipe | None = field(default=None, compare=False, repr=False)

    @property
    def bits(self) -> int:
        return {"f32": 32, "f16": 16}.get(self.kind) or _BITS[self.kind]

    def bits_per_weight(self) -> float:
        """Stored bits per weight: data, plus a float32 scale and a zero point per block when quantized."""
        return self.bits + (32 + self.bits) / self.block if self.kind in _BITS else float(self.bits)

    def name(self) -> str:
        return f"{self.kind}/{self.block}" if self.kind in _BITS else self.kind

    def describe(self) -> dict:
        if self.kind in _BITS:
            return {"bits": self.bits, "block_size": self.block, "symmetric": False, "method": self.method,
                    "dtype": f"uint{self.bits}", "scale_dtype": "float32", "zero_point_dtype": f"uint{self.bits}"}
        return {"bits": self.bits, "dtype": {"f32": "float32", "f16": "float16"}[self.kind]}


@dataclass
class Recipe:
    """What exporter/calibrate.py measured on a text, for the quantizer: per HF weight name the mean square of
    each input column (`importance`), the input's second moments for GPTQ (`hessians`, arrays on disk), the
    precision of the tensors stored otherwise than their class (`tensors`, mixed precision) and a description
    for fuselm.json."""

    importance: dict[str, np.ndarray] = field(default_factory=dict)
    hessians: dict[str, np.ndarray] = field(default_factory=dict)
    tensors: dict[str, Precision] = field(default_factory=dict)
    describe: dict = field(default_factory=dict)

    def encoder(self, name: str, p: Precision):
        """encode(w rows [r, in]) -> [q, scales, zero points] of `name`'s [in, out] storage at `p`."""
        imp, hess = self.importance.get(name), self.hessians.get(name)
        method = "mse" if p.method == "gptq" and hess is None else p.method
        return lambda w: quantize_linear(w, p.bits, p.block, method, imp, hess)


class Plan:
    """Emits the storage of each weight (initializers + the nodes that make it float32).

    `shapes` holds every checkpoint tensor's HF shape; the builders below register WeightJobs.
    Norm weights and biases always stay float32 (tiny, and HF computes them in float32).
    """

    def __init__(self, linear: Precision, embed: Precision, lm_head: Precision, shapes: dict[str, tuple]):
        self.linear, self.embed, self.lm_head, self.shapes = linear, embed, lm_head, shapes
        self.recipe = linear.recipe or Recipe()
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
        p = self.recipe.tensors.get(name) or precision or self.linear
        out_name = out_name or name
        n_out, n_in = self.shapes[name]
        if p.kind == "f32":
            return b.weight(name, layer, lambda w: [transpose(w)], [(out_name, TensorProto.FLOAT, (n_in, n_out), True)])[0]
        if p.kind == "f16":
            w16 = b.weight(name, layer, lambda w: [transpose(w.astype(np.float16))],
                           [(out_name, TensorProto.FLOAT16, (n_in, n_out), True)])[0]
            return b.op("Cast", w16, name=f"{scope}/Cast", to=TensorProto.FLOAT)
        nblk = -(-n_in // p.block)
        qtype = _QTYPE[p.bits]
        q, s, z = b.weight(name, layer, self.recipe.encoder(name, p), [(f"{out_name}.qweight", qtype, (n_in, n_out), True),
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
        # A tied table is also the head: quantized for its products with the final norm's output (gptq: as a head)
        imp, hess = self.recipe.importance.get(name), self.recipe.hessians.get(name)
        method = "mse" if p.method == "gptq" and hess is None else p.method

        def encode(w, p=p, method=method):  # a tied table's ranges keep its rows' outliers (the input use needs them)
            return list(gptq(w, hess, p.bits, p.block, search=False) if method == "gptq"
                        else quantize(w, p.bits, p.block, axis=1, method=method, importance=imp))

        q, s, z = b.weight(name, None, encode,
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
               tied: bool = False, method: str = "rtn") -> tuple[Precision, Precision, Precision]:
    """(linear, embed, lm_head) precisions from the CLI flags, with the documented defaults (README "Defaults"):
    the lm_head q8 when quantizing, else as --quant; the embedding of a tied checkpoint at the head's precision
    (one stored tensor serves both), of an untied one f16 when quantizing, else as --quant."""
    for flag, value in (("--quant", quant), ("--lm-head", lm_head), ("--embed", embed)):
        if value is not None and value not in PRECISIONS:
            raise FuselmError(f"{flag} {value!r} is not a precision; choose one of {', '.join(PRECISIONS)}")
    if method not in METHODS:
        raise FuselmError(f"--method {method!r} is not a quantization method; choose one of {', '.join(METHODS)}")
    if block_size not in BLOCK_SIZES:
        raise FuselmError(f"--block-size {block_size} is not supported; choose one of {', '.join(map(str, BLOCK_SIZES))}")
    quantized = quant in _BITS
    head = lm_head or ("q8" if quantized else quant)  # q4 flattened a trained tiny model's greedy text
    emb = embed or (head if tied else "f16" if quantized else quant)
    return tuple(Precision(kind, block_size, method if kind in _BITS else "rtn") for kind in (quant, emb, head))
