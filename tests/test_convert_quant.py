"""Quantized and f16 exports: onnxruntime equals HF run on the dequantized weights; file sizes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from fuselm.contract import DATA_NAME, MODEL_NAME
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner, hf_model


def _stored(out) -> dict[str, np.ndarray]:
    model = onnx.load(str(out / MODEL_NAME))  # tiny: load the external data too
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _dequant(q, scales, zp, block, axis):
    """(q - zp) * scale with blocks of `block` along `axis` (written independently of exporter/quant.py)."""
    n = q.shape[axis]
    s = np.repeat(scales.astype(np.float32), block, axis=axis).take(range(n), axis=axis)
    z = np.repeat(zp.astype(np.float32), block, axis=axis).take(range(n), axis=axis)
    return (q.astype(np.float32) - z) * s


def _weight(stored, name, meta_entry, axis):
    """The float weight the graph computes with, as HF's layout for `name` (HF name of the source)."""
    if name in stored:
        return stored[name].astype(np.float32)
    block = meta_entry["block_size"]
    return _dequant(stored[f"{name}.qweight"], stored[f"{name}.scales"], stored[f"{name}.zero_points"], block, axis)


def _reference_model(hf, out):
    """HF's model with every weight replaced by what the export stores, dequantized."""
    model, stored, q = hf_model(hf), _stored(out), read_meta(out)["quantization"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight" or name.endswith("embed_tokens.weight"):
                continue
            entry = q["linear"] if p.ndim == 2 else None
            w = _weight(stored, name, entry, 0)
            p.copy_(torch.from_numpy(w.T.copy() if p.ndim == 2 else w))
        emb = _weight(stored, "model.embed_tokens.weight", q["embed"], 1)
        head_name = "lm_head.weight" if any(k.startswith("lm_head.weight") for k in stored) else None
        head = _weight(stored, head_name, q["lm_head"], 0).T if head_name else emb
        model.model.embed_tokens.weight = torch.nn.Parameter(torch.from_numpy(emb.copy()))
        model.lm_head.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(head)))
    return model


CASES = {
    "qwen3-q4": ("qwen3", {"quant": "q4"}),
    "qwen2-q8": ("qwen2", {"quant": "q8"}),
    "llama-f16": ("llama", {"quant": "f16"}),
    # ragged last block (intermediate 160, block 64), q8 embedding (Gather, then DequantizeLinear)
    "qwen2-q4-b64-embq8-headq4": ("qwen2", {"quant": "q4", "block_size": 64, "embed": "q8", "lm_head": "q4"}),
    # q4 embedding (DequantizeLinear, then Gather), f32 linears, tied head at f16
    "llama-f32-embq4-headf16": ("llama", {"quant": "f32", "embed": "q4", "lm_head": "f16"}),
}


@pytest.fixture(scope="module")
def converted(make_ckpt, exported, tmp_path_factory):
    import fuselm

    def get(case):
        family, kwargs = CASES[case]
        if set(kwargs) == {"quant"}:
            return exported(family, kwargs["quant"])
        out = tmp_path_factory.mktemp(case) / "model"
        return fuselm.convert(make_ckpt(family), out, quiet=True, **kwargs)
    return get


@pytest.mark.parametrize("case", CASES)
def test_quantized_matches_dequantized_reference(case, make_ckpt, converted):
    family, kwargs = CASES[case]
    quant = kwargs["quant"]
    out = converted(case)
    onnx.checker.check_model(str(out / MODEL_NAME), full_check=True)
    ref_model, ort_model = _reference_model(make_ckpt(family), out), OrtRunner(out)
    ids = np.random.default_rng(4).integers(0, ref_model.config.vocab_size, size=(1, 16))
    pos = np.arange(16)[None]
    with torch.no_grad():
        ref = ref_model(input_ids=torch.tensor(ids), position_ids=torch.tensor(pos)).logits.numpy()
    got, _ = ort_model.forward(ids, np.ones((1, 16)), pos)
    assert np.abs(ref - got).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    # ...and the quantization itself is sane: close to the original f32 model.
    with torch.no_grad():
        orig = hf_model(make_ckpt(family))(input_ids=torch.tensor(ids)).logits.numpy()
    assert np.abs(orig - got).max() < {"f32": 1.0, "f16": 0.01, "q8": 0.1, "q4": 1.0}[quant] * np.abs(orig).max()


