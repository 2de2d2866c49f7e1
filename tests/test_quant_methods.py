"""The quantization methods and mixed precision (exporter/quant.py, exporter/calibrate.py): same storage format,
less error where it counts; each method end to end through `fuselm convert` on a tiny checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fuselm.exporter.calibrate import OPTIONS, allocate, calibrate
from fuselm.exporter.quant import Precision, dequantize, gptq, quantize

from fuselm import cli


def _weights(seed=0, shape=(48, 256)):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * 0.02
    w[rng.random(shape) < 0.01] *= 12  # a few outliers, as trained weights have
    return w


def _deq(q, s, z, block):
    n = q.shape[1]
    return (q.astype(np.float32) - np.repeat(z, block, 1)[:, :n]) * np.repeat(s, block, 1)[:, :n]


def _block_errors(w, parts, block, weight):
    e = (np.square(_deq(*parts, block) - w) * weight)
    return e.reshape(w.shape[0], -1, block).sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
def test_mse_picks_no_worse_block_than_min_max(bits):
    """Every block's weighted error under `mse` is at most min/max's (its first candidate is min/max's range),
    with magnitude weights and with calibrated importance; the format (uint values, f32 scales) is the same."""
    w = _weights(bits)
    imp = np.random.default_rng(1).random(w.shape[1]).astype(np.float32) * 3
    rtn = quantize(w, bits, 32, axis=1)
    for importance, weight in ((None, np.abs(w) + np.sqrt(np.square(w.reshape(48, -1, 32)).mean(-1)).repeat(32, 1)),
                               (imp, imp[None])):
        mse = quantize(w, bits, 32, axis=1, method="mse", importance=importance)
        assert mse[0].dtype == np.uint8 and mse[0].max() <= 2**bits - 1 and mse[1].dtype == np.float32
        better = _block_errors(w, rtn, 32, weight) - _block_errors(w, mse, 32, weight)
        assert (better >= -1e-12).all() and (better.sum() > 0 or bits == 8)  # 8-bit keeps min/max


def test_mse_axis0_is_axis1_transposed():
    w = _weights(3, (40, 96))  # 96 = 3 blocks of 32, 40 rows
    rows = quantize(w, 4, 32, axis=1, method="mse")
    cols = quantize(np.ascontiguousarray(w.T), 4, 32, axis=0, method="mse")
    for a, b in zip(rows, cols, strict=True):
        assert np.array_equal(a.T, b)


def test_gptq_lowers_the_output_error():
    """On correlated inputs X, GPTQ's ||X (W - Q)ᵀ|| is below round-to-nearest's (and below `mse` alone)."""
    rng = np.random.default_rng(2)
    w = _weights(4, (64, 128))
    x = rng.standard_normal((2048, 128)).astype(np.float32) @ (np.eye(128) + 0.3 * rng.standard_normal((128, 128)))
    x = x.astype(np.float32)
    h = x.T @ x / len(x)
    errors = {}
    for name, parts in (("rtn", quantize(w, 4, 32, axis=1)), ("mse", quantize(w, 4, 32, axis=1, method="mse")),
                        ("gptq", gptq(w, h, 4, 32))):
        errors[name] = float(np.square(x @ (_deq(*parts, 32) - w).T).mean())
        assert parts[0].max() <= 15 and parts[2].max() <= 15
    assert errors["gptq"] < 0.8 * errors["rtn"] and errors["gptq"] < errors["mse"], errors


def test_allocate_spends_the_budget_where_the_loss_falls_most():
    """Mixed precision: the average stays within the budget; the tensor whose gradient is 100x larger gets the
    upgrades first."""
    rng = np.random.default_rng(5)
    weights = {f"t{i}": _weights(i, (64, 256)) for i in range(4)}
    cal = {"weights": weights, "importance": {n: np.ones(256, np.float32) for n in weights},
           "gradients": {n: np.full(64, 100.0 if n == "t2" else 1.0, np.float32) * (1 + rng.random(64)) for n in weights}}
    chosen = allocate(cal, 6.0, "rtn", Precision("q4", 32))
    bits = sum(chosen[n].bits_per_weight() * w.size for n, w in weights.items()) / sum(w.size for w in weights.values())
    assert bits <= 6.0 and set(chosen) == set(weights)
    assert chosen["t2"].bits_per_weight() > max(chosen[n].bits_per_weight() for n in weights if n != "t2")
    assert {(p.kind, p.block) for p in chosen.values()} <= set(OPTIONS)


def test_allocate_scales_each_class_to_the_measured_kl():
    """With a model to measure, the head's and the layers' estimates are scaled to the KL each class's measured
    change costs: equal estimates, a head whose error the probe says costs 100x more gets the upgrades first
    (without the probe it gets none before the others)."""
    weights = {n: _weights(i, (64, 256)) for i, n in enumerate(("head", "t1", "t2", "t3"))}
    ones = {n: np.ones(s, np.float32) for n, s in (("imp", 256), ("g", 64))}
    cal = {"weights": weights, "importance": {n: ones["imp"] for n in weights},
           "gradients": {n: ones["g"] for n in weights}, "head": "head"}
    cost = {"head": 100.0, "t1": 1.0, "t2": 1.0, "t3": 1.0}
    probe = {"kl": lambda swap: sum(cost[n] * float(np.square(w - weights[n]).sum()) for n, w in swap.items())}
    plain = allocate(dict(cal), 5.5, "rtn", Precision("q4", 32))
    measured = allocate({**cal, **probe}, 5.5, "rtn", Precision("q4", 32))
    assert measured["head"].bits_per_weight() > max(measured[n].bits_per_weight() for n in ("t1", "t2", "t3"))
    assert plain["head"].bits_per_weight() <= max(plain[n].bits_per_weight() for n in ("t1", "t2", "t3"))


def test_tied_table_gptq_counts_both_uses(make_ckpt):
    """A tied table is the input embedding and the head: its GPTQ Hessian (the head's Fisher plus the input use's
    diagonal, min/max ranges) leaves a trained model's next-token distributions on held-out text closer to
    float32 than round to nearest, and than GPTQ by the head's inputs alone (which moves error into the rows)."""
    import torch

    from fuselm.reference import hf_model
    from fuselm.text import CALIB_TEXT, read_text, windows
    from fuselm.tokenizer import load_tokenizer

    hf = make_ckpt("gemma3_text", train_steps=25)
    cal = calibrate(hf, hessians=True, tokens=512)
    name = cal["head"]
    w = np.array(cal["weights"][name])
    assert name in cal["embedding"] and cal["embedding"][name].shape == (w.shape[1],)
    model, tok = hf_model(hf), load_tokenizer(hf, required=True)
    table = model.get_input_embeddings().weight
    inputs = []
    model.get_output_embeddings().register_forward_hook(lambda m, a, o: inputs.append(a[0][0]))
    with torch.no_grad():
        for ids in windows(tok.encode(read_text(None, CALIB_TEXT)[0]), 512, 512):
            model(input_ids=torch.tensor([ids]))
    x = torch.cat(inputs)
    head_only = (x.T @ x / len(x)).numpy()

    def kl(parts) -> float:
        out = []
        for ids in windows(tok.encode(read_text(None)[0]))[:2]:
            with torch.no_grad():
                table.data = torch.from_numpy(w)
                ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
                table.data = torch.from_numpy(dequantize(*parts, 32, axis=1))
                out.append(float((ref.exp() * (ref - torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1))).sum(-1).mean()))
        return float(np.mean(out))
    both = kl(gptq(w, np.asarray(cal["hessians"][name]), 4, 32, search=False))
    assert both < kl(quantize(w, 4, 32, axis=1)) and both < kl(gptq(w, head_only, 4, 32)), both


