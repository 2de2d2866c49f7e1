"""`fuselm optimize` / `fuselm diff` through the CLI: --skip, bad input, plain .onnx, the HTML page."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import onnx
import pytest
from onnx import helper as oh

from fuselm import cli


def test_skip_is_the_ab_switch(exported, tmp_path, capsys):
    out = tmp_path / "noqkv"
    assert cli.main(["optimize", str(exported("llama", "f32")), "-o", str(out), "--skip", "fuse-qkv", "FuseRoPE"]) == 0
    meta = json.loads((out / "fuselm.json").read_text())
    by_name = {p["pass"]: p for p in meta["passes"]}
    assert by_name["FuseQKV"]["skipped_by_user"] and by_name["FuseRoPE"]["skipped_by_user"]
    assert by_name["FuseAttention"]["fired"] == 2
    names = [n.name for n in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.node]
    assert not any("qkv_proj" in n for n in names) and any("gate_up_proj" in n for n in names)
    assert "FuseGateUp" in capsys.readouterr().out


@pytest.mark.parametrize("make_args,message", [
    (lambda src, tmp: ["--skip", "fuse-everything"], "no such pass; valid passes: UpgradeOpset"),
    (lambda src, tmp: [], "it exists; pass --force"),
])
def test_bad_usage_exits_2_and_writes_nothing(exported, tmp_path, capsys, make_args, message):
    src = exported("llama", "f32")
    out = tmp_path / "out"
    if "exists" in message:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    assert cli.main(["optimize", str(src), "-o", str(out), *make_args(src, tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if "exists" in message else [])
    if "exists" in message:
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_bad_inputs_exit_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "broken.onnx").write_bytes(b"\x00not a protobuf\xff" * 10)
    g = oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [oh.make_tensor_value_info("x", 1, [1])],
                      [oh.make_tensor_value_info("y", 1, [1])])
    onnx.save(oh.make_model(g, opset_imports=[oh.make_opsetid("", 13)]), tmp_path / "old.onnx")
    for name, message in (("missing", "does not exist"), ("notes.txt", "not an .onnx file"),
                          ("broken.onnx", "cannot read"), ("old.onnx", "opset 13; fuselm reads opsets 14..23")):
        assert cli.main(["optimize", str(tmp_path / name), "-o", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
        assert cli.main(["diff", str(tmp_path / name)]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plain_onnx_input(exported, tmp_path):
    src = tmp_path / "plain"
    shutil.copytree(exported("mistral", "q4"), src)
    (src / "fuselm.json").unlink()
    out = tmp_path / "out"
    assert cli.main(["optimize", str(src / "model.onnx"), "-o", str(out), "--quiet"]) == 0
    meta = json.loads((out / "fuselm.json").read_text())
    assert meta["stage"] == "optimized" and meta["dims"] == {"layers": 2, "kv_heads": 2, "head_dim": 16, "heads": 4,
                                                            "vocab": meta["dims"]["vocab"]}
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)


def test_diff_html_renders_in_chromium(exported, tmp_path, capsys):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it with apt-get)")
    page, data = tmp_path / "diff.html", tmp_path / "diff.json"
    assert cli.main(["diff", str(exported("qwen3", "q4")), "--html", str(page), "--json", str(data)]) == 0
    table = capsys.readouterr().out
    assert "FuseAttention" in table and "drift" in table
    report = json.loads(data.read_text())
    passes = [p["pass"] for p in report["passes"]]
    assert passes == ["UpgradeOpset", "FromGenAI", "RemoveDeadShapeOp", "ReorderQKVProjections", "FuseQKV",
                      "FuseGateUp", "FuseRMSNorm", "FuseAttention", "FuseRoPE", "AttentionTo3D", "FuseRoPENorm",
                      "RoPETo3D", "FuseSwiGLU"]
    html = page.read_text()
    # Self-contained: inline script and styles only, nothing fetched.
    assert "<script src" not in html and "<link" not in html
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120).stdout
    for name in passes:
        assert f'id="pass-{name}"' in dom, name
    assert dom.count('<section class="pass') == len(passes)
    # Every pass that changed the graph shows a before and an after drawing of layer 0.
    changed = sum(p["changed"] for p in report["passes"])
    assert len(re.findall(r'<svg [^>]*class="graph( marked)?"', dom)) == 2 * changed + (len(passes) - changed)
    assert dom.count('class="node fused"') > 0 and dom.count('class="node fused added"') > 0
