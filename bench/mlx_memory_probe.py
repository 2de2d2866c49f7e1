"""Where fuselm's MLX peak memory goes: mx.get_peak_memory after load, during a prefill of each length, and
during decode after it; with `--mlx-lm DIR`, mlx-lm's peak over the same prefill, in its own process.

    python bench/mlx_memory_probe.py MODEL_DIR [--dtype bf16] [--lengths 512 2048] [--mlx-lm MLX_DIR]
    python bench/mlx_memory_probe.py MODEL_DIR --lengths 1024 --decode 8 --gpu-like --mlx-lm MLX_DIR --out F.json

The prompt is prefilled in one chunk (`--chunk`: the backend's chunk, 2048 on a GPU), as mlx-lm's
generate_step does (its prefill_step_size is 2048): mlx-lm runs the first n - 1 tokens through the
model and evaluates the cache, then the last one (its `_step`). `--gpu-like` gives MLX's CPU backend the
GPU's attention choice (one fused sdpa call for a long prompt, `long_sdpa`: the CPU fallback holds the
scores, for both engines alike), so the two prefill the same way; the peaks are then comparable there.
"""

import argparse
import json
import subprocess
import sys
import time

import mlx.core as mx

GB = 1e9


def fuselm_probe(args) -> dict:
    import fuselm

    out = {}
    sess = fuselm.load(args.model, backend="mlx", dtype=args.dtype).session
    if args.gpu_like:
        sess.backend.long_sdpa = True
    mx.eval([w for n in sess.graph.nodes if n.op_type == "QMatMul" for w in n.attrs["weight"].data])
    out["after_load_gb"] = mx.get_active_memory() / GB
    for n in args.lengths:
        sess.reset(n + args.decode + 2)
        mx.eval(list(sess.buffers.values()))
        out[f"cache_{n}_gb"] = mx.get_active_memory() / GB - out["after_load_gb"]
        mx.reset_peak_memory()
        t = time.perf_counter()
        y = sess.prefill(list(range(10, 10 + n)), chunk=args.chunk or n)
        mx.eval(y)
        out[f"prefill_{n}"] = {"active_gb": mx.get_active_memory() / GB, "peak_gb": mx.get_peak_memory() / GB,
                               "s": time.perf_counter() - t}
        mx.reset_peak_memory()
        y = mx.argmax(y.reshape(-1))
        for _ in range(args.decode):
            y = mx.argmax(sess.decode(y.reshape(1)).reshape(-1))
        mx.eval(y)
        out[f"decode_after_{n}_peak_gb"] = mx.get_peak_memory() / GB
    out["describe"] = sess.describe()
    return out


def mlx_lm_probe(args) -> dict:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(args.model)
    mx.eval(model.parameters())
    out = {"after_load_gb": mx.get_active_memory() / GB}
    for n in args.lengths:
        cache = make_prompt_cache(model)
        mx.reset_peak_memory()
        t = time.perf_counter()
        p = mx.array(list(range(10, 10 + n)))
        model(p[:-1][None], cache=cache)  # generate_step: the prompt but its last token, then the cache evaluated
        mx.eval([c.state for c in cache])
        y = model(p[-1:][None], cache=cache)[:, -1, :]
        mx.eval(y)
        out[f"prefill_{n}"] = {"active_gb": mx.get_active_memory() / GB, "peak_gb": mx.get_peak_memory() / GB,
                               "s": time.perf_counter() - t}
        del cache, y
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the whole prompt)")
    ap.add_argument("--lengths", nargs="*", type=int, default=[512, 2048])
    ap.add_argument("--decode", type=int, default=64, help="decode steps after each prefill")
    ap.add_argument("--gpu-like", action="store_true", help="on MLX's CPU backend: the GPU's attention choice")
    ap.add_argument("--mlx-lm", default=None, help="an mlx_lm.convert directory of the same checkpoint")
    ap.add_argument("--engine", default="fuselm", choices=["fuselm", "mlx-lm"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args()
    if args.engine == "mlx-lm":
        print("RESULT " + json.dumps(mlx_lm_probe(args)))
        return
    out = {"command": "python " + " ".join(sys.argv), "device": str(mx.default_device()), "mlx": mx.__version__,
           "fuselm": fuselm_probe(args)}
    if args.mlx_lm:
        text = subprocess.run([sys.executable, __file__, args.mlx_lm, "--engine", "mlx-lm", "--lengths",
                               *map(str, args.lengths)], check=True, capture_output=True, text=True).stdout
        out["mlx-lm"] = json.loads(next(x for x in text.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
        out["peak_ratio"] = {str(n): round(out["fuselm"][f"prefill_{n}"]["peak_gb"] /
                                           out["mlx-lm"][f"prefill_{n}"]["peak_gb"], 3) for n in args.lengths}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
