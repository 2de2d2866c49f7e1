"""Quantized matmul for torch: which kernel runs a blocked (q - zero_point) * scale weight.

torch's CPU low-bit kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) are scalar without
AVX-512 and slower than an f32 matmul at decode, and a dequantized f32 copy moves 8x the bytes of 4-bit
weights through memory every token. So on CPUs fuselm uses its own kernels (cpu_kernels.cpp, built once at
install: kernel_build.py), chosen at run time by what the CPU has (`cpu_isa`) over one packed layout:
- int8 activations (the default, `cpu_activations`): int8 x times 4/8-bit weights with integer
  accumulation, one dequantization per sub-block of 32, for decode (GEMV) and
  prefill alike (the same kernel as an integer GEMM: no dequantized weights);
- int16 activations: the int16 GEMV for decode, and for prefill (more than 16 rows) a dequantize into
  a reusable f32 buffer + BLAS GEMM (f32-exact activations, for validation).
Without kernels (no prebuilt module and no compiler) weights are dequantized to f32 at load ("dequant").
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch
import torch.nn.functional as F

from fuselm import switches
from fuselm.errors import FuselmError

from . import cuda_kernels, kernel_build
from .base import QuantizedWeight, dequantize_blocked

GEMV_MAX_ROWS = 16  # int16 x: up to this many rows the integer kernel wins; beyond, dequantize + BLAS GEMM
_log = logging.getLogger("fuselm.runtime")
ISAS = {"scalar": 0, "avx2": 1, "avx512vnni": 2}  # cpu_kernels.cpp's instruction sets
ACTIVATIONS = {"int8": 8, "int16": 16}
_DEFAULT_ACTIVATIONS = "int8"


@functools.cache
def cpu_kernels():
    """The compiled CPU kernels (kernel_build: prebuilt at install), or None (FUSELM_NO_CPU_KERNELS=1,
    or neither a prebuilt module nor a compiler: weights are then dequantized to f32 at load)."""
    if switches.on("FUSELM_NO_CPU_KERNELS"):
        return None
    return kernel_build.load()


def cpu_isa() -> str | None:
    """The instruction set the kernels run: FUSELM_CPU_ISA (scalar, avx2, avx512vnni) if this CPU has
    it, else the widest this CPU has; None without kernels or without AVX2 (the scalar kernel is a
    portable reference, ~20x slower at decode than f32 weights dequantized at load, which run then)."""
    kernels = cpu_kernels()
    want = os.environ.get("FUSELM_CPU_ISA", "")
    if want:
        if want not in ISAS:
            raise FuselmError(f"FUSELM_CPU_ISA={want!r} is not one of {', '.join(ISAS)}")
        if kernels is not None and not kernels.isa_supported(ISAS[want]):
            raise FuselmError(f"FUSELM_CPU_ISA={want}: this CPU lacks it; unset it to use the best this CPU has")
        return want if kernels is not None else None
    best = next((n for n in ("avx512vnni", "avx2") if kernels is not None and kernels.isa_supported(ISAS[n])), None)
    if kernels is not None and best is None:
        _say_once("fuselm: this CPU lacks AVX2: quantized weights are dequantized to f32 at load "
                  "(FUSELM_CPU_ISA=scalar keeps them packed, slower)")
    return best


@functools.cache
def _say_once(message: str) -> None:
    _log.warning(message)


def cpu_activations() -> str:
    """x's integer width in the quantized matmuls: FUSELM_CPU_ACTIVATIONS=int8 (the default: int8 x
    4/8-bit integer dots, as onnxruntime's accuracy level 4) or int16 (250x finer than bf16, for
    f32-faithful validation; prefill then dequantizes to f32 for a BLAS GEMM)."""
    act = os.environ.get("FUSELM_CPU_ACTIVATIONS", _DEFAULT_ACTIVATIONS)
    if act not in ACTIVATIONS:
        raise FuselmError(f"FUSELM_CPU_ACTIVATIONS={act!r} is not one of {', '.join(ACTIVATIONS)}")
    return act


def cpu_kind(isa: str, act: str, bits: int) -> str:
    """The kernel a weight runs, as describe() reports it (e.g. avx2-int8). int16 x runs the AVX2 kernel
    on AVX-512 CPUs too; on AVX2, 8-bit weights take int16 x in both modes: int8 x would need two
    vpmaddubsw per byte (a whole byte x 127 x 2 saturates int16) and is no faster than int16, 250x coarser."""
    if act == "int16" or (isa == "avx2" and bits == 8):
        return f"{'scalar' if isa == 'scalar' else 'avx2'}-int16"
    return f"{isa}-{act}"


CPU_KINDS = {"scalar-int8": (0, 8), "scalar-int16": (0, 16), "avx2-int8": (1, 8), "avx2-int16": (1, 16),
             "avx512vnni-int8": (2, 8)}  # kind: (cpu_kernels.cpp's instruction set, x's bits)


def _register_ops():
    """The kernels as torch custom ops, so torch.compile can trace a decode step that calls them."""

    @torch.library.custom_op("fuselm::qgemv", mutates_args=())
    def qgemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
              threads: int, act_bits: int, isa: int) -> torch.Tensor:
        return cpu_kernels().gemv(x, q, scale, zero, bits, threads, act_bits, isa)

    @qgemv.register_fake
    def _(x, q, scale, zero, bits, threads, act_bits, isa):
        return x.new_empty((x.shape[0], q.shape[0]))

    return qgemv


_qgemv = _register_ops()
_scratch: dict[str, torch.Tensor] = {}
KERNEL_THREADS = {"n": torch.get_num_threads()}  # the matmul kernels' team; Session sets it


def set_kernel_threads(n: int) -> None:
    KERNEL_THREADS["n"] = max(1, int(n))


def _dequant_buffer(numel: int) -> torch.Tensor:
    # one reusable f32 buffer for prefill dequantization: the largest weight sets its size
    buf = _scratch.get("cpu")
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        _scratch["cpu"] = buf
    return buf


def prepare(backend, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, block: int,
            bits: int) -> QuantizedWeight:
    k, n = q.shape
    if backend.device.startswith("cuda"):
        return _prepare_cuda(backend, q, scale, zero_point, block, bits)
    isa = cpu_isa() if backend.device == "cpu" else None
    kernels = cpu_kernels() if isa is not None else None
    if kernels is not None and k % 32 == 0 and block % 32 == 0 and k % block == 0 and bits in (4, 8) \
            and q.max(initial=0) < 2**bits:
        zp = zero_point if zero_point is not None else np.zeros(scale.shape, np.uint8)
        # [N, K] rows, sub-blocks of 32 with their own scale and zero point (cpu_kernels.cpp: the layout)
        data = tuple(kernels.pack(*(torch.from_numpy(np.require(a, t, ["C", "W"])) for a, t in
                                    ((q, np.uint8), (scale, np.float32), (zp, np.uint8))), block, bits))
        return QuantizedWeight(data, k, n, bits, block, cpu_kind(isa, cpu_activations(), bits))
    w = dequantize_blocked(q, scale, zero_point, block)
    data = backend.asarray(w.astype(scale.dtype, copy=False))
    return QuantizedWeight(data, k, n, bits, block, "dequant")


def _prepare_cuda(backend, q, scale, zero_point, block, bits) -> QuantizedWeight:
    """CUDA: fuselm's Triton GEMV (cuda_kernels.py) reads the 4/8-bit blocks as stored, f32 activations,
    for decode, and dequantizes to bf16 for cuBLAS in prefill. Without Triton (or with
    FUSELM_CUDA_QMATMUL=tinygemm, kept for A/B): 4-bit weights go to tinygemm (aten._weight_int4pack_mm,
    bf16 activations, as gpt-fast and torchao run int4); 8-bit blocked weights fit no torch kernel
    (_weight_int8pack_mm is per channel), so they are dequantized once to bf16."""
    k, n = q.shape
    dev = torch.device(backend.device)
    if cuda_kernels.available() and os.environ.get("FUSELM_CUDA_QMATMUL", "triton") == "triton" \
            and k % block == 0 and block % 2 == 0 and bits in (4, 8):
        qn = cuda_kernels.pack(torch.from_numpy(np.ascontiguousarray(q.T)).to(dev), bits)  # [N, K(/2)]
        s = torch.from_numpy(np.ascontiguousarray(scale.T.astype(np.float32))).to(dev)  # [N, K/block]
        zp = torch.from_numpy(np.ascontiguousarray(zero_point.T)).to(dev) if zero_point is not None \
            else torch.zeros(s.shape, dtype=torch.uint8, device=dev)
        return QuantizedWeight((qn, s, zp.to(torch.uint8)), k, n, bits, block, "triton")
    if bits == 4 and block in (32, 64, 128, 256) and k % 128 == 0 and n % 8 == 0:  # tinygemm's tiles
        qt = torch.from_numpy(np.ascontiguousarray(q.T)).to(dev, torch.int32)  # [N, K]
        packed = ((qt[:, ::2] << 4) | qt[:, 1::2]).to(torch.uint8)  # tinygemm: even k in the high nibble
        w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        s = torch.from_numpy(scale.astype(np.float32)).to(dev)  # [K/block, N]
        zp = torch.from_numpy(zero_point.astype(np.float32)).to(dev) if zero_point is not None else torch.zeros_like(s)
        # tinygemm dequantizes (q - 8) * scale + zero; ours is (q - zp) * scale
        sz = torch.stack([s, (8 - zp) * s], dim=-1).to(torch.bfloat16).contiguous()
        return QuantizedWeight((w, sz), k, n, bits, block, "tinygemm")
    w = dequantize_blocked(q, scale, zero_point, block)
    return QuantizedWeight(torch.from_numpy(w).to(dev, torch.bfloat16), k, n, bits, block, "dequant-bf16")


def matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    if w.kind == "dequant":
        return torch.matmul(x, w.data)
    if w.kind == "dequant-bf16":
        return torch.matmul(x.to(torch.bfloat16), w.data).to(x.dtype)
    if w.kind == "triton":
        lead = x.shape[:-1]
        x2 = x.reshape(-1, w.in_features).to(torch.float32)
        if x2.shape[0] <= GEMV_MAX_ROWS:
            y = cuda_kernels.gemv_op(x2, *w.data, w.block, w.bits)
        else:  # prefill: dequantize once per call into bf16, then cuBLAS
            y = F.linear(x2.to(torch.bfloat16), cuda_kernels.dequantize(*w.data, w.block, w.bits)).float()
        return y.reshape(*lead, w.out_features).to(x.dtype)
    if w.kind == "tinygemm":
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, w.in_features).to(torch.bfloat16), w.data[0], w.block,
                                               w.data[1])
        return y.reshape(*lead, w.out_features).to(x.dtype)
    q, scale, zp = w.data
    isa, act_bits = CPU_KINDS[w.kind]
    lead = x.shape[:-1]
    dtype = x.dtype
    x2 = x.reshape(-1, w.in_features).to(torch.float32).contiguous()
    if act_bits == 8 or x2.shape[0] <= GEMV_MAX_ROWS:  # int8: the integer GEMM for prefill too
        y = _qgemv(x2, q, scale, zp, w.bits, KERNEL_THREADS["n"], act_bits, isa)
    else:
        wt = cpu_kernels().dequant(q, scale, zp, w.in_features, w.bits, _dequant_buffer(w.in_features * w.out_features),
                                   KERNEL_THREADS["n"], isa)
        y = F.linear(x2, wt)
    return y.reshape(*lead, w.out_features).to(dtype)
