"""What `fuselm diff` and `fuselm optimize` show: rich tables, one self-contained HTML page, JSON."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from fuselm.errors import FuselmError


def _drift_text(drift: dict | None, step: str) -> str:
    if drift is None:
        return "unchanged"
    if "error" in drift:
        return "error"
    d = drift.get(step)
    if d is None:
        return "-"
    if "logits_max_abs" in d:
        return f"{d['logits_max_abs']:.1e} ({d['logits_rel']:.0e} rel)"
    return f"{d['all_outputs_rel']:.0e} rel"


def per_layer_text(counts: dict | None, shared: bool = False) -> str:
    """'22' (every layer alike) or '20..22' (they differ); with `shared`, '+ 17 shared'."""
    if not counts or not counts.get("layers"):
        return "-"
    layers = counts["layers"]
    text = str(layers[0]) if counts["uniform"] else f"{min(layers)}..{max(layers)}"
    return f"{text} + {counts['shared']} shared" if shared else text


def op_changes(record: dict) -> list[tuple[str, int, int]]:
    """(op, before, after) for every op type whose count changed."""
    before, after = Counter(record.get("ops_before", {})), Counter(record.get("ops_after", {}))
    return [(op, before[op], after[op]) for op in sorted(set(before) | set(after)) if before[op] != after[op]]


def skip_reasons(record: dict) -> list[tuple[str, int, str]]:
    """(reason, count, first place) for the pass's rejected candidates, most frequent first."""
    counts: Counter = Counter()
    first: dict[str, str] = {}
    for s in record.get("skipped", []):
        counts[s["reason"]] += 1
        first.setdefault(s["reason"], s["at"])
    return [(r, n, first[r]) for r, n in counts.most_common()]


def print_summary(records: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for col in ("pass", "changed", "nodes", "fired", "skipped", "ms"):
        t.add_column(col, justify="right" if col in ("fired", "skipped", "ms") else "left")
    for r in records:
        if r.get("skipped_by_user"):
            t.add_row(r["pass"], "[dim]--skip[/dim]", "", "", "", "")
            continue
        t.add_row(r["pass"], "yes" if r["changed"] else "no", f"{r['nodes_before']} -> {r['nodes_after']}",
                  str(r["fired"]), str(len(r["skipped"])), f"{1000 * r['seconds']:.0f}")
    Console().print(t)


def print_report(data: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"fuselm diff: {data['input']}  ({data['nodes_in']} -> {data['nodes_out']} nodes; "
              f"per layer {per_layer_text(data.get('nodes_per_layer_in'))} -> "
              f"{per_layer_text(data.get('nodes_per_layer_out'), shared=True)})", title_justify="left")
    kl = data.get("text_kl") is not None  # `diff --reference`: each stage's KL divergence from HF on a text
    cols = ("pass", "changed", "nodes", "per layer", "fired", "skipped", "drift prefill", "drift decode")
    for col in (*cols, *(("KL vs HF",) if kl else ()), "ms"):
        t.add_column(col)
    for r in data["passes"]:
        if r.get("skipped_by_user"):
            t.add_row(r["pass"], "[dim]--skip[/dim]", *[""] * (7 + kl))
            continue
        kl_cell = (f"{r['text_kl']:.5f}" if r.get("text_kl") is not None else "unchanged",) if kl else ()
        t.add_row(r["pass"], "yes" if r["changed"] else "no", f"{r['nodes_before']} -> {r['nodes_after']}",
                  f"{per_layer_text(r.get('nodes_per_layer_before'))} -> {per_layer_text(r.get('nodes_per_layer_after'))}",
                  str(r["fired"]), str(len(r["skipped"])), _drift_text(r.get("drift"), "prefill"),
                  _drift_text(r.get("drift"), "decode"), *kl_cell, f"{1000 * r['seconds']:.0f}")
    console.print(t)
    if kl:
        console.print(f"KL divergence from HF on the text before any pass: {data['text_kl']:.5f} nats")
    if data.get("quantization"):
        console.print(quantization_text(data["quantization"]))
    for r in data["passes"]:
        changes, reasons = op_changes(r), skip_reasons(r)
        if not changes and not reasons:
            continue
        d = Table(title=r["pass"], title_justify="left", show_header=True)
        d.add_column("op / reason")
        d.add_column("before -> after / count")
        for op, a, b in changes:
            d.add_row(op, f"{a} -> {b}")
        for reason, n, where in reasons:
            d.add_row(f"[yellow]skipped[/yellow] {reason}", f"{n}x (first: {where})")
        console.print(d)


def quantization_text(q: dict) -> str:
    """fuselm.json's quantization in a line or two: the classes, and the tensors mixed precision stored otherwise."""
    def one(c: dict) -> str:
        return f"q{c['bits']}/{c['block_size']} {c.get('method', 'rtn')}" if "block_size" in c else c.get("dtype", "?")

    line = (f"quantization {q.get('mode')}: linear {one(q.get('linear', {}))}, embedding {one(q.get('embed', {}))}, "
            f"lm_head {one(q.get('lm_head', {}))}")
    if q.get("calibration"):
        line += f"; calibrated on {q['calibration'].get('tokens')} tokens of {q['calibration'].get('text')}"
    tensors = q.get("tensors") or {}
    if tensors:
        kinds = Counter(tensors.values())
        line += f"\n  mixed precision, {len(tensors)} tensors stored otherwise: " + ", ".join(
            f"{k} x{n}" for k, n in sorted(kinds.items()))
        line += "".join(f"\n    {name}: {kind}" for name, kind in sorted(tensors.items()))
    return line


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    return str(obj)


def write_json(data: dict, path: str | os.PathLike) -> None:
    """The report as JSON; keys starting with "_" (every layer's pictures, for the page) stay out."""
    _write(path, json.dumps(_jsonable({k: v for k, v in data.items() if not k.startswith("_")}), indent=1) + "\n")


def _write(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise FuselmError(f"cannot write {path}: {e.strerror}; choose a writable location") from None
