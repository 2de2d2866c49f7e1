"""`fuselm diff`: every node a pass removes or adds is marked, in every layer, for every pass and
family; fused groups are traced back to what they replaced; the page draws the layer asked for."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from fuselm.passes import graphio
from fuselm.passes.pipeline import run_pipeline

import fuselm

FAMILIES = ["qwen3", "qwen2", "llama"]


def _names_by_layer(graph, layers: int) -> list[set[str]]:
    """Independent of draw.py: the node names that say `/layers.{i}/`."""
    return [{n.name for n in graph if f"/layers.{i}/" in (n.name or "")} for i in range(layers)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_removed_and_added_node_is_marked(exported, family):
    src = exported(family, "f32")
    data = fuselm.diff(src, quiet=True)
    stages = data["_stages"]
    # The same pipeline again, keeping each stage's names per layer (by name, not by draw.py's rules).
    seen = []
    model = graphio.load(src / "model.onnx")
    seen.append(_names_by_layer(model.graph, 2))
    run_pipeline(model, on_pass=lambda r, m: seen.append(_names_by_layer(m.graph, 2)))
    assert len(seen) == len(data["passes"]) + 1
    checked = 0
    for k, r in enumerate(data["passes"]):
        for layer in (0, 1):
            removed, added = seen[k][layer] - seen[k + 1][layer], seen[k + 1][layer] - seen[k][layer]
            if not r["changed"]:
                assert not removed and not added, r["pass"]
                continue
            marks = r["marks"][layer]
            before, after = stages[r["stage_before"]][layer], stages[r["stage_after"]][layer]
            marked_removed = {before["nodes"][i]["name"] for i in marks["removed"]}
            marked_added = {after["nodes"][i]["name"] for i in marks["added"]}
            assert marked_removed == removed, (family, r["pass"], layer, removed ^ marked_removed)
            assert marked_added == added, (family, r["pass"], layer, added ^ marked_added)
            grouped = {i for g in marks["groups"] for i in g["added"]}
            assert grouped == set(marks["added"]), (family, r["pass"])  # every added node is in a group
            checked += len(removed) + len(added)
    assert checked > 50
    counts = data["nodes_per_layer_out"]
    assert counts["uniform"] and counts["layers"] == [counts["per_layer"]] * 2
    # Qwen3: RMSNorm, MatMul, Split, 2x FusedRoPE (3-D, its q/k norm inside), Attention, MatMul, Add;
    # RMSNorm, MatMul, SwiGLU, MatMul, Add. Llama: the same without norm weights; Qwen2: + the qkv bias Add.
    assert counts["per_layer"] == {"qwen3": 13, "qwen2": 14, "llama": 13}[family]


def _group(record, layer, stages, op, name_part):
    marks = record["marks"][layer]
    before, after = stages[record["stage_before"]][layer], stages[record["stage_after"]][layer]
    for g in marks["groups"]:
        names = [after["nodes"][i]["name"] for i in g["added"]]
        if any(after["nodes"][i]["op"] == op and name_part in n for i, n in zip(g["added"], names, strict=True)):
            return [before["nodes"][i] for i in g["replaced"]]
    raise AssertionError(f"no group adding {op} {name_part} in {record['pass']}")


def test_fused_ops_are_traced_to_what_they_replaced(exported):
    data = fuselm.diff(exported("qwen3", "f32"), quiet=True)
    by_pass = {r["pass"]: r for r in data["passes"]}
    stages = data["_stages"]
    for layer in (0, 1):
        norm = _group(by_pass["FuseRMSNorm"], layer, stages, "RMSNormalization", "input_layernorm")
        assert sorted(n["op"] for n in norm) == ["Add", "Mul", "Mul", "Pow", "Reciprocal", "ReduceMean", "Sqrt"]
        assert all(f"/layers.{layer}/input_layernorm/" in n["name"] for n in norm)
        qkv = _group(by_pass["FuseQKV"], layer, stages, "MatMul", "qkv_proj")
        assert sorted(n["name"].split("/")[-2] for n in qkv) == ["k_proj", "q_proj", "v_proj"]
        attn = _group(by_pass["FuseAttention"], layer, stages, "Attention", "attn")
        ops = [n["op"] for n in attn]
        assert {"Softmax", "Concat", "Expand"} <= set(ops) and "RMSNormalization" not in ops
        q3d = _group(by_pass["AttentionTo3D"], layer, stages, "Reshape", "q_3d")
        assert [(n["op"], n["name"]) for n in q3d] == [("Transpose", f"/model/layers.{layer}/attn/q/Transpose")]


def _chromium():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it with apt-get)")
    return [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--no-first-run", "--disable-component-update", "--disable-sync", "--disable-quic"]


@pytest.mark.slow
def test_page_draws_only_the_chosen_layer(exported, tmp_path):
    src = exported("llama", "f32", num_hidden_layers=6)
    page = tmp_path / "diff.html"
    data = fuselm.diff(src, quiet=True, html=page)
    html = page.read_text()
    assert "<script src" not in html and not re.search(r"https?://(?!www\.w3\.org/2000/svg)", html)
    assert "<svg" not in html.split("<script")[0]  # drawn by the page's script, for one layer at a time
    dom = subprocess.run([*_chromium(), f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
                          page.as_uri() + "#layer=4"], capture_output=True, text=True, timeout=120).stdout
    titles = re.findall(r"<g class=\"node [^\"]*\"[^>]*><title>([^<]*)</title>", dom)
    assert titles and all("/layers.4/" in t for t in titles if "/layers." in t)
    changed = [r for r in data["passes"] if r["changed"]]
    want_removed = sum(len(r["marks"][4]["removed"]) for r in changed)
    want_added = sum(len(r["marks"][4]["added"]) for r in changed)
    assert want_removed > 20 and want_added > 5
    assert len(re.findall(r'class="node \w+ removed"', dom)) == want_removed
    assert len(re.findall(r'class="node \w+ added"', dom)) == want_added
    assert len(re.findall(r'<svg [^>]*class="graph( marked)?"', dom)) == len(changed) * 2 + sum(not r["changed"] for r in data["passes"])
    assert dom.count("<p>Layer 4: ") == len(changed) and "Layer 0: " not in dom