def test_each_method_converts_end_to_end(make_ckpt, tmp_path, capsys):
    """--method rtn|mse|gptq, --no-calib and --bits-per-weight through the CLI: a checked graph, fuselm.json says
    how each class was stored, the calibration and the tensors mixed precision stored otherwise; diff shows them."""
    hf = make_ckpt("llama")
    for i, flags in enumerate((["--method", "rtn"], ["--method", "mse", "--no-calib"], ["--method", "mse"],
                               ["--method", "gptq"], ["--method", "gptq", "--bits-per-weight", "5.0"])):
        out = tmp_path / f"m{i}"
        assert cli.main(["convert", str(hf), "-o", str(out), "--quant", "q4", "--quiet", *flags]) == 0, flags
        q = json.loads((out / "fuselm.json").read_text())["quantization"]
        assert q["linear"]["method"] == flags[1]
        # q4 mse calibrates by default where the float32 model fits in memory (a tiny one does)
        assert ("calibration" in q) == (flags[1] != "rtn" and "--no-calib" not in flags)
        if "--bits-per-weight" in flags:
            assert q["tensors"] and all(v.split("/")[0] in ("q4", "q8") for v in q["tensors"].values())
            assert set(q["calibration"]["kl_per_estimate"]) == {"head", "layers"}  # the measured exchange rates
            capsys.readouterr()
            assert cli.main(["diff", str(out)]) == 0
            assert "mixed precision" in capsys.readouterr().out
    assert cli.main(["convert", str(hf), "-o", str(tmp_path / "bad"), "--quant", "f32", "--bits-per-weight", "5"]) == 2
