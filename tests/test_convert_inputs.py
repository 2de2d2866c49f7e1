"""Bad input to `fuselm convert`: exit 2, a message naming problem and fix, no traceback, no OUT.
Also the input variants that must work: sharded bf16 checkpoints, sliding window, --force, --check."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from fuselm.exporter import check as check_mod
from safetensors.torch import load_file, save_file

import fuselm
from fuselm import cli
from fuselm.contract import DATA_NAME
from fuselm.errors import CheckFailed
from fuselm.reference import OrtRunner, hf_model, hf_prefill_decode, ort_prefill_decode


@pytest.fixture
def ckpt(make_ckpt, tmp_path):
    """A private copy of the tiny qwen3 checkpoint, to break."""
    return shutil.copytree(make_ckpt("qwen3"), tmp_path / "hf")


def _convert_fails(hf, out, capsys, *flags) -> str:
    code = cli.main(["convert", str(hf), "-o", str(out), "--quiet", *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".fuselm-tmp")]
    return err


def _edit_tensors(hf, edit):
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


def test_missing_config(ckpt, tmp_path, capsys):
    (ckpt / "config.json").unlink()
    assert "config.json is missing" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_malformed_config(ckpt, tmp_path, capsys):
    (ckpt / "config.json").write_text('{"model_type": "qwen3", ')
    assert "is not valid JSON" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_config_without_required_field(ckpt, tmp_path, capsys):
    config = json.loads((ckpt / "config.json").read_text())
    del config["hidden_size"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "config.json lacks hidden_size" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_unsupported_architecture(ckpt, tmp_path, capsys):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="fancy_new_lm", architectures=["FancyNewLMForCausalLM"])  # unknown to transformers too
    (ckpt / "config.json").write_text(json.dumps(config))
    err = _convert_fails(ckpt, tmp_path / "out", capsys)
    assert "'fancy_new_lm' (FancyNewLMForCausalLM) is not supported" in err and "llama, mistral, qwen2, qwen3" in err


def test_unsupported_rope_type(ckpt, tmp_path, capsys):
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert "rope type 'dynamic' is not supported" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_missing_tensor(ckpt, tmp_path, capsys):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert "model.layers.1.mlp.up_proj.weight: missing" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_misshaped_tensor(ckpt, tmp_path, capsys):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].clone()
    _edit_tensors(ckpt, edit)
    err = _convert_fails(ckpt, tmp_path / "out", capsys)
    assert "model.layers.0.self_attn.k_proj.weight: shape [63, 64], expected [64, 64]" in err


def test_unknown_tensor(ckpt, tmp_path, capsys):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}))
    assert "model.layers.0.mlp.extra.weight: not a tensor of this architecture" in _convert_fails(
        ckpt, tmp_path / "out", capsys)


def test_truncated_safetensors(ckpt, tmp_path, capsys):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert "may be truncated" in _convert_fails(ckpt, tmp_path / "out", capsys)


def test_pickle_only_checkpoint_is_refused_unread(ckpt, tmp_path, capsys):
    (ckpt / "model.safetensors").unlink()
    # Not a pickle at all: were it ever unpickled, the error would differ.
    (ckpt / "pytorch_model.bin").write_bytes(b"never unpickle me")
    err = _convert_fails(ckpt, tmp_path / "out", capsys)
    assert "pickle weights (pytorch_model.bin)" in err and "safe_serialization=True" in err


def test_missing_shard(make_ckpt, tmp_path, capsys):
    hf = shutil.copytree(make_ckpt("qwen3", shard_size="100KB"), tmp_path / "hf")
    shards = sorted(hf.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    assert "listed in the checkpoint index is missing" in _convert_fails(hf, tmp_path / "out", capsys)


def test_existing_out_needs_force(make_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code = cli.main(["convert", str(make_ckpt("qwen3")), "-o", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "it exists; pass --force" in err and (out / "keep.txt").read_text() == "mine"
    (out / "fuselm.json").write_text("{}")  # --force replaces fuselm model directories only
    assert cli.main(["convert", str(make_ckpt("qwen3")), "-o", str(out), "--quiet", "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / DATA_NAME).is_file()


def test_no_traceback_from_the_console_script(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fuselm.cli", "convert", str(tmp_path / "nope"), "-o",
                        str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a directory" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_sharded_bf16_checkpoint(make_ckpt, tmp_path):
    hf = make_ckpt("qwen3", dtype="bfloat16", shard_size="100KB")
    assert (hf / "model.safetensors.index.json").is_file()
    out = fuselm.convert(hf, tmp_path / "out", quiet=True)
    model, ort_model = hf_model(hf), OrtRunner(out)
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, size=(1, 16))
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids)
    got_prefill, got_step = ort_prefill_decode(ort_model, ids, nxt)
    assert max(np.abs(ref_prefill - got_prefill).max(), np.abs(ref_step - got_step).max()) <= 1e-4


def test_mistral_sliding_window(make_ckpt, exported):
    model, ort_model = hf_model(make_ckpt("mistral", sliding_window=5)), OrtRunner(exported("mistral", sliding_window=5))
    ids = np.random.default_rng(8).integers(0, model.config.vocab_size, size=(1, 16))
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids)
    got_prefill, got_step = ort_prefill_decode(ort_model, ids, nxt)
    assert max(np.abs(ref_prefill - got_prefill).max(), np.abs(ref_step - got_step).max()) <= 1e-4
    # the window matters here: without it the logits differ
    full, _ = OrtRunner(exported("mistral")).forward(ids, np.ones((1, 16)), np.arange(16)[None])
    assert np.abs(full - got_prefill).max() > 1e-3


def test_check_flag(make_ckpt, tmp_path, capsys, monkeypatch):
    hf = make_ckpt("llama")
    assert cli.main(["convert", str(hf), "-o", str(tmp_path / "ok"), "--check"]) == 0
    assert "greedy tokens agree at 17/17" in capsys.readouterr().out
    monkeypatch.setattr(check_mod, "F32_TOLERANCE", 0.0)  # any float difference now fails
    monkeypatch.setattr(check_mod, "F32_RELATIVE", 0.0)
    assert cli.main(["convert", str(hf), "-o", str(tmp_path / "strict"), "--check", "--quiet"]) == 1
    assert "check failed: f32 export differs" in capsys.readouterr().err


def test_check_catches_a_wrong_weight(make_ckpt, exported, tmp_path):
    bad = shutil.copytree(exported("qwen3"), tmp_path / "bad")
    with open(bad / DATA_NAME, "r+b") as f:  # flip bytes in the middle of the weights
        f.seek(f.seek(0, 2) // 2)
        f.write(b"\x7f" * 64)
    with pytest.raises(CheckFailed):
        check_mod.check(bad, make_ckpt("qwen3"), quiet=True)


def test_quiet_is_silent(make_ckpt, tmp_path, capfd):
    fuselm.convert(make_ckpt("qwen3"), tmp_path / "q", quiet=True)
    assert capfd.readouterr() == ("", "")
    fuselm.convert(make_ckpt("qwen3"), tmp_path / "loud")
    assert "fuselm convert: wrote" in capfd.readouterr().out


def test_disk_full_leaves_nothing(make_ckpt, tmp_path, capsys, monkeypatch):
    import errno
    import os

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", full)
    err = _convert_fails(make_ckpt("qwen3"), tmp_path / "out", capsys)
    assert "No space left on device" in err and "free disk space" in err
