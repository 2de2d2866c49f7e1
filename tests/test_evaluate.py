"""`fuselm eval` (runtime_metal/evaluate.py) against figures computed here from HF's logits, on every backend;
`fuselm diff --reference` adds each pass's KL divergence from HF on the text."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fuselm
from fuselm import cli
from fuselm.text import EVAL_TEXT, read_text, windows


def _hf_figures(hf_dir, pieces, model_logits):
    """Perplexity of HF and of `model_logits`, KL and top-1, written out directly from torch's log-softmax."""
    import torch

    from fuselm.reference import hf_model, hf_scores

    model = hf_model(hf_dir)
    nll, ref_nll, kl, top = [], [], [], []
    for ids in pieces:
        ref = torch.log_softmax(torch.from_numpy(hf_scores(model, ids)).double(), -1)[:-1]
        got = torch.log_softmax(torch.from_numpy(model_logits(ids)).double(), -1)[:-1]
        t = torch.from_numpy(ids[1:])[:, None]
        nll.append(-got.gather(1, t)[:, 0])
        ref_nll.append(-ref.gather(1, t)[:, 0])
        kl.append((ref.exp() * (ref - got)).sum(-1))
        top.append((ref.argmax(-1) == got.argmax(-1)).double())
    return {"perplexity": float(torch.cat(nll).mean().exp()), "reference_perplexity": float(torch.cat(ref_nll).mean().exp()),
            "kl_mean": float(torch.cat(kl).mean()), "top1_agreement": float(torch.cat(top).mean())}


@pytest.mark.parametrize("backend", ["onnxruntime", "torch", "mlx", "numpy"])
def test_f32_scores_are_hf_on_every_backend(make_ckpt, exported, backend):
    """An f32 export's perplexity is HF's to 4 significant digits, KL ~ 0, top-1 all, on each backend."""
    hf, model = make_ckpt("llama"), exported("llama")
    rec = fuselm.eval(model, reference=hf, backend=backend, window=64, max_tokens=192, quiet=True)
    assert rec["windows"] == 3 and rec["positions"] == 3 * 63
    assert f"{rec['perplexity']:.4g}" == f"{rec['reference_perplexity']:.4g}"
    assert rec["kl_mean"] < 1e-6 and rec["top1_agreement"] == 1.0


def test_q4_figures_match_a_direct_computation(make_ckpt, exported, tmp_path):
    """A q4 graph's figures equal those computed here from onnxruntime's and HF's logits; the JSON record is written."""
    from fuselm.reference import OrtRunner, ort_scores
    from fuselm.tokenizer import load_tokenizer

    hf, model = make_ckpt("llama"), exported("llama", "q4")
    out = tmp_path / "eval.json"
    assert cli.main(["eval", str(model), "--reference", str(hf), "--window", "64", "--max-tokens", "128",
                     "--backend", "onnxruntime", "--json", str(out), "--quiet"]) == 0
    rec = json.loads(out.read_text())
    pieces = windows(load_tokenizer(model, required=True).encode(read_text(None)[0]), 64, 128)
    runner = OrtRunner(model)
    want = _hf_figures(hf, pieces, lambda ids: ort_scores(runner, ids))
    for key, value in want.items():
        assert rec[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert rec["kl_mean"] > 0 and rec["weight_bytes"] < (exported("llama") / "model.onnx.data").stat().st_size / 4
    assert rec["text"] == f"bundled {EVAL_TEXT.name}"


def test_eval_refuses_bad_input(exported, tmp_path, capsys):
    model = exported("llama")
    with pytest.raises(SystemExit) as e:  # argparse: no such backend
        cli.main(["eval", str(model), "--backend", "cuda"])
    assert e.value.code == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert cli.main(["eval", str(model), "--text", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_diff_reference_adds_each_pass_kl(make_ckpt, exported, capsys):
    hf, model = make_ckpt("llama"), exported("llama", "q4")
    data = fuselm.diff(model, reference=hf, max_tokens=64, quiet=True)
    changed = [r for r in data["passes"] if r["changed"]]
    assert data["text_kl"] > 0 and changed and all(np.isfinite(r["text_kl"]) for r in changed)
    # the portable passes change no arithmetic: each stage's KL stays the input's
    assert all(r["text_kl"] == pytest.approx(data["text_kl"], rel=1e-3) for r in changed)
    assert cli.main(["diff", str(model), "--reference", str(hf), "--max-tokens", "64"]) == 0
    assert "KL divergence from HF on the text before any pass" in capsys.readouterr().out
