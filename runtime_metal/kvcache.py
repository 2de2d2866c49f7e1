"""The KV cache behind the graph's past/present contract: preallocated, written in place.

The graph sees `past_key_values.{i}.key` [B, H, past, D] and concatenates the new keys to it; the runtime
feeds a `CacheView` of one preallocated buffer [B, H, max_len, D] instead, writes the new rows into it and
hands the graph a view. Modes:
- dynamic (prefill chunks): the graph sees the `pos` rows written so far and gets buffer[:, :, :pos+S] back;
- static (decode): the graph sees max_len - S past rows and gets the whole buffer, so every step has the same
  shapes and can be compiled; rows past the position are masked (by the attention mask, or by `pos`);
- causal reads (`Backend.causal_reads`; rewrites/causal_masks.py): static, but Attention reads only rows
  0..pos (a window: its last rows) with no array mask. A layer whose QKV output gives k and v as one array
  (rewrites/qkv_heads.py) keeps K and V in one buffer [B, 2H, L, D] (`packed`), written by one update.

Storage (`--kv-bits[-k|-v]`, `--kv-group-size`; the graph still sees floats): the graph's dtype, float32 /
float16, or 8-bit (backends/kv_quant.py: (q, scales, biases)). A cache stored in another format than the
compute dtype reaches Attention as a `StoredKV`, read block by block (attention_blocks.py); other consumers
get floats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import psutil
from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError

from .backends import kv_quant

DEFAULT_GROUP = 64
_FLOAT_OF_BITS = {16: TensorProto.FLOAT16, 32: TensorProto.FLOAT}


@dataclass(frozen=True)
class KVFormat:
    """How one cache tensor is stored: bits None = the graph's dtype, 32/16 float, 8 quantized."""

    bits: int | None = None
    group: int = DEFAULT_GROUP

    @property
    def quantized(self) -> bool:
        return self.bits == 8

    def describe(self, graph_dtype: int, head_dim: int) -> str:
        if self.bits is None:
            return TensorProto.DataType.Name(graph_dtype).lower()
        return f"int8/g{group_for(self, head_dim)}" if self.quantized else f"float{self.bits}"


def describe(fmts: tuple[KVFormat, KVFormat], graph_dtype: int, head_dim: int) -> str:
    k, v = (f.describe(graph_dtype, head_dim) for f in fmts)
    return k if k == v else f"K {k}, V {v}"


def check_formats(backend, fmts: tuple[KVFormat, KVFormat], head_dims: list[int], in_place: bool, path) -> None:
    """Refuse, at load, formats this model and backend cannot store (exit 2)."""
    if not any(f.bits is not None for f in fmts):
        return
    if not in_place:
        raise FuselmError(f"{path} reads its KV cache with other ops than Attention/Concat, so the cache cannot be "
                          "stored in another format; run it without --kv-bits")
    for f in fmts:
        if f.quantized:
            for d in sorted(set(head_dims)):
                kv_quant.check_group(backend, d, group_for(f, d), "model's")


def formats(spec) -> tuple[KVFormat, KVFormat]:
    """(key format, value format) of the run's KV cache option (fuselm.options.KVFormat, checked there)."""
    group = DEFAULT_GROUP if spec.group is None else spec.group
    return KVFormat(spec.key_bits, group), KVFormat(spec.value_bits, group)


def make_cache(backend, shape: tuple, graph_dtype: int, fmt: KVFormat):
    """A zeroed preallocated cache [B, H, L, D] in `fmt`: a backend array, or (q, scales, biases)."""
    if fmt.quantized:
        kv_quant.check_group(backend, int(shape[3]), group_for(fmt, int(shape[3])), "model's")
        return backend.kv_empty(tuple(int(s) for s in shape), group_for(fmt, int(shape[3])))
    return backend.full(tuple(shape), 0, _FLOAT_OF_BITS.get(fmt.bits, graph_dtype))


def group_for(fmt: KVFormat, head_dim: int) -> int:
    """The default group shrinks to head_dim for small heads; an explicit one is taken as given."""
    return min(fmt.group, head_dim) if fmt.group == DEFAULT_GROUP else fmt.group


