"""The `fuselm diff --html` page: one self-contained file (inline CSS, inline script, no network).

The tables are static HTML. The drawings are built in the browser from a compact JSON block
(every layer at every stage: node boxes laid out by draw.py, and per pass the marks), for the
layer the reader picks with the selector (or `#layer=N` in the address): only that layer's
drawings exist in the document, so a 36-layer graph gives a page of a few hundred kB that
renders as fast as a 2-layer one.
"""

from __future__ import annotations

import json
import os
import re

from .draw import BOX_H, COLORS, MARK_COLORS, category
from .report import _drift_text, _write, op_changes, per_layer_text, skip_reasons

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
#bar { position: sticky; top: 0; background: #fff; padding: 6px 0; border-bottom: 1px solid #ddd; z-index: 1; }
.pictures { display: flex; gap: 16px; overflow-x: auto; align-items: flex-start; }
.pictures figure { margin: 0; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.graph { max-width: 640px; height: auto; }
svg.graph text { font: 11px monospace; text-anchor: middle; fill: #111; }
svg.graph rect { stroke: #555; stroke-width: 1; }
svg.graph .edge { fill: none; stroke: #888; stroke-width: 1; }
svg.marked g.node:not(.removed):not(.added):not(.rewired) { opacity: .45; }
svg.graph g.removed rect { stroke: {{ marks.removed }}; stroke-width: 3; stroke-dasharray: 6 3; }
svg.graph g.added rect { stroke: {{ marks.added }}; stroke-width: 3; }
svg.graph g.rewired rect { stroke: {{ marks.rewired }}; stroke-width: 2.5; stroke-dasharray: 2 2; }
svg.graph .edge.removed { stroke: {{ marks.removed }}; } svg.graph .edge.added { stroke: {{ marks.added }}; }
svg.graph g.hl rect { stroke: #000; stroke-width: 4; }
svg.graph .badge circle { fill: #333; } svg.graph .badge text { fill: #fff; font: bold 10px sans-serif; }
.legend span { display: inline-block; padding: 1px 8px; margin-right: 6px; border: 1px solid #555; border-radius: 4px; }
.legend span.mark { background: #fff; border-width: 3px; }
ol.groups { margin: 4px 0 10px; } ol.groups li { margin: 1px 0; }
.ok { color: #1b7f3b; } .bad { color: #b00020; font-weight: 600; }
</style></head><body>
<h1>fuselm diff</h1>
<p>Input <code>{{ data.input }}</code>{% if data.family %} ({{ data.family }}){% endif %}:
{{ data.nodes_in }} &rarr; {{ data.nodes_out }} nodes; per decoder layer {{ per_layer(data.nodes_per_layer_in) }}
&rarr; {{ per_layer(data.nodes_per_layer_out, True) }}. Drift: onnxruntime (its graph optimizations off) on each
stage against the previous one, max |&Delta;logits| for a prefill and a decode step with past.</p>
<table id="summary"><tr><th>pass</th><th>changed</th><th>nodes</th><th>per layer</th><th>fired</th><th>skipped</th>
<th>drift prefill</th><th>drift decode</th><th>time</th></tr>
{% for r in data.passes %}<tr><td><a href="#pass-{{ r.pass }}">{{ r.pass }}</a></td>
{% if r.skipped_by_user %}<td colspan="8">skipped (--skip)</td>{% else %}
<td>{{ "yes" if r.changed else "no" }}</td><td>{{ r.nodes_before }} &rarr; {{ r.nodes_after }}</td>
<td>{{ per_layer(r.nodes_per_layer_before) }} &rarr; {{ per_layer(r.nodes_per_layer_after) }}</td>
<td>{{ r.fired }}</td><td>{{ r.skipped|length }}</td><td>{{ drift(r.drift, "prefill") }}</td>
<td>{{ drift(r.drift, "decode") }}</td><td>{{ "%.0f"|format(1000 * r.seconds) }} ms</td>{% endif %}</tr>
{% endfor %}</table>
<div id="bar"><label>Decoder layer <select id="layer">{% for i in layers %}
<option value="{{ i }}"{% if i == data.layer_drawn %} selected{% endif %}>{{ i }}</option>{% endfor %}
</select></label>
<span class="legend">{% for k, c in colors.items() %}<span style="background: {{ c }}">{{ k }}</span>{% endfor %}
{% for k, c in marks.items() %}<span class="mark" style="border-color: {{ c }}">{{ k }}</span>{% endfor %}</span>
<small>Numbers tie what a pass added (after) to the nodes it replaced (before); hover one to see its group.</small>
<noscript><p class="bad">The drawings are drawn by the page's inline script: enable JavaScript.</p></noscript></div>
{% for r in data.passes %}
<section class="pass {{ 'changed' if r.changed else 'unchanged' }}" id="pass-{{ r.pass }}" data-pass="{{ r.pass }}">
<h2>{{ loop.index }}. {{ r.pass }}</h2>
<p>{{ r.doc }}</p>
{% if r.skipped_by_user %}<p>Skipped on request (--skip).</p>{% else %}
<p>{{ "Changed" if r.changed else "Unchanged" }}; {{ r.nodes_before }} &rarr; {{ r.nodes_after }} nodes
({{ per_layer(r.nodes_per_layer_before) }} &rarr; {{ per_layer(r.nodes_per_layer_after) }} per layer);
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
<div class="changes" data-index="{{ loop.index0 }}"></div>
<div class="pictures" data-index="{{ loop.index0 }}"></div>{% endif %}
</section>
{% endfor %}
<script type="application/json" id="fuselm-data">{{ payload }}</script>
<script>{{ script }}</script>
</body></html>
"""

# Draws the chosen layer's pictures from the JSON block; marks per pass: [removed ids (before),
# added ids (after), rewired ids (after), groups [[added ids], [replaced ids]]].
_SCRIPT = r"""
(function () {
  const D = JSON.parse(document.getElementById("fuselm-data").textContent);
  const S = D.strings, H = D.box_h;
  const esc = t => String(t).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
  const nodeName = (i, L) => S[i].split("layers.#").join("layers." + L);
  function svg(pic, L, marks, side, title) {
    if (!pic) return '<p class="empty">no nodes of layer ' + L + " to draw</p>";
    const [w, h, flat, edges] = pic, n = flat.length / 6;
    const mark = {}, groups = {};
    if (marks) {
      const [removed, added, rewired, grp] = marks;
      if (side === "before") removed.forEach(i => mark[i] = "removed");
      else { rewired.forEach(i => mark[i] = "rewired"); added.forEach(i => mark[i] = "added"); }
      grp.forEach((g, k) => (side === "before" ? g[1] : g[0]).forEach(i => (groups[i] = groups[i] || []).push(k + 1)));
    }
    const X = i => flat[6 * i], Y = i => flat[6 * i + 1], W = i => flat[6 * i + 2];
    const out = ['<svg xmlns="http://www.w3.org/2000/svg" class="graph' + (marks ? " marked" : "") +
      '" viewBox="0 0 ' + w + " " + h + '" width="' + w + '" height="' + h + '" role="img" aria-label="' + esc(title) + '">'];
    for (let e = 0; e < edges.length; e += 2) {
      const a = edges[e], b = edges[e + 1];
      const x1 = X(a) + W(a) / 2, y1 = Y(a) + H, x2 = X(b) + W(b) / 2, y2 = Y(b), m = (y1 + y2) / 2;
      const cls = mark[a] === "removed" || mark[b] === "removed" ? " removed" : mark[a] === "added" || mark[b] === "added" ? " added" : "";
      out.push('<path class="edge' + cls + '" d="M' + x1 + "," + y1 + " C" + x1 + "," + m + " " + x2 + "," + m + " " + x2 + "," + y2 + '"/>');
    }
    for (let i = 0; i < n; i++) {
      const op = S[flat[6 * i + 3]], detail = S[flat[6 * i + 5]], name = nodeName(flat[6 * i + 4], L);
      const g = groups[i] || [];
      let tip = name + (mark[i] ? " [" + mark[i] + "]" : "");
      if (g.length) tip += side === "before" ? " (replaced by group " + g.join(", ") + ")" : " (group " + g.join(", ") + ")";
      out.push('<g class="node ' + D.cats[op] + (mark[i] ? " " + mark[i] : "") + '"' + (g.length ? ' data-g=" ' + g.join(" ") + ' "' : "") +
        '><title>' + esc(tip) + '</title><rect x="' + X(i) + '" y="' + Y(i) + '" width="' + W(i) + '" height="' + H +
        '" rx="5" fill="' + D.colors[D.cats[op]] + '"/><text x="' + (X(i) + W(i) / 2) + '" y="' + (Y(i) + H / 2 + 4) + '">' +
        esc(op + (detail ? " " + detail : "")) + "</text>");
      if (g.length) {
        const label = g.join(","), bw = 8 + 6 * label.length, bx = X(i) + W(i) - bw / 2, by = Y(i) - 4;
        out.push('<g class="badge"><rect x="' + (bx - bw / 2) + '" y="' + (by - 7) + '" width="' + bw + '" height="14" rx="7" style="fill:#333;stroke:none"/>' +
          '<text x="' + bx + '" y="' + (by + 4) + '">' + label + "</text></g>");
      }
      out.push("</g>");
    }
    out.push("</svg>");
    return out.join("");
  }
  function changes(p, L, marks) {
    if (!marks) return "";
    const [removed, added, rewired, grp] = marks, before = D.stages[p.before][L], after = D.stages[p.after][L];
    const op = (pic, i) => S[pic[2][6 * i + 3]];
    let html = "<p>Layer " + L + ": " + removed.length + " removed, " + added.length + " added, " + rewired.length + " rewired.</p>";
    if (grp.length) {
      html += '<ol class="groups">' + grp.map(g => "<li><b>" + g[0].map(i => esc(op(after, i))).join(" + ") + "</b> &larr; " +
        (g[1].length ? g[1].map(i => esc(op(before, i))).join(", ") : "(nothing removed)") + "</li>").join("") + "</ol>";
    }
    return html;
  }
  function render(L) {
    document.querySelectorAll("section.pass").forEach(sec => {
      const pics = sec.querySelector(".pictures");
      if (!pics) return;
      const k = +pics.dataset.index, p = D.passes[k], name = sec.dataset.pass;
      const marks = p.marks[L];
      if (p.changed) {
        pics.innerHTML = "<figure><figcaption>before</figcaption>" + svg(D.stages[p.before][L], L, marks, "before", "before " + name) +
          "</figure><figure><figcaption>after</figcaption>" + svg(D.stages[p.after][L], L, marks, "after", "after " + name) + "</figure>";
      } else {
        pics.innerHTML = "<details><summary>drawing (unchanged)</summary><figure>" + svg(D.stages[p.after][L], L, null, "after", name) +
          "</figure></details>";
      }
      sec.querySelector(".changes").innerHTML = changes(p, L, marks);
    });
  }
  const select = document.getElementById("layer");
  const wanted = /layer=(\d+)/.exec(location.hash);
  if (wanted && D.layers.includes(+wanted[1])) select.value = wanted[1];
  select.addEventListener("change", () => { history.replaceState(null, "", "#layer=" + select.value); render(+select.value); });
  document.addEventListener("mouseover", ev => {
    const node = ev.target.closest && ev.target.closest("g.node");
    const sec = ev.target.closest && ev.target.closest("section.pass");
    if (!sec) return;
    const mine = node && node.dataset.g ? node.dataset.g.trim().split(" ") : [];
    sec.querySelectorAll("g.node[data-g]").forEach(g => g.classList.toggle("hl", mine.some(k => g.dataset.g.includes(" " + k + " "))));
  });
  if (D.layers.length) render(+select.value);
  else document.querySelectorAll(".pictures").forEach(p => p.innerHTML =
    '<p class="empty">No node names or weights say which nodes form a decoder layer: nothing to draw.</p>');
})();
"""


def payload(data: dict) -> dict:
    """The JSON block the page draws from: interned strings (node names with their layer index as
    `layers.#`), every stage's pictures per layer, and per pass its stages and marks."""
    index: dict[str, int] = {}  # interned string -> its place in the table

    def get(s: str) -> int:
        return index.setdefault(s, len(index))

    ops: set[str] = set()
    stages = []
    for stage in data.get("_stages", []):
        pics = {}
        for layer, pic in stage.items():
            own = re.compile(rf"layers\.{layer}(?=[./_]|$)")
            flat = []
            for n in pic["nodes"]:
                ops.add(n["op"])
                flat += [n["x"], n["y"], n["w"], get(n["op"]), get(own.sub("layers.#", n["name"])), get(n["detail"])]
            pics[layer] = [pic["width"], pic["height"], flat, [i for e in pic["edges"] for i in e]]
        stages.append(pics)
    passes = []
    for r in data["passes"]:
        if r.get("skipped_by_user") or "stage_before" not in r:
            passes.append(None)
            continue
        marks = {layer: [m["removed"], m["added"], m["rewired"], [[g["added"], g["replaced"]] for g in m["groups"]]]
                 for layer, m in r["marks"].items()}
        passes.append({"before": r["stage_before"], "after": r["stage_after"], "changed": r["changed"], "marks": marks})
    layers = sorted({layer for stage in stages for layer in stage})
    return {"strings": list(index), "stages": stages, "passes": passes, "layers": layers, "box_h": BOX_H,
            "colors": COLORS, "cats": {op: category(op) for op in ops}}


def write_html(data: dict, path: str | os.PathLike) -> None:
    """One self-contained page: inline CSS, an inline script that draws the chosen layer, no assets."""
    import jinja2
    from markupsafe import Markup

    blob = payload(data)
    # "</" would end the <script> element early; JSON allows "<\/".
    text = json.dumps(blob, separators=(",", ":")).replace("</", "<\\/")
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    page = env.from_string(_PAGE).render(
        data=data, colors=COLORS, marks=MARK_COLORS, drift=_drift_text, op_changes=op_changes,
        skip_reasons=skip_reasons, per_layer=per_layer_text, layers=blob["layers"],
        payload=Markup(text), script=Markup(_SCRIPT))
    _write(path, page)
