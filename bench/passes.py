"""Benchmark the pass pipeline on Qwen3-0.6B- and Qwen3-4B-shaped graphs (weights external).

    python bench/passes.py                          # 0.6b + 4b (q4), onnxslim side by side, scaling
    python bench/passes.py --shapes 0.6b --quant f32 --no-onnxslim --no-scaling --json passes-f32.json

For each shape: a random bf16 checkpoint (bench/convert.py's streaming writer), `fuselm convert`,
then, in this process, the pipeline timed pass by pass: load (graph only; weights stay mapped on
disk), every pass, and separately the save that streams the weights into the new model.onnx.data.
Then `fuselm optimize` end to end and `onnxslim` on the same graph, each in a child process (wall
time and peak RSS). Scaling: tiny Qwen3 graphs with 7..56 layers, pipeline time per layer.
Prints tables and writes bench/results/passes.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _child import run_child  # noqa: E402 - bench/ is no package: its helpers sit beside each script

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MNN_QWEN3_06B_OPS = 385  # MNN's op count for Qwen3-0.6B after its passes


def _convert_bench():
    spec = importlib.util.spec_from_file_location("bench_convert", HERE / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def child(cmd: list[str]) -> dict:
    """Run `cmd` in a child: wall seconds and peak RSS (MiB) (bench/_child.py)."""
    c = run_child(cmd)
    if c.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{c.stderr[-2000:]}")
    return {"seconds": c.wall_s, "peak_rss_mib": round(c.peak_rss_mb)}


def time_pipeline(onnx_path: Path, out_dir: Path | None = None) -> dict:
    """Load + each pass + (optionally) save, timed in this process."""
    from fuselm.passes import graphio
    from fuselm.passes.draw import nodes_per_layer
    from fuselm.passes.pipeline import PIPELINE

    t0 = time.perf_counter()
    model = graphio.load(onnx_path)
    row = {"load_s": time.perf_counter() - t0, "nodes_in": model.graph.num_nodes(), "passes": {}}
    for p in PIPELINE:
        t = time.perf_counter()
        model, _, stats = p(model)
        row["passes"][p.name] = {"seconds": round(time.perf_counter() - t, 4), "fired": len(stats.fired)}
    row["pipeline_s"] = time.perf_counter() - t0  # load + passes: what the < 2 s goal is about
    row["nodes_out"] = model.graph.num_nodes()
    row["nodes_per_layer"] = nodes_per_layer(model.graph)  # {"layers": [...], "per_layer", "shared"}
    row["ops_out"] = dict(Counter(n.op_type for n in model.graph).most_common())
    if out_dir is not None:
        t = time.perf_counter()
        graphio.save(model, out_dir)
        row["save_s"] = time.perf_counter() - t
    return row


def scaling(layers=(7, 14, 28, 56)) -> list[dict]:
    """Pipeline time on tiny Qwen3 graphs of growing depth (structure is what the passes walk)."""
    import fuselm
    from fuselm.synth import make_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in layers:
            ckpt = make_checkpoint(Path(tmp) / f"ck{n}", "qwen3", num_hidden_layers=n)
            out = fuselm.convert(ckpt, Path(tmp) / f"ex{n}", quant="q4", quiet=True)
            best = min((time_pipeline(out / "model.onnx") for _ in range(5)), key=lambda r: r["pipeline_s"])
            rows.append({"layers": n, "pipeline_s": round(best["pipeline_s"], 3),
                         "ms_per_layer": round(1000 * best["pipeline_s"] / n, 1), "nodes_out": best["nodes_out"]})
    return rows


def onnxslim_run(src: Path, work: Path) -> dict:
    out = work / "slim.onnx"
    code = ("import sys, onnxslim; onnxslim.slim(sys.argv[1], sys.argv[2], save_as_external_data=True)")
    row = child([sys.executable, "-c", code, str(src), str(out)])
    import onnx

    row["nodes_out"] = len(onnx.load(str(out), load_external_data=False).graph.node)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["0.6b", "4b"], choices=["0.6b", "4b"])
    ap.add_argument("--quant", default="q4", choices=["f32", "f16", "q8", "q4"])
    ap.add_argument("--work", default=None, help="where checkpoints and conversions go (kept for reruns)")
    ap.add_argument("--no-onnxslim", action="store_true")
    ap.add_argument("--no-scaling", action="store_true")
    ap.add_argument("--json", default="passes.json", help="file name under bench/results/ (default passes.json)")
    args = ap.parse_args(argv)
    work = Path(args.work or Path(tempfile.gettempdir()) / "fuselm-bench")
    work.mkdir(parents=True, exist_ok=True)
    cb = _convert_bench()
    rows = []
    for shape in args.shapes:
        layers = cb.SHAPES[shape]["num_hidden_layers"]
        ckpt = cb.write_checkpoint(work / f"ckpt-{shape}", shape)
        exported = work / f"exported-{shape}-{args.quant}"
        if not (exported / "fuselm.json").is_file():
            child([sys.executable, "-m", "fuselm.cli", "convert", str(ckpt), "-o", str(exported), "--quant",
                   args.quant, "--force", "--quiet"])
        out = work / f"optimized-{shape}-{args.quant}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        row = {"shape": shape, "layers": layers, "quant": args.quant, **time_pipeline(exported / "model.onnx", out)}
        shutil.rmtree(out)
        cli = child([sys.executable, "-m", "fuselm.cli", "optimize", str(exported), "-o", str(out), "--force", "--quiet"])
        row["fuselm_optimize_cli"] = cli
        if not args.no_onnxslim:
            try:
                row["onnxslim"] = onnxslim_run(exported / "model.onnx", work)
            except Exception as e:  # reported, not fatal: the comparison is a side note
                row["onnxslim"] = {"error": str(e).splitlines()[-1][:300]}
        rows.append(row)
        _print(row)
    result = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}, "rows": rows,
              "mnn_qwen3_0.6b_ops": MNN_QWEN3_06B_OPS}
    if not args.no_scaling:
        result["scaling"] = scaling()
        print("scaling (tiny qwen3, q4):", json.dumps(result["scaling"]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _print(row: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Qwen3-{row['shape']}-shaped ({row['layers']} layers, {row['quant']}): "
              f"{row['nodes_in']} -> {row['nodes_out']} nodes, {row['nodes_per_layer']['per_layer']} per layer + "
              f"{row['nodes_per_layer']['shared']} shared (MNN: {MNN_QWEN3_06B_OPS} for 0.6B)",
              title_justify="left")
    t.add_column("step")
    t.add_column("seconds", justify="right")
    t.add_column("note")
    t.add_row("load graph (weights stay on disk)", f"{row['load_s']:.3f}", "")
    for name, p in row["passes"].items():
        t.add_row(f"  {name}", f"{p['seconds']:.3f}", f"{p['fired']} fired")
    t.add_row("pipeline (load + passes)", f"{row['pipeline_s']:.3f}", "goal < 2 s for 28 layers")
    t.add_row("save (streams every weight)", f"{row['save_s']:.3f}", "")
    c = row["fuselm_optimize_cli"]
    t.add_row("fuselm optimize (child, end to end)", f"{c['seconds']:.2f}", f"peak RSS {c['peak_rss_mib']} MiB")
    s = row.get("onnxslim")
    if s:
        t.add_row("onnxslim (child, same graph)", f"{s.get('seconds', float('nan')):.2f}",
                  s.get("error") or f"peak RSS {s['peak_rss_mib']} MiB, {s['nodes_out']} nodes")
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
