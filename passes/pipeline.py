"""The pass pipeline: `optimize` runs it, `diff` walks the same list and reports pass by pass."""

from __future__ import annotations

import gc
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import onnx_ir as ir

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.genai_config import meta_from_genai_config
from fuselm.modeldir import atomic_output_dir, copy_tokenizer_files, write_meta

from . import graphio
from .attention_3d import AttentionTo3D
from .base import Fusion, Pass, Stats, ensure_sorted
from .from_genai import FromGenAI
from .fuse_attention import FuseAttention
from .fuse_gate_up import FuseGateUp
from .fuse_qkv import FuseQKV
from .fuse_rms_norm import FuseRMSNorm
from .fuse_rope import FuseRoPE
from .fuse_rope_norm import FuseRoPENorm
from .fuse_swiglu import FuseSwiGLU
from .last_logits import LastPositionLogits
from .ort_gather_quantized import OrtGatherBlockQuantized
from .ort_gqa import DEFAULT_MAX_LENGTH, OrtGroupQueryAttention
from .ort_matmul_nbits import DEFAULT_ACCURACY_LEVEL, OrtMatMulNBits
from .ort_packed_qkv import OrtPackedQKV
from .ort_skip_norm import OrtSkipRMSNorm
from .remove_dead_shape_ops import RemoveDeadShapeOp
from .reorder_qkv import ReorderQKVProjections
from .rope_3d import RoPETo3D
from .upgrade_opset import UpgradeOpset

PIPELINE: list[Pass] = [
    UpgradeOpset(),
    FromGenAI(),
    RemoveDeadShapeOp(),
    ReorderQKVProjections(),
    FuseQKV(),
    FuseGateUp(),
    FuseRMSNorm(),
    FuseAttention(),
    FuseRoPE(),
    AttentionTo3D(),
    FuseRoPENorm(),
    RoPETo3D(),
    FuseSwiGLU(),
]
TARGETS = ("onnxruntime",)


def target_passes(target: str | None, accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
                  max_length: int = DEFAULT_MAX_LENGTH) -> list[Pass]:
    """The passes that lower the portable graph to one runtime's own ops, run after PIPELINE.

    `onnxruntime`: its contrib ops (com.microsoft), as onnxruntime-genai's builder writes them;
    `max_length` sizes GroupQueryAttention's cos/sin caches (genai_config's max_length)."""
    if target is None:
        return []
    if target != "onnxruntime":
        raise FuselmError(f"--target {target!r}: no such target; valid targets: {', '.join(TARGETS)}")
    return [OrtGroupQueryAttention(max_length), OrtPackedQKV(), OrtSkipRMSNorm(), OrtMatMulNBits(accuracy_level),
            OrtGatherBlockQuantized()]


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def resolve_skip(skip, target: str | None = None) -> set[str]:
    """Class names of the passes to skip; `skip` takes class names or kebab/snake aliases."""
    passes = [*PIPELINE, *target_passes(target)]
    table = {_key(alias): p.name for p in passes for alias in (p.name, *p.aliases)}
    chosen = set()
    for s in skip or ():
        for part in str(s).split(","):
            if not part.strip():
                continue
            name = table.get(_key(part))
            if name is None:
                valid = ", ".join(f"{p.name} ({'/'.join(p.aliases[:1])})" for p in passes)
                raise FuselmError(f"--skip {part!r}: no such pass; valid passes: {valid}")
            chosen.add(name)
    return chosen


def run_pipeline(model: ir.Model, skip: set[str] = frozenset(), on_pass=None, target: list[Pass] = ()) -> list[dict]:
    """Run every pass not in `skip` in order, then the `target` passes; returns one record per pass
    (skipped ones too).

    `on_pass(record, model)` is called after each pass that ran (diff uses it to check numbers).
    """
    records = []
    # The passes allocate many small objects and free none until the end: the cyclic GC would
    # only rescan the graph over and over.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for p in [*PIPELINE, *target]:
            _run_one(p, model, skip, records, on_pass)
    finally:
        if gc_was_enabled:
            gc.enable()
    return records


