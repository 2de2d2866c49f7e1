"""torch on CPU, CUDA (or MPS): F.scaled_dot_product_attention(enable_gqa), F.rms_norm, quantized matmul.

Quantized weights are converted once at load (`prepare_quantized`). Which kernel is used depends on
the device (runtime_metal/backends/torch_quant.py measures and explains the choice).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from onnx import TensorProto

from fuselm import switches

from . import kv_quant, torch_quant
from .base import Backend, QuantizedWeight

TORCH_DTYPES = {
    TensorProto.FLOAT: torch.float32, TensorProto.DOUBLE: torch.float64, TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16, TensorProto.INT64: torch.int64, TensorProto.INT32: torch.int32,
    TensorProto.INT16: torch.int16, TensorProto.INT8: torch.int8, TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16, TensorProto.UINT32: torch.uint32, TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
}
_ONNX_OF = {v: k for k, v in TORCH_DTYPES.items()}


def _div(a, b):
    if a.dtype.is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")


_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
    "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tan": torch.tan, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "erf": torch.erf, "relu": torch.relu, "floor": torch.floor, "ceil": torch.ceil,
    "round": torch.round, "sign": torch.sign, "not": torch.logical_not, "isnan": torch.isnan,
    "isinf": torch.isinf, "asin": torch.asin, "acos": torch.acos, "atan": torch.atan, "sinh": torch.sinh,
    "cosh": torch.cosh, "asinh": torch.asinh, "acosh": torch.acosh, "atanh": torch.atanh,
    "softplus": F.softplus, "bitwise_not": torch.bitwise_not,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": _div, "max": torch.maximum, "min": torch.minimum,
    "pow": lambda a, b: torch.pow(a, b).to(a.dtype), "mod": torch.remainder, "fmod": torch.fmod, "equal": torch.eq,
    "less": torch.lt, "less_equal": torch.le, "greater": torch.gt, "greater_equal": torch.ge, "and": torch.logical_and,
    "or": torch.logical_or, "xor": torch.logical_xor, "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor,
}

_SCATTER = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}  # ONNX reduction -> torch's scatter_reduce

# Decode (a few queries): two batched matmuls over the query heads grouped per kv head. On CPU SDPA splits tiny
# problems across threads; on CUDA, f32 with a mask and enable_gqa falls to SDPA's math path, which copies K and V
# out to every query head.
_GROUPED_MAX_QUERIES = 16


def _grouped_attention(q, k, v, mask, scale):
    """softmax(q kᵀ·scale + mask) v with q [B, Hq, S, D] grouped as [B, Hkv, Hq/Hkv·S, D]: GQA
    without repeating K/V."""
    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    r = hq // hkv
    scores = torch.matmul(q.reshape(b, hkv, r * s, d), k.transpose(-1, -2)).mul_(scale).view(b, hkv, r, s, t)
    if mask is not None:  # broadcastable to [B, Hq, S, T]; the head axis splits as [Hkv, Hq/Hkv]
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        m = m.view(m.shape[0], hkv, r, *m.shape[-2:]) if m.shape[1] == hq and hq > 1 else m.unsqueeze(1)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores.add_(m)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.view(b, hkv, r * s, t), v).view(b, hq, s, v.shape[-1])


def _written_keys(k, v, mask):
    """k, v and mask cut after the last key some query attends: a static cache's unwritten tail is not
    read (eager CPU decode; a compiled step keeps its static shapes)."""
    t = k.shape[2]
    if mask.shape[-1] != t or t < 2:
        return k, v, mask
    seen = (mask if mask.dtype == torch.bool else mask > float("-inf")).reshape(-1, t).any(0)
    last = int(seen.nonzero().max()) + 1 if bool(seen.any()) else t
    if last == t:
        return k, v, mask
    return k[:, :, :last], v[:, :, :last], mask[..., :last]


# the 8-bit cache: decode folds the affine fix-up into the small [queries, keys] products; a prefill block
# (many queries) dequantizes the block instead, which costs less than G products of [queries, keys]
_FOLD_MAX_QUERIES = 32
_MMAP_THRESHOLD = 256 * 1024
_PREPARE_COLUMNS = 16384


def _return_freed_memory() -> None:
    """glibc raises its mmap threshold to the largest block freed so far (up to 32 MB), so a prefill
    chunk's activations, once freed, stay in the heap and the next layer's land beside them (peak RSS grew
    with every layer). A fixed threshold maps every block >= 256 KB and unmaps it on free."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also stops the dynamic adjustment)
    except (OSError, AttributeError):  # not glibc (macOS, musl): their allocators do not do this
        pass


