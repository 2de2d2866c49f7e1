"""The MLX kernels of one mixture-of-experts layer, fuselm's fuselm::MoE vs mlx-lm's sparse MoE block, by primitive.

    python bench/mlx_moe_layer.py --fuselm WORK/tiny-moe-q4-g64 --mlx-lm WORK/tiny-moe-mlxlm-g64-f32
    python bench/mlx_moe_layer.py ... --tokens 1 128 --dtype bf16 --out bench/results/x.json

The two directories are the ones bench/mlx_peer.py makes of one checkpoint (fuselm's optimized q4 graph,
mlx-lm's `convert -q` directory). One layer's MoE on an evaluated input of T tokens (T = 1: a decode
token; T = 128: a prompt, where both engines sort the rows by expert): fuselm's op as its compiled
step runs it (mx.compile), mlx-lm's block as its generate loop runs it (eager); the graph counted with
mx.export_to_dot (runtime_metal/backends/mlx_backend.py graph_kernels: primitives that launch work).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def fuselm_layer(model: Path, dtype: str, tokens: int) -> dict:
    import fuselm

    return fuselm_moe_kernels(fuselm.load(model, backend="mlx", dtype=dtype, device="cpu").session, tokens)


def fuselm_moe_kernels(sess, tokens: int) -> dict:
    """The kernels of the session's first MoE node on T evaluated tokens, compiled as its decode step runs it."""
    import mlx.core as mx
    from fuselm.runtime_metal.backends.mlx_backend import graph_kernels
    from fuselm.runtime_metal.ops import OPS

    b, g = sess.backend, sess.graph
    n = next(n for n in g.nodes if n.op_type in ("QMoE", "MoE"))
    args = [b.asarray(g.constants[i]) if i in g.constants else None for i in n.inputs[1:]]
    attrs = {k: v for k, v in n.attrs.items() if k != "source"}
    fn = OPS[n.key].fn
    x = mx.random.normal((1, tokens, int(args[0].shape[1]))).astype(b._float)
    prepared = [w.data for k in ("gate_up", "down") if hasattr(w := n.attrs.get(k), "data")]
    mx.eval(x, [a for a in args if a is not None], prepared)  # the experts as a load leaves them
    step = mx.compile(lambda x: fn(b, x, *args, **attrs))
    mx.eval(step(x))  # traced once
    return {"op": n.op_type, "prepared": g.prepared, **graph_kernels([step(x)])}


def mlx_lm_layer(model: Path, tokens: int) -> dict:
    from mlx_lm import load

    m, _ = load(str(model))
    layer = m.layers[0] if hasattr(m, "layers") else m.model.layers[0]
    weight = layer.input_layernorm.weight
    return mlx_lm_moe_kernels(layer.mlp, int(weight.shape[0]), weight.dtype, tokens)


def mlx_lm_moe_kernels(block, hidden: int, dtype, tokens: int) -> dict:
    """The kernels of mlx-lm's sparse MoE block (its generate loop runs it eagerly) on T evaluated tokens."""
    import mlx.core as mx
    from fuselm.runtime_metal.backends.mlx_backend import graph_kernels

    x = mx.random.normal((1, tokens, hidden)).astype(dtype)
    mx.eval(x, block.parameters())
    return {"op": type(block).__name__, **graph_kernels([block(x)])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fuselm", type=Path, required=True, help="fuselm's optimized graph directory")
    ap.add_argument("--mlx-lm", type=Path, required=True, help="mlx-lm's converted directory of the same checkpoint")
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 128])
    ap.add_argument("--dtype", default="f32", help="fuselm's compute dtype (as mlx-lm's directory holds)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for t in args.tokens:
        ours, theirs = fuselm_layer(args.fuselm, args.dtype, t), mlx_lm_layer(args.mlx_lm, t)
        rows.append({"tokens": t, "fuselm": ours, "mlx-lm": theirs})
        a, b = dict(ours["top"]), dict(theirs["top"])
        print(f"\none MoE layer, {t} token(s): fuselm {ours['kernels']} kernels, mlx-lm {theirs['kernels']}")
        print(f"  {'primitive':58s} fuselm mlx-lm")
        for name in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, 0), b.get(k, 0))):
            print(f"  {name[:58]:58s} {a.get(name, ''):>6} {b.get(name, ''):>6}")
    if args.out:
        cmd = " ".join(["python", "bench/mlx_moe_layer.py", *(argv or sys.argv[1:])])
        args.out.write_text(json.dumps({"command": cmd, "dtype": args.dtype, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
