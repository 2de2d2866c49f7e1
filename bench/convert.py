"""Benchmark `fuselm convert` on random-weight checkpoints shaped like Qwen3-0.6B and Qwen3-4B.

    python bench/convert.py                     # full run: 0.6B (f32, q4, baseline) + 4B (f16, q4)
    python bench/convert.py --shapes 0.6b --no-baseline
    python bench/convert.py --shapes 0.6b --quants q4 --no-baseline --repeat 3 --genai-python PY  # traced vs builder vs genai
    python bench/convert.py --make-checkpoint DIR --shapes 4b   # only write a checkpoint (for other benches)

Checkpoints are written streaming in bf16, tensor by tensor into safetensors shards (the HF model
is never built). Each conversion runs in a child process; time is wall clock and peak RSS is the
child's ru_maxrss (os.wait4). The baseline is the whole-model `torch.onnx.export(dynamo=True)` of
the HF model (0.6B only), also in a child; onnxruntime-genai's builder (`-p int4 -e cpu`, 0.6B q4)
when a Python with it is given. Each fuselm conversion runs once per exporter (`builder`, and
`torch`: the traced exporter, tracing on every run as a first convert of the architecture does;
`torch-cached`: its later converts, the trace read from exporter/traced/cache.py's cache). Prints a
table, writes bench/results/convert.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

SHAPES = {
    "0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True),
    "4b": dict(num_hidden_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True),
    # tests, benchmarks' --tiny modes and MLX's CPU backend: the same layout, seconds to write, convert and run
    # (kernel-friendly: K % 256 == 0)
    "tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, intermediate_size=512, vocab_size=2048, tie_word_embeddings=True),
}
# Mixtures of experts (bench/mlx_peer.py): the real configs' shapes, random weights. OLMoE-1B-7B-0924
# (its experts are `intermediate_size` wide), Qwen3-30B-A3B cut to 8 of its 48 layers; `-Nl`: N layers only.
_OLMOE = dict(model_type="olmoe", num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
              head_dim=128, intermediate_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
              vocab_size=50304, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=4096,
              rope_theta=10000.0)
_QWEN3_MOE = dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=40960,
                  rope_theta=1e6)
SHAPES.update({
    "0.6b-8l": {**SHAPES["0.6b"], "num_hidden_layers": 8},  # (MLX CPU memory probes: the 0.6B's layers, fewer)
    "olmoe-1b-7b": _OLMOE, "olmoe-1b-7b-4l": {**_OLMOE, "num_hidden_layers": 4},
    "olmoe-1b-7b-2l": {**_OLMOE, "num_hidden_layers": 2},  # (a local estimate of the full shape's preparation)
    "qwen3-30b-a3b-8l": {**_QWEN3_MOE, "num_hidden_layers": 8}, "qwen3-30b-a3b-4l": {**_QWEN3_MOE, "num_hidden_layers": 4},
    # MLX's CPU backend and tests: the Qwen3-MoE layout in seconds (K % 256 == 0 for the kernels)
    "tiny-moe": {**_QWEN3_MOE, "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 256,
                 "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 2048},
})
# Hybrids with recurrent state (bench/mlx_peer.py), random weights at about 1B parameters: a Qwen3.5-shaped one (gated
# delta rule in 3 of every 4 layers, gated full attention in the 4th) and a Granite-4-shaped one (Mamba-2 layers, 4 of
# 32 attending, a dense shared MLP). Written by transformers' own model class (their state layers' weights have
# shapes and initial values of their own: A_log, dt_bias, the convolutions).
_QWEN35 = dict(model_type="qwen3_5_text", num_hidden_layers=24, hidden_size=1536, intermediate_size=4608,
               num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"], vocab_size=151936, tie_word_embeddings=True,
               rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=1e7)
_GRANITE4 = dict(model_type="granitemoehybrid", num_hidden_layers=32, hidden_size=1536, intermediate_size=3072,
                 shared_intermediate_size=3072, num_local_experts=0, num_experts_per_tok=0, num_attention_heads=12,
                 num_key_value_heads=4, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                 mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
                 layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 2, vocab_size=100352, tie_word_embeddings=True,
                 rms_norm_eps=1e-5, max_position_embeddings=32768, rope_theta=1e4)
SHAPES.update({"qwen3.5-1b": _QWEN35, "granite4-1b": _GRANITE4,
               "qwen3.5-tiny": {**_QWEN35, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                "vocab_size": 2048, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64},
               # (MLX's CPU backend: one attention among four Mamba-2 layers, seconds to write and run)
               "granite4-tiny": {**_GRANITE4, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
                                 "shared_intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 64, "vocab_size": 2048,
                                 "layer_types": ["mamba"] * 2 + ["attention", "mamba"]}})
FROM_CONFIG = ("qwen3_5_text", "granitemoehybrid")
SHARD_BYTES = 2 * 1024**3
EXPORTERS = {"builder": "fuselm convert", "torch": "fuselm convert --exporter torch",
             "torch-cached": "fuselm convert --exporter torch (trace cached)"}
RESULTS = Path(__file__).parent / "results"


def model_type(shape: str) -> str:
    return SHAPES[shape].get("model_type", "qwen3")


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The HF tensors of a Qwen3, Qwen3-MoE or OLMoE checkpoint with config dict `c`, in checkpoint order
    (the names and shapes transformers' save_pretrained writes: one tensor per expert and projection)."""
    kind = c.get("model_type", "qwen3")
    h, d, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    norms = (q, kv) if kind == "olmoe" else (d, d)  # OLMoE's q/k norms span the whole projection
    expert = c.get("moe_intermediate_size", inter) if kind == "qwen3_moe" else inter
    out = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q), p + "self_attn.q_norm.weight": (norms[0],),
                    p + "self_attn.k_norm.weight": (norms[1],), p + "post_attention_layernorm.weight": (h,)})
        if kind == "qwen3":
            out.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                        p + "mlp.down_proj.weight": (h, inter)})
            continue
        out[p + "mlp.gate.weight"] = (c["num_experts"], h)
        for e in range(c["num_experts"]):
            x = f"{p}mlp.experts.{e}."
            out.update({x + "gate_proj.weight": (expert, h), x + "up_proj.weight": (expert, h),
                        x + "down_proj.weight": (h, expert)})
    out["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    return out


def write_checkpoint(out: Path, shape: str, seed: int = 0) -> Path:
    """A random bf16 checkpoint of `shape` (Qwen3, Qwen3-MoE or OLMoE), sharded, written one tensor at a time
    (never more than one tensor in memory: the 7B MoE shapes stream as the dense ones)."""
    import torch
    from transformers import AutoConfig

    from fuselm.synth import train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors.index.json").is_file():
        return out
    tok = train_tokenizer()
    tok.save_pretrained(out)
    c = {"rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1e6, **SHAPES[shape]}
    kind, theta = c.pop("model_type", "qwen3"), c.pop("rope_theta")
    if kind in FROM_CONFIG:
        return _from_config(out, kind, c, theta, seed)
    config = AutoConfig.for_model(kind, **c, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                  dtype="bfloat16", bos_token_id=None, eos_token_id=2, pad_token_id=0)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(out)
    if kind != "qwen3":  # the fields as the real config.json has them (mlx-lm's MoE models read these names)
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(rope_theta=theta, num_experts=c["num_experts"])
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shapes = tensor_shapes({**c, "model_type": kind})
    shards, current, size = [], [], 0
    for name, s in shapes.items():
        nbytes = 2 * int(torch.tensor(s).prod())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map, jobs = {}, []
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        weight_map.update(dict.fromkeys(names, fname))
        jobs.append((out / fname, {n: shapes[n] for n in names}, seed + k))
    if len(jobs) == 1:
        _write_shard(*jobs[0])
    else:  # the shards side by side in forked processes (a 7B checkpoint in ~ the time of one 2 GB shard)
        import multiprocessing

        n = min(len(jobs), os.cpu_count() or 1)
        procs = [multiprocessing.get_context("fork").Process(target=_write_shards, args=(jobs[i::n],)) for i in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"writing the shards of {out} failed (exit codes {[p.exitcode for p in procs]})")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(2 * int(torch.tensor(s).prod()) for s in shapes.values())},
         "weight_map": weight_map}, indent=2))
    return out