def _run_one(p: Pass, model: ir.Model, skip: set[str], records: list[dict], on_pass) -> None:
    """Run one pass in place on `model` and append its record.

    A pass never crashes the pipeline (graphs other tools wrote reach shapes no pattern foresaw): when it
    raises or leaves a graph that is no DAG, the model is restored and a fusion is retried one anchor at
    a time, each rewrite kept only if the graph stays a DAG; the others are recorded as skips with the
    reason. A FuselmError (bad input, named fix) still stops the run."""
    doc = (type(p).__doc__ or "").strip().split("\n\n")[0]
    record = {"pass": p.name, "doc": " ".join(line.strip() for line in doc.splitlines())}
    if p.name in skip:
        record.update(skipped_by_user=True, changed=False)
        records.append(record)
        return
    before = Counter(n.op_type for n in model.graph)
    t0 = time.perf_counter()
    backup = model.clone()  # the weights' tensors are shared, not copied
    try:
        _, changed, stats = p(model)
        ensure_sorted(model.graph)  # raises ValueError when the pass left a cycle
    except FuselmError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a pass on a foreign graph becomes a recorded skip
        changed, stats = _careful(p, model, backup, f"{type(e).__name__}: {str(e)[:200]}")
    record.update(skipped_by_user=False, changed=changed, seconds=time.perf_counter() - t0,
                  nodes_before=sum(before.values()), nodes_after=model.graph.num_nodes(),
                  ops_before=dict(sorted(before.items())),
                  ops_after=dict(sorted(Counter(n.op_type for n in model.graph).items())),
                  **stats.as_dict())
    records.append(record)
    if on_pass is not None:
        on_pass(record, model)


def _restore(model: ir.Model, saved: ir.Model) -> None:
    model.graph = saved.graph
    model.functions.clear()
    model.functions.update(saved.functions)


def _careful(p: Pass, model: ir.Model, backup: ir.Model, reason: str) -> tuple[bool, Stats]:
    """After a failed run: restore `model`, then (fusions with named anchors) apply one anchor at a time."""
    stats = Stats()
    _restore(model, backup)
    names = [a.name for a in p.anchors(model.graph)] if isinstance(p, Fusion) else []
    if not names or len(set(names)) != len(names) or not all(names):
        stats.skip(p.name, f"the pass failed on this graph and was undone ({reason})")
        return False, stats
    changed = False
    for name in names:
        trial = model.clone()
        p.only = {name}
        try:
            _, fired, trial_stats = p(trial)
            ensure_sorted(trial.graph)
        except FuselmError:
            raise
        except Exception as e:  # noqa: BLE001
            stats.skip(name, f"rewriting here fails on this graph and was undone ({type(e).__name__}: {str(e)[:160]})")
            continue
        finally:
            p.only = None
        stats.merge(trial_stats)
        if fired:
            _restore(model, trial)
            changed = True
    return changed, stats


def optimize(in_path, out, skip=(), force: bool = False, quiet: bool = False, target: str | None = None,
             accuracy_level: int = DEFAULT_ACCURACY_LEVEL, last_logits: bool = False) -> Path:
    """Run the pipeline on a model directory or .onnx file; write a model directory at `out`.

    `target="onnxruntime"` then lowers the graph to onnxruntime's contrib ops (`target_passes`);
    `accuracy_level` is MatMulNBits' (4: int8 activations, onnxruntime-genai's CPU default);
    `last_logits`: a graph for generation only, the head on the last position (LastPositionLogits)."""
    onnx_path, meta = graphio.resolve(in_path)
    skipped = resolve_skip(skip, target)
    lowering = target_passes(target, accuracy_level, context_length(meta, in_path))
    lowering += [LastPositionLogits()] if last_logits else []
    t0 = time.perf_counter()
    model = graphio.load(onnx_path)
    records = run_pipeline(model, skipped, target=lowering)
    passes_seconds = time.perf_counter() - t0
    out = Path(out)
    with atomic_output_dir(out, force=force) as tmp:
        graphio.save_checked(model, tmp, "the optimized graph",
                             f"run `fuselm diff` on {in_path} and --skip the pass that breaks it")
        new_meta = dict(meta) if meta is not None else \
            graph_meta(model, onnx_path, Path(in_path) if Path(in_path).is_dir() else None)
        new_meta.pop("schema_version", None)
        new_meta["stage"] = "optimized"
        new_meta["passes"] = [_meta_record(r) for r in records]
        write_meta(tmp, new_meta)
        if Path(in_path).is_dir():
            copy_tokenizer_files(in_path, tmp)
    if not quiet:
        from .report import print_summary

        print_summary(records, title=f"fuselm optimize: {in_path} -> {out} "
                      f"({passes_seconds:.2f} s load + passes, {time.perf_counter() - t0:.2f} s total)"
                      f"{upgrade_note(records)}")
    return out


