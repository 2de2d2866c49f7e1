"""Weight-only 4/8-bit GEMV for CUDA decode, in Triton: the blocked weights read as they are stored.

torch's tinygemm is 4-bit only and rounds activations to bf16, and `_weight_int8pack_mm` is per
channel (blocked 8-bit weights would need a bf16 copy). This kernel reads exactly what the graph
stores: q [N, K] packed two 4-bit values per byte (or one 8-bit value), f32 scales and uint8 zero
points per block of K, and f32 activations. One program computes BLOCK_N outputs for one row of x,
looping over K; per block it uses

    y[n] += scale[n, g] * (q[n, g] . x[g] - zp[n, g] * sum(x[g]))

so the zero point costs one multiply per block. Accumulation is f32 (no bf16 rounding of the
activations). Configurations are autotuned per (N, K) at the first call, outside CUDA-graph
capture (the session's eager warm-up steps), by Triton's do_bench: it flushes L2 before each timed
call, so the weight comes from memory as in decode (L2-hot timings pick configurations slower in decode).

Prefill (many rows) dequantizes to bf16 in one pass (`dequantize`) and uses cuBLAS.
"""

from __future__ import annotations

import functools
import logging

import torch

_log = logging.getLogger("fuselm.runtime")


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
               for bn, bk, w in ((2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 2), (8, 512, 4),
                                 (8, 1024, 8), (16, 256, 4), (16, 512, 8), (32, 256, 8), (64, 128, 4))]

    def fits(configs, named_args, **kwargs):  # a tile holds whole blocks of K
        group = named_args.get("GROUP", kwargs.get("GROUP"))
        return [c for c in configs if c.kwargs["BLOCK_K"] % group == 0] or \
            [triton.Config({"BLOCK_N": 8, "BLOCK_K": group}, num_warps=4)]

    @triton.autotune(configs=configs, key=["N", "K", "BITS", "GROUP"], prune_configs_by={"early_config_prune": fits}, cache_results=True)
    @triton.jit
    def gemv(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, K, G, BITS: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        GK: tl.constexpr = BLOCK_K // GROUP
        for k0 in tl.range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(x_ptr + m * K + rk, mask=kmask, other=0.0)
            if BITS == 4:
                rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                p = tl.load(q_ptr + rn[:, None] * (K // 2) + rb[None, :],
                            mask=nmask[:, None] & (rb[None, :] < K // 2), other=0)
                w = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K)  # byte j: k = 2j (low), 2j + 1 (high)
            else:
                w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0)
            rg = k0 // GROUP + tl.arange(0, GK)
            gmask = nmask[:, None] & (rg[None, :] < G)
            s = tl.load(s_ptr + rn[:, None] * G + rg[None, :], mask=gmask, other=0.0)
            z = tl.load(z_ptr + rn[:, None] * G + rg[None, :], mask=gmask, other=0).to(tl.float32)
            x3 = tl.reshape(x, (1, GK, GROUP))
            dot = tl.sum(tl.reshape(w.to(tl.float32), (BLOCK_N, GK, GROUP)) * x3, axis=2)
            xs = tl.sum(x3, axis=2)
            acc += tl.sum(s * (dot - z * xs), axis=1)
        tl.store(y_ptr + m * N + rn, acc, mask=nmask)

    return gemv


@torch.library.custom_op("fuselm::gemv_cuda", mutates_args=())
def gemv_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
            bits: int) -> torch.Tensor:
    """`gemv` as a torch op, so the compiled decode step (make_fx + inductor) calls it as one node."""
    return gemv(x, q, scale, zero, group, bits)


@gemv_op.register_fake
def _(x, q, scale, zero, group, bits):
    return x.new_empty((x.shape[0], scale.shape[0]), dtype=torch.float32)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] uint8 values -> the kernel's layout: 4 bits two per byte (k = 2j low nibble), 8 bits as is."""
    if bits == 8:
        return q.contiguous()
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
         bits: int, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] f32 @ W.T, W [N, K] = (q - zero) * scale blockwise; scale f32 / zero uint8 [N, K / group].

    `tile` = (BLOCK_N, BLOCK_K) runs that tile instead of the autotuned one (Triton's interpreter,
    which the CPU tests use, cannot time configurations)."""
    import triton

    x = x.contiguous()
    m, k = x.shape
    n, g = scale.shape
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), m)  # noqa: E731 - triton's grid idiom
    if tile is None:
        _kernels()[grid](x, q, scale, zero, y, n, k, g, BITS=bits, GROUP=group)
    else:
        _kernels().fn[grid](x, q, scale, zero, y, n, k, g, BITS=bits, GROUP=group, BLOCK_N=tile[0], BLOCK_K=tile[1])
    return y


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, bits: int,
               dtype=torch.bfloat16, tile: tuple[int, int] = (16, 256)) -> torch.Tensor:
    """W [N, K] in `dtype` from the kernel's layout, in one pass (prefill: a cuBLAS GEMM over many rows
    beats the GEMV). Reads the quantized bytes once and writes `dtype`: torch ops would make five
    passes over f32 temporaries."""
    import triton

    n, g = scale.shape
    k = g * group
    if _DEQUANT_FAILED:
        return _dequantize_torch(q, scale, zero, group, bits, dtype)
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    bn, bk = tile[0], max(tile[1], group)
    try:
        _dequant_kernel()[(triton.cdiv(n, bn), triton.cdiv(k, bk))](q, scale, zero, out, n, k, g, BITS=bits,
                                                                     GROUP=group, BLOCK_N=bn, BLOCK_K=bk)
    except Exception as e:  # noqa: BLE001 - a compiler problem on some GPU must not stop prefill
        _log.warning("fuselm: the Triton dequantize kernel failed (%s); prefill dequantizes with torch ops", e)
        _DEQUANT_FAILED.append(str(e))
        return _dequantize_torch(q, scale, zero, group, bits, dtype)
    return out


_DEQUANT_FAILED: list[str] = []


def _dequantize_torch(q, scale, zero, group, bits, dtype):
    n, g = scale.shape
    vals = torch.stack((q & 0xF, q >> 4), dim=-1).view(n, -1) if bits == 4 else q
    w = (vals.view(n, g, group).float() - zero.unsqueeze(-1).float()) * scale.unsqueeze(-1)
    return w.view(n, g * group).to(dtype)


@functools.cache
def _dequant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(q_ptr, s_ptr, z_ptr, out_ptr, N, K, G, BITS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        nmask = rn < N
        if BITS == 4:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(q_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=nmask[:, None] & (rb[None, :] < K // 2),
                        other=0)
            w = tl.join(p & 0xF, p >> 4).reshape(BLOCK_N, BLOCK_K)
        else:
            w = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None] & (rk[None, :] < K), other=0)
        GK: tl.constexpr = BLOCK_K // GROUP
        rg = k0 // GROUP + tl.arange(0, GK)
        gmask = nmask[:, None] & (rg[None, :] < G)
        s = tl.load(s_ptr + rn[:, None] * G + rg[None, :], mask=gmask, other=0.0)
        z = tl.load(z_ptr + rn[:, None] * G + rg[None, :], mask=gmask, other=0).to(tl.float32)
        v = (tl.reshape(w.to(tl.float32), (BLOCK_N, GK, GROUP)) - z[:, :, None]) * s[:, :, None]
        tl.store(out_ptr + rn[:, None] * K + rk[None, :], tl.reshape(v, (BLOCK_N, BLOCK_K)).to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & (rk[None, :] < K))

    return dequant
