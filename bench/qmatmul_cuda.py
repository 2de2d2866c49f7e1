"""Side by side on one CUDA GPU: the quantized matmuls of a decode step, per weight shape.

    python bench/qmatmul_cuda.py                 # Qwen3-4B's shapes (and its 8-bit lm_head), M = 1
    python bench/qmatmul_cuda.py --shape 0.6b --rows 1 4

For each weight [K, N] of the model (fused qkv, o, gate_up, down; the 8-bit lm_head), random blocked
weights (block 32) through: fuselm's Triton GEMV (runtime_metal/backends/cuda_kernels.py), torch's
tinygemm (`_weight_int4pack_mm`, 4-bit only) and a dense bf16 `F.linear` (the unquantized
reference). Each is timed as a CUDA graph of calls over copies of the weight that outgrow L2 (so
no host launch cost, and the bytes come from memory), median of 5 replays; GB/s counts the bytes
the kernel must read (weights, scales, zero points). Also checks that the GEMV matches a dequantized f32 product. Writes
bench/results/qmatmul-cuda.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fuselm.runtime_metal.backends import cuda_kernels  # noqa: E402

SHAPES = {  # (K, N, bits) per weight of one layer, then the lm_head
    "4b": [(2560, 6144, 4), (4096, 2560, 4), (2560, 19456, 4), (9728, 2560, 4), (2560, 151936, 8)],
    "0.6b": [(1024, 4096, 4), (2048, 1024, 4), (1024, 6144, 4), (3072, 1024, 4), (1024, 151936, 8)],
}
RESULTS = Path(__file__).parent / "results"


def timed(calls: list, runs: int = 5) -> float:
    """Median time per call, in microseconds, of `calls` replayed in one CUDA graph (as decode runs
    them: no host launch cost). Each call reads its own copy of the weight, and the copies together
    outgrow the 60 MB L2, so the bytes come from memory as they do in a decode step."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    out = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1000 / len(calls))
    return statistics.median(out)


def copies(nbytes: int) -> int:
    return max(2, -(-(256 << 20) // nbytes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="*", default=[1])
    args = ap.parse_args(argv)
    dev, group = torch.device("cuda"), 32
    rows = []
    for m in args.rows:
        for k, n, bits in SHAPES[args.shape]:
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randint(0, 2**bits, (n, k), device=dev, dtype=torch.uint8, generator=g)
            scale = torch.rand(n, k // group, device=dev, generator=g) * 0.01
            zero = torch.randint(0, 2**bits, (n, k // group), device=dev, dtype=torch.uint8, generator=g)
            x = torch.randn(m, k, device=dev, generator=g)
            packed = cuda_kernels.pack(q, bits)
            ref = x @ cuda_kernels.dequantize(packed, scale, zero, group, bits, torch.float32).T
            y = cuda_kernels.gemv(x, packed, scale, zero, group, bits)
            err = float((y - ref).abs().max() / ref.abs().max())
            nbytes = packed.numel() + scale.numel() * 4 + zero.numel()
            r = {"rows": m, "K": k, "N": n, "bits": bits, "bytes": nbytes, "max_rel_err": err}
            c = copies(nbytes)
            ws = [(packed.clone(), scale.clone(), zero.clone()) for _ in range(c)]
            r["triton_us"] = timed([partial(cuda_kernels.gemv, x, *w, group, bits) for w in ws])
            del ws
            xb = x.to(torch.bfloat16)
            dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies(2 * n * k))]
            r["bf16_dense_us"] = timed([partial(torch.nn.functional.linear, xb, d) for d in dense])
            del dense
            if bits == 4:
                tg = (packed & 0xF) << 4 | (packed >> 4)  # tinygemm: even k in the high nibble
                w4 = torch.ops.aten._convert_weight_to_int4pack(tg.contiguous(), 8)
                sz = torch.stack([scale.T, (8 - zero.T.float()) * scale.T], -1).to(torch.bfloat16).contiguous()
                tgs = [(w4.clone(), sz.clone()) for _ in range(c)]
                r["tinygemm_us"] = timed([partial(torch.ops.aten._weight_int4pack_mm, xb, w, group, z)
                                          for w, z in tgs])
                del tgs
            r["triton_gb_s"] = round(nbytes / r["triton_us"] / 1e3, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "qmatmul-cuda.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows},
                                                          indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