def context_length(meta: dict | None, in_path) -> int:
    """The positions a lowered graph must cover: fuselm.json's (or genai_config.json's) context length,
    else genai_config's default, 4096 (written as max_length beside the model too)."""
    if meta is None and Path(in_path).is_dir():
        meta = meta_from_genai_config(in_path)
    return (meta or {}).get("max_position_embeddings") or DEFAULT_MAX_LENGTH


def upgrade_note(records: list[dict]) -> str:
    """`; default-domain opset 20 -> 23` when UpgradeOpset converted the graph, else ''."""
    up = next((r for r in records if r["pass"] == UpgradeOpset().name and r.get("fired")), None)
    return f"; {up['fired_at'][0]} (onnx version converter)" if up else ""


def _meta_record(r: dict) -> dict:
    # No timings: the same input and flags must give a byte-identical fuselm.json.
    keep = ("pass", "skipped_by_user", "changed", "nodes_before", "nodes_after", "fired", "fired_at",
            "skipped", "counts")
    return {k: r[k] for k in keep if k in r}


def graph_meta(model: ir.Model, source: Path, src_dir: Path | None = None) -> dict:
    """fuselm.json fields a plain .onnx input lets us infer (dims from the cache inputs and logits);
    an onnxruntime-genai directory's genai_config.json adds context length and special tokens."""
    past = [v for v in model.graph.inputs if contract.is_past(v.name) and contract.parse_cache(v.name).kind == "key"]
    dims: dict = {"layers": len(past) or None}
    if past and past[0].shape is not None and past[0].shape.rank() == 4:
        kv, hd = past[0].shape[1], past[0].shape[3]
        dims.update(kv_heads=kv if isinstance(kv, int) else None, head_dim=hd if isinstance(hd, int) else None)
    heads = {n.attributes[a].value for n in model.graph for op, a in (("Attention", "q_num_heads"),
             ("GroupQueryAttention", "num_heads")) if n.op_type == op and a in n.attributes}
    if len(heads) == 1:
        dims["heads"] = heads.pop()
    logits = next((v for v in model.graph.outputs if v.name == contract.LOGITS), None)
    if logits is not None and logits.shape is not None and isinstance(logits.shape[-1], int):
        dims["vocab"] = logits.shape[-1]
    extra = meta_from_genai_config(src_dir) if src_dir is not None else {}
    dims.update(extra.pop("dims", {}))
    return {"stage": "optimized", "source": {"onnx": os.fspath(source)}, "family": None, "dims": dims,
            "graph": {"opset": contract.OPSET, "domains": dict(model.opset_imports)}, **extra}


def _text_kl(in_path, onnx_path, reference, text, max_tokens):
    """kl(path) -> the mean KL divergence of a stage from HF on the text's windows; `.first`: the input's."""
    from fuselm import text as text_mod
    from fuselm.reference import Metrics, OrtScorer, Reference
    from fuselm.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(in_path), required=True)
    pieces = text_mod.windows(tok.encode(text_mod.read_text(text)[0]), text_mod.WINDOW, max_tokens)
    ref = Reference(reference)

    def kl(path) -> float:
        scorer, metrics = OrtScorer(path), Metrics()
        for ids in pieces:
            metrics.add(ids, scorer.score(ids.tolist()), ref.score(ids))
        return metrics.summary()["kl_mean"]

    kl.first = kl(onnx_path)
    return kl


