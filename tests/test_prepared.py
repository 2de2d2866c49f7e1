"""MLX-ready weights prepared once and kept beside the model (runtime_metal/prepared.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("mlx.core")
from fuselm.runtime_metal.backends.mlx_backend import MLXBackend  # noqa: E402
from fuselm.runtime_metal.prepared import folder  # noqa: E402
from fuselm.runtime_metal.session import Session  # noqa: E402

IDS = [3, 17, 5, 9]


@pytest.fixture
def model(optimized, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELM_PREPARED", "1")
    out = tmp_path / "m"
    shutil.copytree(optimized("qwen3", "q4"), out)
    return out


def _logits(path):
    sess = Session(path, backend="mlx", device="cpu")
    sess.reset(8)
    return sess, sess.logits_to_numpy(sess.prefill(IDS))


def test_second_load_reads_the_prepared_weights(model, monkeypatch):
    first, want = _logits(model)
    assert first.graph.prepared.startswith("written to") and len(list(folder(model).glob("*.safetensors"))) == 1

    def refuse(*a, **k):
        raise AssertionError("prepared again")

    monkeypatch.setattr(MLXBackend, "prepare_quantized", refuse)
    second, got = _logits(model)
    assert second.graph.prepared.startswith("read from")
    np.testing.assert_array_equal(got, want)


def test_stale_or_damaged_files_are_rebuilt_never_used(model):
    _, want = _logits(model)
    (stored,) = folder(model).glob("*.safetensors")
    stored.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])  # truncated
    sess, got = _logits(model)
    assert sess.graph.prepared.startswith("written to")
    np.testing.assert_array_equal(got, want)
    data = model / "model.onnx.data"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # the weights changed
    sess, _ = _logits(model)
    assert sess.graph.prepared.startswith("written to")
    files = list(folder(model).glob("*.safetensors"))
    assert len(files) == 1 and str(files[0]) in sess.graph.prepared  # the stale key's file is gone


def test_four_processes_loading_at_once_prepare_it_once(model):
    code = ("import json, sys; from fuselm.runtime_metal.session import Session; "
            "s = Session(sys.argv[1], backend='mlx', device='cpu'); s.reset(8); "
            f"print(json.dumps([s.graph.prepared.split(' ')[0], s.logits_to_numpy(s.prefill({IDS!r})).tolist()]))")
    env = {**os.environ, "FUSELM_PREPARED": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(model)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(4)]
    results = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r[0] for r in results) == ["read", "read", "read", "written"]
    assert all(r[1] == results[0][1] for r in results)
    assert len(list(folder(model).glob("*.safetensors"))) == 1 and not list(folder(model).glob("*.tmp*"))


@pytest.fixture(scope="module")
def moe_q4(tmp_path_factory):
    """A tiny OLMoE checkpoint, q4 (its experts: stacked blocked DequantizeLinears -> QMoE at load)."""
    import fuselm
    from fuselm import synth

    root = tmp_path_factory.mktemp("moe")
    hf = synth.make_checkpoint(root / "hf", "olmoe", generic=True, num_experts=4, num_experts_per_tok=2,
                               intermediate_size=64)
    return fuselm.convert(hf, root / "q4", exporter="torch", quant="q4", quiet=True)


def test_moe_experts_are_kept_and_read_memory_mapped(moe_q4, tmp_path, monkeypatch):
    monkeypatch.setenv("FUSELM_PREPARED", "1")
    model = tmp_path / "m"
    shutil.copytree(moe_q4, model)
    calls = []
    prepare = MLXBackend.prepare_experts
    monkeypatch.setattr(MLXBackend, "prepare_experts", lambda self, *a: calls.append(1) or prepare(self, *a))
    first, want = _logits(model)
    moes = [n for n in first.graph.nodes if n.op_type == "QMoE"]
    assert moes and first.graph.prepared.startswith("written to") and len(calls) == 2 * len(moes)
    (stored,) = folder(model).glob("*.safetensors")
    import mlx.core as mx

    names = mx.load(str(stored)).keys()
    assert sum(n.endswith("#experts::0") for n in names) == 2 * len(moes)  # gate_up and down of every layer

    calls.clear()
    second, got = _logits(model)
    assert second.graph.prepared.startswith("read from") and not calls  # read, not packed again
    assert second.graph.nodes[[n.op_type for n in second.graph.nodes].index("QMoE")].attrs["gate_up"].kind == "mlx"
    np.testing.assert_array_equal(got, want)

    data = model / "model.onnx.data"
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))  # stale: prepared again
    third, got = _logits(model)
    assert third.graph.prepared.startswith("written to") and len(calls) == 2 * len(moes)
    np.testing.assert_array_equal(got, want)


def test_a_file_without_the_experts_gets_them(moe_q4, tmp_path, monkeypatch):
    """A prepared file an older fuselm wrote (its dense weights only) is read for those, and rewritten with the
    experts once they are prepared; the load after reads everything."""
    from fuselm.runtime_metal.rewrites import quantized_weights

    monkeypatch.setenv("FUSELM_PREPARED", "1")
    model = tmp_path / "m"
    shutil.copytree(moe_q4, model)
    fold = quantized_weights._experts
    monkeypatch.setattr(quantized_weights, "_experts", lambda g, b, load, store, stats: fold(g, b, load, None, stats))
    _, want = _logits(model)  # as before the experts were kept
    monkeypatch.setattr(quantized_weights, "_experts", fold)
    sess, got = _logits(model)
    assert sess.graph.prepared.startswith("written to")
    np.testing.assert_array_equal(got, want)
    monkeypatch.setattr(MLXBackend, "prepare_experts", lambda *a: (_ for _ in ()).throw(AssertionError("again")))
    monkeypatch.setattr(MLXBackend, "prepare_quantized", lambda *a: (_ for _ in ()).throw(AssertionError("again")))
    sess, got = _logits(model)
    assert sess.graph.prepared.startswith("read from")
    np.testing.assert_array_equal(got, want)
