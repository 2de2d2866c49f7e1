"""`--backend auto` on a CPU lowers a standard q4 graph for onnxruntime once, into fuselm's cache folder
(runtime_metal/engines/ort_prepared.py over runtime_metal/prepared.py's `prepared_dir`), and runs it there."""

from __future__ import annotations

import io
import os
import shutil
import time

import pytest
from fuselm.runtime_metal.engines.auto import resolve
from fuselm.runtime_metal.prepared import folder

import fuselm
from fuselm.options import Options

pytest.importorskip("onnxruntime")
PROMPT, TOKENS = [100, 200, 300, 50], 8


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("FUSELM_PREPARED", "1")
    monkeypatch.setattr("fuselm.runtime_metal.engines.auto.gpu", lambda: None)


def _copy(src, tmp_path, name="m"):
    out = tmp_path / name
    shutil.copytree(src, out)
    return out


def _run(model, **kw):
    return fuselm.run(model, prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, quiet=True,
                      stream=io.StringIO(), **kw)


def _lowered_dirs(model):
    return [p for p in folder(model).glob("onnxruntime-*") if p.is_dir()]


def test_auto_lowers_once_and_equals_the_optimize_target_graph(cpu, optimized, exported, tmp_path, monkeypatch):
    model = _copy(optimized("qwen3", "q4"), tmp_path)
    first = _run(model)
    assert first["backend"].startswith("onnxruntime") and "lowered now)" in first["why"], first["why"]
    (lowered,) = _lowered_dirs(model)
    mtime = lowered.stat().st_mtime_ns
    assert "IO binding" in first["what"]  # its logits are the last position's (passes/last_logits.py): not genai's

    def refuse(*a, **k):
        raise AssertionError("lowered again")

    monkeypatch.setattr("fuselm.runtime_metal.engines.ort_prepared._lower", refuse)
    second = _run(model)
    assert "prepared once in" in second["why"] and "lowered now" not in second["why"] and lowered.stat().st_mtime_ns == mtime
    want = fuselm.optimize(exported("qwen3", "q4"), tmp_path / "by-optimize", target="onnxruntime", quiet=True)
    assert first["tokens"] == second["tokens"] == _run(want, backend="onnxruntime")["tokens"]


def test_a_damaged_copy_is_rebuilt(cpu, optimized, tmp_path):
    model = _copy(optimized("qwen3", "q4"), tmp_path)
    want = _run(model)["tokens"]
    (lowered,) = _lowered_dirs(model)
    data = lowered / "model.onnx.data"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    r = _run(model)
    assert "lowered now; the copy there was damaged" in r["why"] and r["tokens"] == want
    (folder(model) / lowered.name / "model.onnx").write_bytes(b"not onnx")
    assert "damaged" in _run(model)["why"]
    data = model / "model.onnx.data"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # the weights changed: a new key
    r = _run(model)
    assert "(lowered now)" in r["why"] and [str(p) in r["why"] for p in _lowered_dirs(model)] == [True]


def test_float_and_torch_only_options_stay_on_torch(cpu, optimized, tmp_path):
    f32 = _copy(optimized("qwen3", "f32"), tmp_path, "f32")
    assert resolve(f32, Options())[0] == "auto" and not folder(f32).exists()
    q4 = _copy(optimized("qwen3", "q4"), tmp_path, "q4")
    backend, why, path = resolve(q4, Options.of(kv_bits=8))
    assert backend == "auto" and "--kv-bits" in why and path == q4 and not folder(q4).exists()


def test_off_switch_and_a_graph_that_cannot_be_lowered(cpu, optimized, tmp_path, monkeypatch):
    q4 = _copy(optimized("qwen3", "q4"), tmp_path)
    monkeypatch.setenv("FUSELM_PREPARED", "0")
    assert resolve(q4, Options())[0] == "auto" and not folder(q4).exists()
    monkeypatch.setenv("FUSELM_PREPARED", "1")
    monkeypatch.setattr("fuselm.passes.pipeline.target_passes", lambda *a, **k: [])  # nothing lowers
    r = _run(q4)
    assert r["backend"] == "torch" and "lowering the graph for onnxruntime failed" in r["why"], r["why"]
    assert "MatMulNBits" in r["why"] and list(folder(q4).glob("onnxruntime-*.failed"))
    assert "MatMulNBits" in resolve(q4, Options())[1]  # remembered: not lowered again


def test_validate_by_auto_checks_the_lowered_copy_against_the_standard_graph(cpu, optimized, make_ckpt, tmp_path):
    from fuselm.runtime_metal.checks import INT8_KL_FACTOR

    model = _copy(optimized("qwen2", "q4"), tmp_path)
    r = fuselm.validate(model, make_ckpt("qwen2"), tokens=TOKENS, prompt=PROMPT, quiet=True)
    assert r["lowered"] and "prepared once in" in r["describe"] and _lowered_dirs(model)
    assert r["int8"]["kl"] <= INT8_KL_FACTOR * r["int8"]["ort_level4_kl"] + 1e-6