class TorchBackend(Backend):
    """`threads` (CPU): the matmul kernels' and prefill's threads (default FUSELM_THREADS, else torch's);
    decode steps run torch's own pool at one thread (tiny ops lose to fork/join), the kernels keep all."""

    name = "torch"

    def __init__(self, device: str | None = None, threads: int | None = None):
        self.device = str(torch.device(device or "cpu"))
        self._dev = torch.device(self.device)
        self._tracing = False
        self._inv_freq: dict[int, tuple] = {}
        self.threads = None
        if self._dev.type == "cpu":
            _return_freed_memory()
            self.threads = threads or switches.number("FUSELM_THREADS", 0) or torch.get_num_threads()
            torch_quant.set_kernel_threads(self.threads)

    @property
    def compile_default(self) -> bool:
        """CUDA graphs are cheap to build; inductor on CPU takes ~45 s for a 28-layer model."""
        return self._dev.type == "cuda"

    def set_threads(self, decode):
        n = 1 if decode else self.threads
        if self.threads is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def int8_activations(self, weights):
        return any(torch_quant.CPU_KINDS.get(w.kind, (0, 0))[1] == 8 for w in weights)

    def drift_tolerance(self, weights):
        """bf16 activations too under CUDA's tinygemm and bf16 weights, and int8 activations under the CPU
        kernels' *-int8 (a last-bit difference moves a value across an int8 rounding step)."""
        rounded = self.int8_activations(weights) or any(w.kind in ("tinygemm", "dequant-bf16") for w in weights)
        return 3e-2 if rounded else super().drift_tolerance(weights)

    def compile_step(self, fn, args, n_inputs):
        from .torch_compile import compile_step

        self._tracing = True  # make_fx traces the step: static shapes, no host reads of device values
        try:
            return compile_step(fn, args, n_inputs, cuda=self._dev.type == "cuda")
        finally:
            self._tracing = False

    # --- data movement ---------------------------------------------------------------
    def asarray(self, value):
        value = np.asarray(value)
        if value.ndim == 0 and self._dev.type != "cpu" and value.dtype.name != "bfloat16":
            # a fill kernel, not a host-to-device copy: scalars made mid-step stay capturable in CUDA graphs
            return torch.full((), value.item(), dtype=self._from_numpy(value.reshape(1)).dtype, device=self._dev)
        if value.dtype.name == "bfloat16":
            t = self._from_numpy(value.view(np.uint16)).view(torch.bfloat16)
        else:
            t = self._from_numpy(value)
        return t.to(self._dev) if t.device != self._dev else t

    @staticmethod
    def _from_numpy(value: np.ndarray) -> torch.Tensor:
        with warnings.catch_warnings():
            # Read-only memory maps (and constants folded from them): never written, so sharing the pages is safe.
            warnings.simplefilter("ignore", UserWarning)
            if value.ndim == 0:
                return torch.tensor(value.item(), dtype=torch.from_numpy(value.reshape(1)).dtype)
            return torch.from_numpy(value)

    def to_numpy(self, x):
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()

    def dtype(self, x):
        return _ONNX_OF[x.dtype]

    def cast(self, x, to):
        return x.to(TORCH_DTYPES[to])

    def full(self, shape, value, to):
        return torch.full(tuple(shape), value, dtype=TORCH_DTYPES[to], device=self._dev)

    def arange(self, start, limit, delta, to):
        return torch.arange(start, limit, delta, device=self._dev).to(TORCH_DTYPES[to])

    def sync(self, x):
        if self._dev.type == "cuda":
            torch.cuda.synchronize(self._dev)

    # --- math ---------------------------------------------------------------------------
    def unary(self, op, x):
        return _UNARY[op](x)

    def binary(self, op, a, b):
        return _BINARY[op](a, b)

    def where(self, cond, a, b):
        return torch.where(cond, a, b)

    def reduce(self, op, x, axes, keepdims):
        dims = tuple(range(x.dim())) if axes is None else tuple(axes)
        if x.dim() == 0 or not dims:
            return x.clone()
        if op == "sum":
            return torch.sum(x, dim=dims, keepdim=keepdims, dtype=x.dtype)
        if op == "mean":
            return torch.mean(x.double() if not x.dtype.is_floating_point else x, dim=dims, keepdim=keepdims).to(x.dtype)
        if op in ("max", "min"):
            return (torch.amax if op == "max" else torch.amin)(x, dim=dims, keepdim=keepdims)
        for d in sorted(dims, reverse=True):
            x = torch.prod(x, dim=d, keepdim=keepdims)
        return x

    def arg_reduce(self, op, x, axis, keepdims):
        return (torch.argmax if op == "max" else torch.argmin)(x, dim=axis, keepdim=keepdims).to(torch.int64)

    def matmul(self, a, b):
        return torch.matmul(a, b)

    def softmax(self, x, axis, log=False):
        return (torch.log_softmax if log else torch.softmax)(x, dim=axis)

    def cumsum(self, x, axis, exclusive, reverse):
        if reverse:
            x = torch.flip(x, (axis,))
        out = torch.cumsum(x, dim=axis, dtype=x.dtype)
        if exclusive:
            out = out - x
        return torch.flip(out, (axis,)) if reverse else out

    def topk(self, x, k, axis, largest, sorted_):
        # ONNX orders ties by index; a stable sort keeps that (torch.topk does not promise it)
        key = x.double() if x.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else x
        idx = torch.sort(key, dim=axis, descending=bool(largest), stable=True).indices.narrow(axis, 0, k)
        return torch.gather(x, axis, idx), idx

    # --- layout -------------------------------------------------------------------------
    def reshape(self, x, shape):
        return x.reshape(shape)

    def transpose(self, x, perm):
        return x.permute(perm)

    def slice(self, x, index):
        flips = tuple(ax for ax, s in enumerate(index) if isinstance(s, slice) and (s.step or 1) < 0)
        if flips:
            # torch has no negative steps: flip, then slice forward with mirrored bounds
            new = list(index)
            for ax in flips:
                start, stop, step = index[ax].indices(x.shape[ax])
                n = len(range(start, stop, step))
                first = x.shape[ax] - 1 - start
                new[ax] = slice(first, first + (n - 1) * -step + 1 if n else first, -step)
            x, index = torch.flip(x, flips), tuple(new)
        return x[index]

    def concat(self, xs, axis):
        return torch.cat(xs, dim=axis)

    def expand(self, x, shape):
        return x.expand(tuple(shape))

    def tile(self, x, reps):
        return x.repeat(tuple(reps))

    def pad(self, x, pads, mode, value):
        flat = [p for pair in reversed(pads) for p in pair]
        if mode == "constant":
            return F.pad(x, flat, mode="constant", value=value)
        first = next((i for i, p in enumerate(pads) if p != (0, 0)), x.dim())
        if first == x.dim():
            return x.clone()
        # torch pads the trailing dims of a [N, C, *spatial] tensor in these modes
        lead, tail = tuple(x.shape[:first]), tuple(x.shape[first:])
        y = F.pad(x.reshape((-1, 1) + tail), flat[: 2 * len(tail)],
                  mode={"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode])
        return y.reshape(lead + tuple(y.shape[2:]))

    def gather(self, x, idx, axis):
        return x[(slice(None),) * axis + (idx,)]

    def gather_elements(self, x, idx, axis):
        return torch.gather(x, axis, idx)

    def scatter_elements(self, x, idx, updates, axis, reduction):
        if reduction == "none":
            return torch.scatter(x, axis, idx, updates)
        return torch.scatter_reduce(x, axis, idx, updates, reduce=_SCATTER[reduction], include_self=True)

    def scatter_nd(self, x, idx, updates, reduction):
        out = x.clone()
        key = tuple(idx.movedim(-1, 0))
        if reduction == "none":
            out[key] = updates
            return out
        flat_idx = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=x.device)
        for d in range(idx.shape[-1]):
            flat_idx = flat_idx * x.shape[d] + idx[..., d]
        inner = tuple(x.shape[idx.shape[-1]:])
        view = out.reshape((-1,) + inner)
        upd = updates.reshape((-1,) + inner)
        index = flat_idx.reshape(-1, *([1] * len(inner))).expand(-1, *inner)
        return view.scatter_reduce(0, index, upd, reduce=_SCATTER[reduction], include_self=True).reshape(x.shape)

    # --- fused kernels ----------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return F.rms_norm(x, (x.shape[-1],), weight if weight.dim() == 1 else weight.expand(x.shape[-1:]), eps)

    def layer_norm(self, x, weight, bias, eps):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def rope(self, x, position_ids, inv_freq, attention_scaling, interleaved, offset=None):
        cos, sin = self._cos_sin(position_ids, inv_freq, attention_scaling, x.dtype)
        rd = 2 * len(inv_freq)
        xr = x[..., :rd] if rd < x.shape[-1] else x
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            y = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            cos2, sin2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
            y = xr * cos2 + torch.cat([-x2, x1], -1) * sin2
        return torch.cat([y, x[..., rd:]], -1) if rd < x.shape[-1] else y

    def _cos_sin(self, position_ids, inv_freq, scaling, dtype):
        # q and k of every layer rotate at the same positions: cos/sin once per step (held with the arrays whose ids
        # are in the key, so that no id is reused within the step)
        memo = self.step_memo if self.step_memo is not None else {}
        rope = ("rope", id(position_ids), id(inv_freq), scaling)
        if rope in memo:
            return memo[rope][:2]
        key = id(inv_freq)
        if key not in self._inv_freq:  # on the device once: no host copies inside a captured step
            self._inv_freq[key] = (inv_freq, torch.as_tensor(np.asarray(inv_freq, np.float32), device=self._dev))
        freqs = position_ids.to(torch.float32)[..., None] * self._inv_freq[key][1]  # [B, S, rd/2]
        cos = (torch.cos(freqs) * scaling).to(dtype)[:, :, None, :]
        sin = (torch.sin(freqs) * scaling).to(dtype)[:, :, None, :]
        memo[rope] = (cos, sin, position_ids, inv_freq)
        return cos, sin

    def sdpa(self, q, k, v, mask, scale):
        if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
            mask = mask.to(q.dtype)
        if q.shape[2] <= _GROUPED_MAX_QUERIES:
            if q.device.type == "cpu" and mask is not None and not (self._tracing or torch.compiler.is_compiling()):
                k, v, mask = _written_keys(k, v, mask)
            return _grouped_attention(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def prepare_quantized(self, q, scale, zero_point, block, bits):
        w = self._prepare_cpu(q, scale, zero_point, block, bits) if self.device == "cpu" else \
            torch_quant.prepare(self, q, scale, zero_point, block, bits)
        if w.kind in torch_quant.CPU_KINDS and q.flags.f_contiguous and not q.flags.c_contiguous:
            # a table stored [out, in] (graph.py passes a tied head's transpose): int16 x (the kernels'
            # layout is the same): the head's error lands on the logits unamplified, and onnxruntime
            # runs a tied head (Transpose of a DequantizeLinear, not fused into MatMulNBits) in f32
            w = replace(w, kind=torch_quant.cpu_kind(w.kind.split("-")[0], "int16", bits))
        return w

    def _prepare_cpu(self, q, scale, zero_point, block, bits):
        n = q.shape[1]
        if n <= _PREPARE_COLUMNS:
            return torch_quant.prepare(self, q, scale, zero_point, block, bits)
        # a vocab-wide lm_head: the CPU kernels' layout is one row per output column, so it is packed
        # in slices of columns (the packing's temporaries stay ~50 MB instead of 3x the weight)
        parts = [torch_quant.prepare(self, q[:, c:c + _PREPARE_COLUMNS], scale[:, c:c + _PREPARE_COLUMNS],
                                     None if zero_point is None else zero_point[:, c:c + _PREPARE_COLUMNS], block, bits)
                 for c in range(0, n, _PREPARE_COLUMNS)]
        if parts[0].kind not in torch_quant.CPU_KINDS:
            return super().prepare_quantized(q, scale, zero_point, block, bits)  # no kernels: as torch_quant does
        data = tuple(torch.cat([p.data[i] for p in parts]) for i in range(len(parts[0].data)))
        return QuantizedWeight(data, q.shape[0], n, bits, block, parts[0].kind)

    def quantized_matmul(self, x, w):
        return torch_quant.matmul(x, w)

    def expert_matmul(self, x, w, experts):
        w = w.data if isinstance(w, QuantizedWeight) else w
        t, k = experts.shape
        xs = (x[:, None, :].expand(t, k, x.shape[-1]) if x.dim() == 2 else x).reshape(t * k, -1)
        flat = experts.reshape(-1)
        if t * k <= w.shape[0]:  # decode: gather the few selected experts (no host sync, CUDA-graph safe)
            return torch.bmm(w.index_select(0, flat), xs.unsqueeze(-1).to(w.dtype)).reshape(t, k, -1).to(x.dtype)
        out = xs.new_empty(t * k, w.shape[1])
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=w.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):  # grouped by expert: one matmul over every (token, slot) it serves
            if n:
                rows = order[start:start + n]
                out[rows] = (xs[rows].to(w.dtype) @ w[e].T).to(out.dtype)
                start += n
        return out.reshape(t, k, -1)

    def cache_write(self, buffer, new, pos):
        if isinstance(pos, int):
            buffer[:, :, pos:pos + new.shape[2]] = new
        else:
            idx = pos.reshape(1) + torch.arange(new.shape[2], device=buffer.device)
            buffer.index_copy_(2, idx, new.to(buffer.dtype))
        return buffer

    def host_int(self, pos):
        """An int, or a CPU tensor outside tracing (reading a CUDA one would wait for the device)."""
        if isinstance(pos, int):
            return pos
        if getattr(pos, "device", None) is not None and pos.device.type == "cpu":
            if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None:  # not inside make_fx
                return int(pos)
        return None

    # --- the 8-bit KV cache (Backend's layout): decode folds the affine fix-up into the small products -----
    def kv_scores(self, q, block):
        # Σ_d q_d (k_d·s_g + z_g) = Σ_g s_g (q_g · k_g) + z_g Σ_{d∈g} q_d: one int8→f32 conversion of the keys,
        # the scales applied to the small [R, T] products
        kq, ks, kz = block
        group = kv_quant.group_of(self, block)
        qf = q.float()
        if qf.shape[2] > _FOLD_MAX_QUERIES:
            return super().kv_scores(q, block)
        k = kq.float()
        ks, kz = ks.float().transpose(-1, -2), kz.float().transpose(-1, -2)  # [B, H, G, T]
        out = None
        for j in range(kq.shape[-1] // group):  # column slices of k keep unit stride: the matmuls read them in place
            c = slice(j * group, (j + 1) * group)
            dots = (qf[..., c] @ k[..., c].transpose(-1, -2)).mul_(ks[:, :, j:j + 1])
            dots.add_(qf[..., c].sum(-1, keepdim=True) * kz[:, :, j:j + 1])
            out = dots if out is None else out.add_(dots)
        return out

    def kv_values(self, p, block):
        # Σ_t p_t (v_td·s_tg + z_tg) = (p ⊙ s_g) · v_g + p · z_g, per group g of channels
        vq, vs, vz = block
        group = kv_quant.group_of(self, block)
        if p.shape[2] > _FOLD_MAX_QUERIES:
            return super().kv_values(p, block)
        v = vq.float()
        g = vq.shape[-1] // group
        vs, vz = vs.float().transpose(-1, -2), vz.float().transpose(-1, -2)  # [B, H, G, T]
        parts = []
        for j in range(g):
            c = slice(j * group, (j + 1) * group)
            part = (p * vs[:, :, j:j + 1]) @ v[..., c]
            parts.append(part.add_(p @ vz[:, :, j, :, None]))
        return parts[0] if g == 1 else torch.cat(parts, -1)
