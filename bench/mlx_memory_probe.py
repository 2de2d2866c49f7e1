"""Where fuselm's MLX peak memory goes: mx.get_peak_memory after load, a 512- and a 2048-token prefill, decode.

    python bench/mlx_memory_probe.py MODEL_DIR [--dtype bf16]
"""

import argparse
import json
import time

import mlx.core as mx
from fuselm.runtime_metal.sampling import Sampler
from fuselm.runtime_metal.session import Session

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--dtype", default="auto")
ap.add_argument("--chunk", type=int, default=None)
args = ap.parse_args()
out = {}
sess = Session(args.model, backend="mlx", dtype=args.dtype)
mx.eval([w for n in sess.graph.nodes if n.op_type == "QMatMul" for w in n.attrs["weight"].data])
out["after_load"] = (mx.get_active_memory() / 1e9, mx.get_peak_memory() / 1e9)
for n in (512, 2048):
    mx.reset_peak_memory()
    sess.reset(n + 70)
    t = time.perf_counter()
    y = sess.prefill(list(range(10, 10 + n)), chunk=args.chunk)
    mx.eval(y)
    out[f"prefill_{n}"] = (mx.get_active_memory() / 1e9, mx.get_peak_memory() / 1e9, time.perf_counter() - t)
    mx.reset_peak_memory()
    toks = list(sess.generate(list(range(10, 10 + n)), 64, Sampler())) if False else None
    y = mx.argmax(y.reshape(-1))
    for _ in range(64):
        y = mx.argmax(sess.decode(y.reshape(1)).reshape(-1))
    mx.eval(y)
    out[f"decode_after_{n}"] = (mx.get_active_memory() / 1e9, mx.get_peak_memory() / 1e9)
out["cache_limit_gb"] = mx.get_cache_memory() / 1e9
out["describe"] = sess.describe()
print(json.dumps(out, indent=1))