def test_four_loaders_at_once_build_it_once(tmp_path, monkeypatch):
    """prepared_dir (runtime_metal/prepared.py) from four threads at once (each takes the lock through its own
    open file, as four processes do): one builds, three wait and read."""
    from concurrent.futures import ThreadPoolExecutor

    from fuselm.runtime_metal.prepared import prepared_dir

    monkeypatch.setenv("FUSELM_PREPARED", "1")
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.onnx").write_bytes(b"graph")
    builds = []

    def build(tmp):
        tmp.mkdir()
        time.sleep(0.3)
        (tmp / "x").write_text("made")
        builds.append(1)

    def load(_):
        path, how = prepared_dir(model, "fmt", "tag", build)
        return how, (path / "x").read_text()

    with ThreadPoolExecutor(4) as pool:
        outs = sorted(pool.map(load, range(4)))
    assert outs == [("read", "made")] * 3 + [("written", "made")] and builds == [1]
    assert sorted(p.name for p in folder(model).iterdir()) == [".fmt.lock", *(p.name for p in
                                                                      folder(model).glob("fmt-*"))]


CHILD = """
import io, json, sys
import fuselm
r = fuselm.run(sys.argv[1], prompt=[100, 200, 300, 50], max_tokens=8, ignore_eos=True, quiet=True,
               stream=io.StringIO())
heavy = sorted(m for m in ("torch", "transformers", "onnx", "onnx_ir") if m in sys.modules)
print(json.dumps({"tokens": r["tokens"], "why": r["why"], "heavy": heavy}))
"""


def test_a_fresh_process_runs_the_copy_without_torch_transformers_or_onnx(cpu, optimized, tmp_path):
    """Once the copy exists, a new interpreter finds it by the stat fingerprint and runs it on onnxruntime
    without importing torch, transformers (the tokenizer is read by `tokenizers`) or onnx (no graph is read)."""
    import json
    import subprocess
    import sys

    model = _copy(optimized("qwen3", "q4"), tmp_path)
    want = _run(model)["tokens"]  # lowers it
    (lowered,) = _lowered_dirs(model)
    assert json.loads((lowered / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "graph_optimization_level"] == "ORT_DISABLE_ALL"
    env = {**os.environ, "FUSELM_PREPARED": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(model)], env=env, check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [] and got["tokens"] == want and str(lowered) in got["why"], got


def test_the_fingerprint_finds_the_copy_and_misses_when_the_source_changes(tmp_path, monkeypatch):
    """runtime_metal/prepared.py: `find_prepared_dir` finds a copy by the source's stat fingerprint only; a
    touched but unchanged graph is read again under its key and re-stamped, a changed one rebuilt."""
    from fuselm.runtime_metal.prepared import find_prepared_dir, prepared_dir

    monkeypatch.setenv("FUSELM_PREPARED", "1")
    model = tmp_path / "m"
    model.mkdir()
    graph, data = model / "model.onnx", model / "model.onnx.data"
    graph.write_bytes(b"graph")
    data.write_bytes(b"weights")
    builds = []

    def build(tmp):
        tmp.mkdir()
        (tmp / "x").write_text(graph.read_text())
        builds.append(1)

    assert find_prepared_dir(model, "fmt", "tag") is None
    path, how = prepared_dir(model, "fmt", "tag", build, {"weight_bits": [4]})
    assert how == "written" and find_prepared_dir(model, "fmt", "tag") == (path, {"weight_bits": [4]})
    assert find_prepared_dir(model, "fmt", "other tag") is None
    os.utime(graph, ns=(graph.stat().st_atime_ns, graph.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert find_prepared_dir(model, "fmt", "tag") is None
    assert prepared_dir(model, "fmt", "tag", build) == (path, "read") and builds == [1]
    assert find_prepared_dir(model, "fmt", "tag") == (path, {"weight_bits": [4]})  # re-stamped
    graph.write_bytes(b"GRAPH")  # same size, new bytes
    assert find_prepared_dir(model, "fmt", "tag") is None
    new, how = prepared_dir(model, "fmt", "tag", build)
    assert how == "written" and new != path and (new / "x").read_text() == "GRAPH" and builds == [1, 1]
    data.write_bytes(b"weights!")  # the weights changed: the key (their size and mtime) changes too
    assert find_prepared_dir(model, "fmt", "tag") is None
    (new / "x").write_text("damaged")  # a damaged copy is never found
    assert find_prepared_dir(model, "fmt", "tag") is None


def test_the_step_binding_is_kept_and_its_logits_are_the_callers(cpu, optimized, tmp_path):
    """On the lowered copy's shared KV buffers the IO-binding loop binds the caches once and writes the logits into
    a buffer of its own (no output read back per step): each step's logits are the caller's to keep (the next step
    does not write over them), and equal to those of a step bound afresh."""
    import numpy as np

    engine = fuselm.load(_copy(optimized("qwen3", "q4"), tmp_path))
    loop = engine.loop
    steps = [[7], [9, 11, 13], [5]]

    def run(fresh: bool) -> list:
        engine.reset(40)
        out = [engine.forward(PROMPT * 5, rows=20)]  # more rows than the loop keeps a buffer for: handed over
        for ids in steps:
            if fresh:
                loop.io = None
            out.append(engine.forward(ids, rows=len(ids)))
        return out

    kept = run(fresh=False)
    assert loop.io is not None and loop.shared
    copies = [a.copy() for a in kept]
    again = run(fresh=True)
    for a, b, c in zip(kept, copies, again, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