def _from_config(out: Path, kind: str, c: dict, theta: float, seed: int) -> Path:
    """A random bf16 checkpoint made by transformers' own class for `kind` (its initialisation), saved sharded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    layers = c["num_hidden_layers"]
    c["layer_types"] = (c["layer_types"] * layers)[:layers]
    config = AutoConfig.for_model(kind, **c, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="2GB")
    if not (out / "model.safetensors.index.json").is_file():  # one file: the index the other shapes have too
        from safetensors import safe_open

        with safe_open(out / "model.safetensors", "pt") as f:
            names = list(f.keys())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}, indent=2))
    return out


def _write_shards(jobs: list) -> None:
    import torch

    torch.set_num_threads(1)
    for job in jobs:
        _write_shard(*job)


def _write_shard(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    """One safetensors shard of random bf16 tensors (norms around 1, the rest std 0.02), one tensor in memory at a time."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, s in shapes.items():
        n = 2 * int(torch.tensor(s).prod())
        header[name] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, s in shapes.items():
            t = torch.randn(s, generator=gen, dtype=torch.float32).mul_(1.0 if "norm" in name else 0.02)
            if "norm" in name:
                t.add_(1.0)
            f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            del t


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` as a child; wall time, CPU time (user + sys, less sensitive to other load on a
    shared box) and the child's peak RSS (bench/_child.py)."""
    os.sync()  # start every run without an earlier run's writeback in flight
    c = run_child(cmd, None if env is None else {**os.environ, **env}, capture=False)
    if c.returncode != 0:
        raise SystemExit(f"failed ({c.returncode}): {' '.join(cmd)}")
    return {"seconds": c.wall_s, "cpu_seconds": c.cpu_s, "peak_rss_mb": c.peak_rss_mb, "load_before": round(c.load_before, 1)}


BASELINE = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
hf, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
model.config.use_cache = False
t1 = time.perf_counter()
ids = torch.ones(1, 8, dtype=torch.long)
torch.onnx.export(model, (ids,), out, dynamo=True, opset_version=23, external_data=True,
                  input_names=["input_ids"], output_names=["logits"],
                  dynamic_shapes={"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}})
print(f"baseline: load {t1 - t0:.1f} s, export {time.perf_counter() - t1:.1f} s", flush=True)
"""


def _median_run(cmd: list[str], repeat: int, out: Path, env: dict | None = None) -> dict:
    """`measure` `repeat` times; the run with the median wall time (its RSS and CPU with it)."""
    runs = sorted((measure(cmd, env) for _ in range(repeat)), key=lambda r: r["seconds"])
    r = dict(runs[len(runs) // 2], runs=[x["seconds"] for x in runs], peak_rss_mb_max=max(x["peak_rss_mb"] for x in runs))
    r["output_mb"] = round(sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20, 1)
    return r


def _genai_python(arg: str | None) -> str | None:
    """A Python that imports onnxruntime_genai (--genai-python, else this one), or None."""
    python = arg or sys.executable
    ok = subprocess.run([python, "-c", "import onnxruntime_genai.models.builder"], capture_output=True).returncode == 0
    return python if ok else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=["0.6b", "4b"], choices=list(SHAPES))
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "fuselm-bench-convert")
    ap.add_argument("--no-baseline", action="store_true", help="skip whole-model torch.onnx.export")
    ap.add_argument("--quants", nargs="*", default=None, help="only these precisions (default: f32 q4 for 0.6b, f16 q4 for 4b)")
    ap.add_argument("--exporters", nargs="*", default=list(EXPORTERS), choices=list(EXPORTERS),
                    help="fuselm exporters to run (torch: the traced exporter's first convert of an architecture, "
                         "tracing it; torch-cached: a later one, its trace read from the cache)")
    ap.add_argument("--genai-python", default=None, metavar="PYTHON",
                    help="a Python with onnxruntime-genai, for its builder (-p int4 -e cpu) on 0.6b q4; skipped if none")
    ap.add_argument("--repeat", type=int, default=1, help="runs per engine; the median is reported")
    ap.add_argument("--results", default="convert.json", help="file name under bench/results/")
    ap.add_argument("--make-checkpoint", type=Path, default=None, metavar="DIR",
                    help="only write the random checkpoint of the (first) shape to DIR")
    args = ap.parse_args(argv)
    if args.make_checkpoint:
        print(write_checkpoint(args.make_checkpoint, args.shapes[0]))
        return 0
    runs = {"0.6b": ["f32", "q4"], "4b": ["f16", "q4"], "tiny": ["f32", "q4"]}  # (the MoE shapes: q4)
    genai = _genai_python(args.genai_python)
    rows = []
    for shape in args.shapes:
        t0 = time.perf_counter()
        # In a child: the parent must stay small, since Linux carries the RSS a child had at fork
        # over into its ru_maxrss.
        hf = args.work / f"qwen3-{shape}-hf"
        subprocess.run([sys.executable, __file__, "--shapes", shape, "--make-checkpoint", str(hf)], check=True)
        print(f"[{shape}] checkpoint ready in {time.perf_counter() - t0:.0f} s: {hf}", flush=True)
        for quant in [q for q in runs.get(shape, ["q4"]) if args.quants is None or q in args.quants]:
            for exporter in args.exporters:  # each engine alone in its own process, in turn
                out = args.work / f"qwen3-{shape}-{quant}-{exporter}"
                cmd = [sys.executable, "-m", "fuselm.cli", "convert", str(hf), "-o", str(out), "--quant", quant,
                       "--exporter", exporter.removesuffix("-cached"), "--force", "--quiet"]
                env = {"FUSELM_TRACE_CACHE": "0"}  # every run traces (a first convert of the architecture)
                if exporter == "torch-cached":  # one unmeasured convert fills the cache, then every run reads it
                    env = {"FUSELM_TRACE_CACHE": "1", "FUSELM_TRACE_CACHE_DIR": str(args.work / "trace-cache")}
                    subprocess.run(cmd, env={**os.environ, **env}, check=True)
                r = _median_run(cmd, args.repeat, out, env)
                r.update(shape=shape, tool=EXPORTERS[exporter], quant=quant)
                rows.append(r)
                print(r, flush=True)
            if shape == "0.6b" and quant == "q4":
                if genai is None:
                    print("onnxruntime-genai is not installed (pass --genai-python): its builder is skipped", flush=True)
                else:
                    out = args.work / "genai-q4"
                    r = _median_run([genai, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                                     "-p", "int4", "-e", "cpu", "-c", str(args.work / "genai-cache")], args.repeat, out)
                    r.update(shape=shape, tool="onnxruntime-genai builder", quant="q4")
                    rows.append(r)
                    print(r, flush=True)
        if shape == "0.6b" and not args.no_baseline:
            out = args.work / "baseline" / "model.onnx"
            out.parent.mkdir(parents=True, exist_ok=True)
            r = _median_run([sys.executable, "-c", BASELINE, str(hf), str(out)], args.repeat, out.parent)
            r.update(shape=shape, tool="torch.onnx.export(dynamo=True)", quant="f32")
            rows.append(r)
            print(r, flush=True)
    _report(rows, args.results, "python bench/convert.py " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


def _report(rows: list[dict], name: str = "convert.json", command: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fuselm convert (random-weight Qwen3-shaped bf16 checkpoints)")
    for col in ("shape", "tool", "quant", "wall s", "cpu s", "peak RSS (MB)", "output (MB)", "load"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["shape"], r["tool"], r["quant"], f"{r['seconds']:.1f}", f"{r['cpu_seconds']:.1f}",
                      f"{r['peak_rss_mb']:.0f}", f"{r['output_mb']:.0f}", f"{r['load_before']:.1f}")
    Console().print(table)
    base = next((r for r in rows if r["tool"].startswith("torch")), None)
    ours = next((r for r in rows if r["shape"] == "0.6b" and r["quant"] == "f32" and r["tool"] == "fuselm convert"), None)
    summary = {}

    def q4(tool):
        return next((r for r in rows if r["shape"] == "0.6b" and r["quant"] == "q4" and r["tool"] == tool), None)

    genai, traced, builder = q4("onnxruntime-genai builder"), q4(EXPORTERS["torch"]), q4(EXPORTERS["builder"])
    cached = q4(EXPORTERS["torch-cached"])
    for exporter, r in (("traced", traced), ("traced_cached", cached), ("builder", builder)):
        if r and genai:
            key = f"0.6b_q4_{exporter}_vs_genai"
            summary[key] = {"speedup": round(genai["seconds"] / r["seconds"], 2),
                            "cpu_speedup": round(genai["cpu_seconds"] / r["cpu_seconds"], 2),
                            "peak_rss_ratio": round(r["peak_rss_mb"] / genai["peak_rss_mb"], 3)}
            print(f"0.6B q4, fuselm {exporter} vs onnxruntime-genai's builder: {summary[key]}")
    if traced and builder:
        summary["0.6b_q4_traced_over_builder_seconds"] = round(traced["seconds"] / builder["seconds"], 2)
    if base and ours:
        summary["speedup_0.6b_f32_vs_baseline"] = round(base["seconds"] / ours["seconds"], 1)
        summary["cpu_speedup_0.6b_f32_vs_baseline"] = round(base["cpu_seconds"] / ours["cpu_seconds"], 1)
        print(f"0.6B f32 vs baseline: {summary['speedup_0.6b_f32_vs_baseline']}x less wall time, "
              f"{summary['cpu_speedup_0.6b_f32_vs_baseline']}x less CPU time")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({"command": command, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                                            "python": platform.python_version()},
                                "rows": rows, **summary}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