def _theoretical_bytes(meta) -> int:
    """Bytes for the dims and precisions fuselm.json records: weights + scales + zero points."""
    d, q = meta["dims"], meta["quantization"]
    hid, inter, hd = d["hidden"], d["intermediate"], d["head_dim"]
    linears = [(hid, d["heads"] * hd), (hid, d["kv_heads"] * hd), (hid, d["kv_heads"] * hd),
               (d["heads"] * hd, hid), (hid, inter), (hid, inter), (inter, hid)]

    def size(n_in, n_out, p):
        if p["bits"] >= 16:
            return n_in * n_out * p["bits"] // 8
        nblk = -(-n_in // p["block_size"])
        return n_in * n_out * p["bits"] // 8 + nblk * n_out * (4 + p["bits"] / 8)

    total = d["layers"] * sum(size(i, o, q["linear"]) for i, o in linears)
    total += size(hid, d["vocab"], q["embed"])
    if q["lm_head"].get("shares") != "embed":  # a tied head at the embedding's precision is stored once
        total += size(hid, d["vocab"], q["lm_head"])
    return int(total)


@pytest.mark.parametrize("quant", ["q4", "q8"])
def test_file_size_near_theoretical(quant, exported):
    out = exported("qwen3", quant)
    meta = read_meta(out)
    want = _theoretical_bytes(meta)
    got = (out / DATA_NAME).stat().st_size
    assert abs(got - want) <= 0.10 * want, (got, want)


def test_metadata_records_precisions(exported):
    q = read_meta(exported("qwen3", "q4"))["quantization"]
    assert q["mode"] == "q4"
    assert q["linear"] == {"bits": 4, "block_size": 32, "symmetric": False, "dtype": "uint4", "method": "mse",
                           "scale_dtype": "float32", "zero_point_dtype": "uint4"}
    # q4 by default searches each block's range, weighted by the importance measured on the bundled text
    assert q["calibration"]["text"] == "bundled botchan-2.txt" and q["calibration"]["tokens"] > 0
    # the defaults (README "Defaults"): a tied checkpoint's head as --quant, its embedding the same tensor
    assert q["lm_head"]["bits"] == 8 and q["lm_head"]["shares"] == "embed" and q["embed"] == {
        k: v for k, v in q["lm_head"].items() if k != "shares"}


def test_default_precisions():
    from fuselm.exporter.quant import Precision, precisions

    assert precisions("q4", 32, None, None, tied=True) == (Precision("q4"), Precision("q8"), Precision("q8"))
    assert precisions("q4", 64, None, None, tied=False) == (Precision("q4", 64), Precision("f16", 64), Precision("q8", 64))
    assert precisions("q4", 32, "q4", None, tied=True) == (Precision("q4"),) * 3
    assert precisions("q4", 32, "q8", None, tied=True) == (Precision("q4"), Precision("q8"), Precision("q8"))
    assert precisions("f16", 32, None, None, tied=True) == (Precision("f16"),) * 3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape,block", [((96, 64), 32), ((70, 160), 64), ((33, 200), 128)])
def test_quantize_axes_agree_bit_for_bit(bits, shape, block):
    """Blocks along axis 1 (HF's [out, in] linears, embedding rows) give axis 0's result on the
    transpose exactly (ragged last blocks and all-zero blocks included), and each value is within
    half a step of the block's affine grid (checked with the independent `_dequant`)."""
    from fuselm.exporter.quant import Packed, quantize, quantize_linear

    w = np.random.default_rng(bits).standard_normal(shape).astype(np.float32) * 0.02
    w[:, :block] = 0
    rows = quantize(w, bits, block, axis=1)
    cols = quantize(np.ascontiguousarray(w.T), bits, block, axis=0)
    for a, b, c in zip(rows, cols, quantize_linear(w, bits, block), strict=True):
        if isinstance(c, Packed):  # uint4 [in, out] bytes in ONNX's packing
            assert bits == 4 and c.data.shape == (b.shape[0], b.shape[1] // 2)
            packed = np.frombuffer(c.data.tobytes(), np.uint8)  # low nibble first
            c = np.stack([packed & 0x0F, packed >> 4], axis=1).ravel()[: b.size].reshape(b.shape)
        assert a.dtype == b.dtype and np.array_equal(a.T, b) and np.array_equal(b, c)
    q, s, z = rows
    assert q.max() <= 2**bits - 1 and z.max() <= 2**bits - 1
    err = np.abs(_dequant(q, s, z, block, 1) - w)
    assert (err <= np.repeat(s, block, axis=1)[:, : shape[1]] * 0.5 + 1e-9).all()
    assert (_dequant(q, s, z, block, 1)[:, :block] == 0).all()