def diff(in_path, html=None, json_path=None, skip=(), quiet: bool = False, target: str | None = None,
         accuracy_level: int = DEFAULT_ACCURACY_LEVEL, runtime=None, reference=None, text=None,
         max_tokens: int | None = None) -> dict:
    """Walk the pipeline on a model directory or .onnx file and report, pass by pass, what changed.

    Per pass: changed or not, node counts before -> after by op type, matches fired and skipped
    with reasons, the numeric drift (onnxruntime with its optimizations off, this stage against
    the previous one: max abs logit difference for a prefill and a decode step with past) and the
    time taken. `html` writes one self-contained page with the same tables and a drawing of one
    decoder layer before and after each pass; `json_path` the same data as JSON. `target` adds
    the lowering passes (`optimize`'s), each with its drift. `runtime(path, outputs) -> records`, when given,
    adds a runtime's load-time rewrites after the passes (fuselm.diff's `--target mlx`: the last stage's graph
    file and its onnxruntime outputs go in). `reference` (an HF checkpoint directory) adds the mean KL divergence
    of each pass's graph from HF on a text (the bundled one unless `text`; onnxruntime scoring,
    runtime_metal/evaluate.py), the input's first. A model directory's quantization (its mixed-precision tensors
    included) is shown too.
    """
    from . import check, draw
    from .diff_page import write_html
    from .report import print_report, write_json

    onnx_path, meta = graphio.resolve(in_path)
    skipped = resolve_skip(skip, target)
    lowering = target_passes(target, accuracy_level, context_length(meta, in_path))
    model = graphio.load(onnx_path)
    pictures = draw.Stages(model.graph)
    nodes_in = model.graph.num_nodes()
    text_kl = _text_kl(in_path, onnx_path, reference, text, max_tokens) if reference is not None else None
    with tempfile.TemporaryDirectory(prefix="fuselm-diff-") as work:
        state = {"n": 0}
        try:
            state["outputs"] = check.run_steps(onnx_path)
        except FuselmError as e:  # e.g. inputs outside the graph contract: show the structure anyway
            state["outputs"], state["no_numbers"] = None, str(e)

        def on_pass(record: dict, m: ir.Model) -> None:
            pictures.record(record, m.graph if record["changed"] else None)
            if record["changed"]:
                state["n"] += 1
                stage = Path(work) / f"{state['n']}"
                stage.mkdir()
                path = state["path"] = graphio.save(m, stage)
                try:
                    graphio.check(path)
                    record["checker"] = "ok"
                except Exception as e:  # reported, not raised: the page shows which pass broke it
                    record["checker"] = f"failed: {e}"
                t0 = time.perf_counter()
                try:
                    if state["outputs"] is None:
                        raise FuselmError(f"no numeric check: {state['no_numbers']}")
                    outputs = check.run_steps(path, steps=state["outputs"])
                    record["drift"] = check.drift(state["outputs"], outputs)
                    state["outputs"] = outputs
                except Exception as e:
                    record["drift"] = {"error": f"{type(e).__name__}: {e}"}
                if text_kl is not None:
                    record["text_kl"] = text_kl(path)
                record["check_seconds"] = time.perf_counter() - t0
                if state.get("stage") is not None:  # one stage on disk at a time (a 4B model is GBs)
                    shutil.rmtree(state["stage"], ignore_errors=True)
                state["stage"] = stage
            else:
                record["drift"] = None

        records = run_pipeline(model, skipped, on_pass, target=lowering)
        if runtime is not None:
            for record in runtime(state.get("path", onnx_path), state["outputs"]):
                pictures.record(record, None)  # the runtime's graph is not ONNX: no drawing of its layers
                records.append(record)
    data = {"input": os.fspath(in_path), "family": (meta or {}).get("family"), "layer_drawn": pictures.first_layer,
            "nodes_in": nodes_in, "nodes_out": model.graph.num_nodes(),
            "nodes_per_layer_in": pictures.counts[0], "nodes_per_layer_out": pictures.counts[-1],
            "passes": records, "_stages": pictures.stages, "quantization": (meta or {}).get("quantization"),
            "text_kl": text_kl.first if text_kl is not None else None,
            "opset_upgrade": upgrade_note(records).removeprefix("; ") or None}
    if not quiet:
        print_report(data)
        if data["opset_upgrade"]:
            print(f"UpgradeOpset: {data['opset_upgrade']}")
    if json_path:
        write_json(data, json_path)
    if html:
        write_html(data, html)
    return data
