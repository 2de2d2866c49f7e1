"""What MNN's converter does with fuselm's graphs, rerunnable.

    python bench/mnn_convert_check.py            # needs .venv-mnn (python bench/mnn_peer.py --setup)

A tiny random Qwen3 (fuselm.synth) is converted f32 and q4 (block 32) and optimized; each of the
four graphs (exported / optimized x f32 / q4) has its model-local functions inlined
(`onnx.inliner.inline_local_functions`: FusedRoPE's body is written per rotary layout, no `If`) and
goes to `mnnconvert -f ONNX` (MNN 3.6.1, in .venv-mnn through bench/mnn_safe.py: MNN's telemetry
blocked, see there). Each converted model is then run by MNN's Module API
(`MNN.nn.load_module_from_file`) on the feeds of one step (4 new tokens after 3 cached ones) and
compared with onnxruntime (optimizations off) on the same feeds: logits and every present cache.
Records per graph: its op types, whether it converts (and the converter's complaints), whether it
runs, the max abs difference. Writes bench/results/mnn-convert.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import mnn_peer  # noqa: E402  (stdlib only: the .venv-mnn paths, safe_env, safe_cmd)

RESULTS = HERE / "results"
SEQ, PAST = 4, 3


def _mnn_child(job: Path) -> None:
    """In .venv-mnn (via bench/mnn_safe.py): run each converted model on its feeds, save the outputs."""
    import MNN
    import numpy as np

    spec = json.loads(job.read_text())
    feeds = np.load(spec["feeds"])
    names = list(spec["inputs"])
    module = MNN.nn.load_module_from_file(spec["mnn"], names, spec["outputs"])
    args = []
    for name in names:
        a = feeds[name]
        if a.dtype == np.int64:
            a = a.astype(np.int32)  # MNN keeps int64 graph inputs as int32
        args.append(MNN.expr.const(a, list(a.shape), MNN.expr.NCHW,
                                   MNN.expr.dtype.int if a.dtype == np.int32 else MNN.expr.dtype.float))
    outs = module.forward(args)
    got = {}
    for name, var in zip(spec["outputs"], outs, strict=False):  # a model that lost outputs returns fewer
        var = MNN.expr.convert(var, MNN.expr.NCHW)
        got[name] = np.array(var.read(), dtype=np.float32).reshape(var.shape)
    np.savez(spec["result"], **got)


def _graphs(work: Path) -> dict[str, Path]:
    import fuselm
    from fuselm.synth import make_checkpoint

    ckpt = work / "qwen3-tiny"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(ckpt, "qwen3")
    out = {}
    for quant in ("f32", "q8", "q4"):
        exp, opt = work / f"{quant}-exported", work / f"{quant}-optimized"
        fuselm.convert(ckpt, exp, quant=quant, force=True, quiet=True)
        fuselm.optimize(exp, opt, force=True, quiet=True)
        out[f"{quant}-exported"], out[f"{quant}-optimized"] = exp / "model.onnx", opt / "model.onnx"
    return out


def _unsupported(log: str) -> dict:
    """What the converter names as missing: ops ("These Op Not Support: A | B") and tensor types
    ("Don't support 21": a TensorProto data type number)."""
    import onnx

    ops = sorted({op.strip() for m in re.finditer(r"These Op Not Support: (.*)", log) for op in m.group(1).split("|")})
    types = sorted({onnx.TensorProto.DataType.Name(int(m.group(1))) for m in re.finditer(r"Don't support (\d+)", log)})
    return {"unsupported_ops": ops, "unsupported_tensor_types": types,
            "broadcast_errors": len(re.findall(r"Broad cast error", log))}


def _complaints(log: str) -> list[str]:
    keep = re.compile(r"support|error|fail|invalid|abort|unknown|not implement|can't|cannot", re.I)
    return list(dict.fromkeys(ln.strip() for ln in log.splitlines() if keep.search(ln)))[:20]


def check_one(name: str, path: Path, work: Path) -> dict:
    import numpy as np
    import onnx
    from onnx.inliner import inline_local_functions

    from fuselm import contract
    from fuselm.reference import ort_session

    model = onnx.load(str(path))
    before = Counter(f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node)
    inlined = inline_local_functions(model)
    del inlined.functions[:]
    ops = Counter(f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in inlined.graph.node)
    src = work / f"{name}-inlined.onnx"
    onnx.save(inlined, str(src))
    dq_types = sorted({onnx.TensorProto.DataType.Name(i.data_type) for i in inlined.graph.initializer
                       if any(n.op_type == "DequantizeLinear" and n.input[0] == i.name for n in inlined.graph.node)})
    row = {"graph": name, "nodes": len(model.graph.node), "nodes_inlined": len(inlined.graph.node),
           "ops_before_inlining": dict(before), "ops_inlined": dict(sorted(ops.items())),
           "dequantize_weight_types": dq_types, "if_nodes_after_inlining": ops.get("If", 0)}
    dst = work / f"{name}.mnn"
    dst.unlink(missing_ok=True)
    t = time.perf_counter()
    conv = subprocess.run(mnn_peer.safe_cmd("-m", "MNN.tools.mnnconvert", "-f", "ONNX", "--modelFile", str(src),
                                            "--MNNModel", str(dst), "--bizCode", "fuselm"),
                          capture_output=True, text=True, env=mnn_peer.safe_env(), timeout=600)
    log = conv.stdout + conv.stderr
    row.update(convert_rc=conv.returncode, convert_s=round(time.perf_counter() - t, 2),
               converts=conv.returncode == 0 and "Converted Failed" not in log and dst.is_file()
               and dst.stat().st_size > 0, **_unsupported(log), converter_says=_complaints(log))
    (work / f"{name}.convert.log").write_text(log)
    if not row["converts"]:
        return row
    feeds = contract.step_feeds(inlined.graph.input, SEQ, PAST, contract.vocab_size(inlined), seed=1)
    outputs = [o.name for o in inlined.graph.output]
    want = dict(zip(outputs, ort_session(inlined).run(outputs, feeds), strict=True))
    np.savez(work / f"{name}.feeds.npz", **feeds)
    job = work / f"{name}.job.json"
    job.write_text(json.dumps({"mnn": str(dst), "feeds": str(work / f"{name}.feeds.npz"), "inputs": list(feeds),
                               "outputs": outputs, "result": str(work / f"{name}.mnn-out.npz")}))
    run = subprocess.run(mnn_peer.safe_cmd(__file__, "--mnn-child", str(job)), capture_output=True, text=True,
                         env=mnn_peer.safe_env(), timeout=600)
    row["run_rc"] = run.returncode
    if run.returncode != 0 or not (work / f"{name}.mnn-out.npz").is_file():
        row.update(runs=False, run_says=(run.stdout + run.stderr).strip().splitlines()[-6:])
        return row
    got = np.load(work / f"{name}.mnn-out.npz")
    diffs, shapes = {}, {}
    row["outputs_returned"] = f"{len(got.files)}/{len(outputs)}"
    for o in outputs:
        if o not in got.files:
            diffs[o], shapes[o] = None, None
            continue
        g = got[o]
        shapes[o] = list(g.shape)
        diffs[o] = (float(np.abs(g.astype(np.float64) - want[o]).max()) if g.shape == want[o].shape and g.size
                    else None)
    ok = [d for d in diffs.values() if d is not None]
    row.update(runs=True, outputs_matching_shape=f"{len(ok)}/{len(outputs)}",
               max_abs_diff_logits=diffs.get(contract.LOGITS), max_abs_diff_all=max(ok) if ok else None,
               logits_abs_max=float(np.abs(want[contract.LOGITS]).max()),
               wrong_shapes={o: s for o, s in shapes.items() if diffs[o] is None})
    return row


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mnn-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=None, help="keep the graphs and MNN models here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=RESULTS / "mnn-convert.json")
    args = ap.parse_args(argv)
    if args.mnn_child:
        _mnn_child(args.mnn_child)
        return 0
    with tempfile.TemporaryDirectory(prefix="fuselm-mnn-convert-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [check_one(name, path, work) for name, path in _graphs(work).items()]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("ops")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/mnn_convert_check.py", "mnn": mnn_peer.versions(),
                                    "feeds": f"one step: {SEQ} new tokens after {PAST} cached (random cache)",
                                    "reference": "onnxruntime CPU, graph optimizations off, same inlined graph",
                                    "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