def cache_bytes(shape: tuple, graph_dtype: int, fmt: KVFormat) -> int:
    """Bytes one cache tensor of `shape` takes in `fmt` (scales and biases included)."""
    b, h, length, d = (int(s) for s in shape)
    if fmt.quantized:
        return b * h * length * (d + 2 * 2 * (d // group_for(fmt, d)))
    from .loader import NP_DTYPES

    dtype = _FLOAT_OF_BITS.get(fmt.bits, graph_dtype)
    return b * h * length * d * np.dtype(NP_DTYPES.get(dtype, np.float32)).itemsize


def nbytes(backend, storage) -> int:
    """Bytes a cache actually holds (every array of a quantized one)."""
    arrays = storage if isinstance(storage, tuple) else (storage,)
    return sum(int(a.nbytes) for a in arrays)


def snapshot(backend, storage, t0: int, t1: int) -> tuple:
    """A host copy of rows t0..t1 of a cache (an array or a tuple of arrays); `restore` puts them back.
    Only the rows a step writes: a copy of the whole cache would double its memory at long contexts."""
    arrays = storage if isinstance(storage, tuple) else (storage,)
    return t0, tuple(backend.to_numpy(a[:, :, t0:t1]).copy() for a in arrays)


def restore(backend, storage, saved: tuple):
    t0, rows = saved
    arrays = storage if isinstance(storage, tuple) else (storage,)
    out = tuple(backend.cache_write(a, backend.asarray(r), t0) for a, r in zip(arrays, rows, strict=True))
    return out if isinstance(storage, tuple) else out[0]


@dataclass
class StoredKV:
    """K or V after this step's append, in its stored format (float16 or 8-bit): Attention reads it in
    blocks (attention_blocks.py). `valid`, when the host knows it, bounds the rows worth reading."""

    data: object  # backend array, or (q, scales, biases)
    shape: tuple  # [B, H, T, D] as the graph would see the present tensor
    valid: int | None
    dtype: int  # the compute dtype the graph expects

    @property
    def quantized(self) -> bool:
        return isinstance(self.data, tuple)

    def floats(self, backend):
        """The rows as a float array in the compute dtype (for consumers that are not Attention)."""
        t = int(self.shape[2])
        if self.quantized:
            return backend.kv_dequantize(kv_quant.rows(self.data, 0, t), self.dtype)
        return backend.cast(backend.slice(self.data, (slice(None), slice(None), slice(0, t))), self.dtype)


@dataclass
class CacheView:
    """One past input of the graph, backed by a preallocated buffer."""

    buffer: object  # backend array [B, H, max_len, D], or an 8-bit cache (q, scales, biases)
    pos: object  # rows written before this step: a Python int, or a 0-d device integer (static mode)
    seq: int  # rows this step appends
    static: bool = False
    heads: tuple[int, int] | None = None  # this input's heads of a buffer that holds K and V (packed)
    head_dim: int | None = None  # D, where the buffer is an 8-bit cache (its arrays are in the backend's layout)

    @property
    def max_len(self) -> int:
        return int(self._first.shape[2])

    @property
    def _first(self):
        return self.buffer[0] if isinstance(self.buffer, tuple) else self.buffer

    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, _, d = (int(s) for s in self._first.shape)
        if isinstance(self.buffer, tuple):
            assert self.head_dim is not None, "a view of an 8-bit cache needs its head_dim"
            d = self.head_dim
        h = h if self.heads is None else self.heads[1] - self.heads[0]
        return (b, h, self.max_len - self.seq if self.static else int(self.pos), d)

    def append_both(self, other: CacheView, backend, kv, stored_ok: bool, rows: tuple[int, int]):
        """K and V of one packed buffer (this view's heads, then `other`'s) written by one update of
        `kv` [B, Hk + Hv, S, D] at the host position `pos`; returns their rows t0..t1 (as `append`)."""
        both = CacheView(self.buffer, self.pos, self.seq, self.static, None, self.head_dim)
        out = both.append(backend, kv, stored_ok, rows)
        self.buffer = other.buffer = both.buffer
        return tuple(_heads(backend, out, view.heads) for view in (self, other))

    def append(self, backend, new, stored_ok: bool = False, rows: tuple[int, int] | None = None):
        """Write `new` [B, H, S, D] at `pos`; return what the graph's Concat would have produced, or with
        `rows` (t0, t1) only those rows of the cache after the write (a causal read of the filled rows,
        which needs `pos` as a host int).

        A cache stored in another format than `new`'s comes back as a StoredKV when `stored_ok` (the
        Attention op reads it blockwise), else as floats in `new`'s dtype."""
        s = int(new.shape[2])
        at = {} if self.heads is None else {"heads": self.heads}
        if isinstance(self.buffer, tuple):
            d = int(new.shape[3])
            parts = backend.kv_quantize(new, d // int(self.buffer[1].shape[3]))
            self.buffer = kv_quant.write(backend, self.buffer, parts, self.pos, **at)
        else:
            self.buffer = backend.cache_write(self.buffer, new, self.pos, **at)
        t0, t1 = rows or (0, self.max_len if self.static else int(self.pos) + s)
        hs = slice(None) if self.heads is None else slice(*self.heads)
        if not isinstance(self.buffer, tuple) and backend.dtype(self.buffer) == backend.dtype(new):
            whole = t0 == 0 and t1 == self.max_len and self.heads is None
            return self.buffer if whole else backend.slice(self.buffer, (slice(None), hs, slice(t0, t1)))
        b, h, _, d = (int(x) for x in new.shape)
        data = self.buffer
        if t0 or self.heads is not None:  # a window: the stored rows from t0 on; a packed buffer: these heads
            data = tuple(a[:, hs, t0:t1] for a in data) if isinstance(data, tuple) else data[:, hs, t0:t1]
        pos = backend.host_int(self.pos)
        view = StoredKV(data, (b, h, t1 - t0, d), None if pos is None else pos + s - t0, backend.dtype(new))
        return view if stored_ok else view.floats(backend)


def _heads(backend, x, heads: tuple[int, int]):
    """Heads h0..h1 of the rows `append` returned (an array or a StoredKV)."""
    hs = (slice(None), slice(*heads))
    if not isinstance(x, StoredKV):
        return backend.slice(x, hs)
    data = tuple(a[hs] for a in x.data) if x.quantized else x.data[hs]
    b, _, t, d = x.shape
    return StoredKV(data, (b, heads[1] - heads[0], t, d), x.valid, x.dtype)


# --- the session's buffers: one per past input, or one per layer for K and V (packed) -----------------
def in_place(nodes, names: set[str]) -> bool:
    """The cache can live in preallocated buffers when the graph only appends to it (KVAppend, Attention's
    past inputs) or reads its shape."""
    for n in nodes:
        for i, x in enumerate(n.inputs):
            if x in names and not ((n.op_type == "KVAppend" and i == 0) or n.op_type == "Shape"
                                   or (n.op_type == "Attention" and not n.domain and i in (4, 5))):
                return False
    return True


def packed_pairs(specs: list, nodes, causal_reads: bool, fmts: tuple[KVFormat, KVFormat]) -> dict[str, str]:
    """Value cache name -> its key's, for layers whose K and V can live in one buffer ([B, 2H, L, D]):
    causal reads, every Attention given its k and v rows as one array (rewrites/qkv_heads.py), K and V of the
    same shape and storage format. Empty unless every layer qualifies."""
    by_name = {c.name: c for c in specs}
    pairs = {}
    for n in (n for n in nodes if n.key == ("", "Attention")):
        k, v = (n.inputs[i] if len(n.inputs) > i else "" for i in (4, 5))
        if len(n.inputs) < 8 or not n.inputs[7] or k not in by_name or v not in by_name or k in pairs or \
                (by_name[k].heads, by_name[k].head_dim, by_name[k].dtype) != \
                (by_name[v].heads, by_name[v].head_dim, by_name[v].dtype):
            return {}
        pairs[v] = k
    return pairs if causal_reads and len(pairs) * 2 == len(specs) and fmts[0] == fmts[1] else {}


def format_of(spec, fmts: tuple[KVFormat, KVFormat]) -> KVFormat:
    return fmts[contract.parse_cache(spec.name).kind == "value"]


def allocate(backend, specs: list, fmts: tuple[KVFormat, KVFormat], packed: dict[str, str], length: int) -> dict:
    """Zeroed buffers [1, H, length, D] by past name (a packed pair shares one [1, 2H, length, D]: the
    keys' heads, then the values'); a cache larger than the free memory is refused before allocating
    (a huge --max-tokens, or absurd cache dims in the graph)."""
    need = sum(cache_bytes((1, c.heads, length, c.head_dim), c.dtype, format_of(c, fmts)) for c in specs)
    free = psutil.virtual_memory().available
    if need > free:
        raise FuselmError(f"the KV cache for {length:,} tokens needs {need / 2**30:,.1f} GiB, more than the "
                          f"{free / 2**30:.1f} GiB of free memory; lower --max-tokens (or --tokens)")
    out = {}
    for c in specs:
        shape = (1, c.heads * (2 if c.name in packed.values() else 1), length, c.head_dim)
        if c.name not in packed:
            out[c.name] = make_cache(backend, shape, c.dtype, format_of(c, fmts))
    out.update({v: out[k] for v, k in packed.items()})
    return out


def view(buffers: dict, spec, packed: dict[str, str], pos, seq: int, static: bool = False) -> CacheView:
    """The graph's past input `spec` over its buffer (a packed buffer: its half of the heads)."""
    heads = None
    if packed:
        heads = (spec.heads, 2 * spec.heads) if spec.name in packed else (0, spec.heads)
    return CacheView(buffers[spec.name], pos, seq, static, heads, spec.head_dim)
