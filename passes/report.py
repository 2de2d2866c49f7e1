"""What `fuselm diff` and `fuselm optimize` show: rich tables, one self-contained HTML page, JSON."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from fuselm.errors import FuselmError

from .draw import COLORS, render_svg


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
    t = Table(title=f"fuselm diff: {data['input']}  ({data['nodes_in']} -> {data['nodes_out']} nodes)",
              title_justify="left")
    for col in ("pass", "changed", "nodes", "fired", "skipped", "drift prefill", "drift decode", "ms"):
        t.add_column(col)
    for r in data["passes"]:
        if r.get("skipped_by_user"):
            t.add_row(r["pass"], "[dim]--skip[/dim]", *[""] * 6)
            continue
        t.add_row(r["pass"], "yes" if r["changed"] else "no", f"{r['nodes_before']} -> {r['nodes_after']}",
                  str(r["fired"]), str(len(r["skipped"])), _drift_text(r.get("drift"), "prefill"),
                  _drift_text(r.get("drift"), "decode"), f"{1000 * r['seconds']:.0f}")
    console.print(t)
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


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    return str(obj)


def write_json(data: dict, path: str | os.PathLike) -> None:
    _write(path, json.dumps(_jsonable(data), indent=1) + "\n")


def _write(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        raise FuselmError(f"cannot write {path}: {e.strerror}; choose a writable location") from None


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>fuselm diff: {{ data.input }}</title>
<style>
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; } h2 { font-size: 17px; margin-top: 0; }
table { border-collapse: collapse; margin: 8px 0 14px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
section.pass { border: 1px solid #ddd; border-radius: 8px; padding: 14px; margin: 18px 0; }
section.unchanged { opacity: .8; }
.pictures { display: flex; gap: 16px; overflow-x: auto; align-items: flex-start; }
.pictures figure { margin: 0; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.graph { max-width: 640px; height: auto; }
svg.graph text { font: 11px monospace; text-anchor: middle; fill: #111; }
svg.graph rect { stroke: #555; stroke-width: 1; }
svg.graph .edge { fill: none; stroke: #888; stroke-width: 1; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border: 1px solid #555; border-radius: 4px; }
.ok { color: #1b7f3b; } .bad { color: #b00020; font-weight: 600; }
</style></head><body>
<h1>fuselm diff</h1>
<p>Input <code>{{ data.input }}</code>{% if data.family %} ({{ data.family }}){% endif %}:
{{ data.nodes_in }} &rarr; {{ data.nodes_out }} nodes. Drift: onnxruntime (its graph optimizations off) on each
stage against the previous one, max |&Delta;logits| for a prefill and a decode step with past.
Pictures: decoder layer {{ data.layer_drawn }}.</p>
<p class="legend">{% for k, c in colors.items() %}<span style="background: {{ c }}">{{ k }}</span>{% endfor %}</p>
<table id="summary"><tr><th>pass</th><th>changed</th><th>nodes</th><th>fired</th><th>skipped</th>
<th>drift prefill</th><th>drift decode</th><th>time</th></tr>
{% for r in data.passes %}<tr><td><a href="#pass-{{ r.pass }}">{{ r.pass }}</a></td>
{% if r.skipped_by_user %}<td colspan="7">skipped (--skip)</td>{% else %}
<td>{{ "yes" if r.changed else "no" }}</td><td>{{ r.nodes_before }} &rarr; {{ r.nodes_after }}</td>
<td>{{ r.fired }}</td><td>{{ r.skipped|length }}</td><td>{{ drift(r.drift, "prefill") }}</td>
<td>{{ drift(r.drift, "decode") }}</td><td>{{ "%.0f"|format(1000 * r.seconds) }} ms</td>{% endif %}</tr>
{% endfor %}</table>
{% for r in data.passes %}
<section class="pass {{ 'changed' if r.changed else 'unchanged' }}" id="pass-{{ r.pass }}" data-pass="{{ r.pass }}">
<h2>{{ loop.index }}. {{ r.pass }}</h2>
<p>{{ r.doc }}</p>
{% if r.skipped_by_user %}<p>Skipped on request (--skip).</p>{% else %}
<p>{{ "Changed" if r.changed else "Unchanged" }}; {{ r.nodes_before }} &rarr; {{ r.nodes_after }} nodes;
{{ r.fired }} fired, {{ r.skipped|length }} skipped; {{ "%.1f"|format(1000 * r.seconds) }} ms.
{% if r.get("checker") %}Checker: <span class="{{ 'ok' if r.checker == 'ok' else 'bad' }}">{{ r.checker }}</span>.{% endif %}
{% if r.drift and r.drift.get("error") %}<span class="bad">{{ r.drift.error }}</span>
{% elif r.drift %}Drift: prefill {{ drift(r.drift, "prefill") }}, decode {{ drift(r.drift, "decode") }}.{% endif %}</p>
{% set changes = op_changes(r) %}{% if changes %}
<table><tr><th>op</th><th>before</th><th>after</th></tr>
{% for op, a, b in changes %}<tr><td>{{ op }}</td><td>{{ a }}</td><td>{{ b }}</td></tr>{% endfor %}</table>{% endif %}
{% if r.fired_at %}<details><summary>fired at {{ r.fired }} place(s)</summary><ul>
{% for w in r.fired_at %}<li><code>{{ w }}</code></li>{% endfor %}</ul></details>{% endif %}
{% set reasons = skip_reasons(r) %}{% if reasons %}
<table><tr><th>skipped because</th><th>count</th><th>first at</th></tr>
{% for reason, n, where in reasons %}<tr><td>{{ reason }}</td><td>{{ n }}</td><td><code>{{ where }}</code></td></tr>{% endfor %}
</table>{% endif %}
{% if r.counts %}<details><summary>counts</summary><table>
{% for k, v in r.counts.items() %}<tr><td>{{ k }}</td><td>{{ v }}</td></tr>{% endfor %}</table></details>{% endif %}
<div class="pictures">
{% if r.changed %}<figure><figcaption>before</figcaption>{{ svg(r.picture_before, "before " ~ r.pass) }}</figure>
<figure><figcaption>after</figcaption>{{ svg(r.picture_after, "after " ~ r.pass) }}</figure>
{% else %}<figure><figcaption>unchanged</figcaption>{{ svg(r.picture_after, r.pass) }}</figure>{% endif %}
</div>{% endif %}
</section>
{% endfor %}
</body></html>
"""


def write_html(data: dict, path: str | os.PathLike) -> None:
    """One self-contained page: inline CSS and SVG, no scripts, no external assets."""
    import jinja2
    from markupsafe import Markup

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    page = env.from_string(_PAGE).render(
        data=data, colors=COLORS, drift=_drift_text, op_changes=op_changes, skip_reasons=skip_reasons,
        svg=lambda pic, title: Markup(render_svg(pic, title)) if pic else "")
    _write(path, page)
