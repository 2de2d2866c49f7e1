"""fuselm convert, f32, every family: onnxruntime vs HF transformers, graph contract, FusedRoPE."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from fuselm.contract import MODEL_NAME
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner, hf_model, hf_prefill_decode, ort_prefill_decode

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]


def _hf_inv_freq(model) -> np.ndarray:
    return model.model.rotary_emb.inv_freq.numpy()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_matches_hf(family, make_ckpt, exported):
    """16-token prefill + one decode step with past: logits within 1e-4 of HF; graph checks; RoPE attrs."""
    out, hf = exported(family), make_ckpt(family)
    onnx.checker.check_model(str(out / MODEL_NAME), full_check=True)
    model, ort_model = hf_model(hf), OrtRunner(out)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, size=(2, 16))
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids)
    got_prefill, got_step = ort_prefill_decode(ort_model, ids, nxt)
    assert np.abs(ref_prefill - got_prefill).max() <= 1e-4
    assert np.abs(ref_step - got_step).max() <= 1e-4

    graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
    ropes = [n for n in graph.node if n.op_type == "FusedRoPE"]
    assert len(ropes) == 2 * model.config.num_hidden_layers
    for node in ropes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        np.testing.assert_array_equal(np.array(attrs["inv_freq"], np.float32), _hf_inv_freq(model))
        assert node.domain == "fuselm"


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_16_tokens_equal_hf(family, make_ckpt, exported):
    model, ort_model = hf_model(make_ckpt(family)), OrtRunner(exported(family))
    prompt = np.array([[5, 17, 42, 9, 100, 3, 77]])
    with torch.no_grad():
        ref = model.generate(torch.tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                             attention_mask=torch.ones_like(torch.tensor(prompt)))[0, prompt.shape[1]:].tolist()
    tokens, ids, past = [], prompt, None
    pos = np.arange(prompt.shape[1])[None]
    for _ in range(16):
        total = pos[0, -1] + 1
        logits, past = ort_model.forward(ids, np.ones((1, total)), pos, past)
        tokens.append(int(logits[0, -1].argmax()))
        ids, pos = np.array([[tokens[-1]]]), np.array([[total]])
    assert tokens == ref


def test_llama3_positions_beyond_original_context(make_ckpt, exported):
    """llama3 scaling (tiny original_max_position_embeddings = 16): positions 40..56 match HF."""
    model, ort_model = hf_model(make_ckpt("llama")), OrtRunner(exported("llama"))
    assert model.config.rope_parameters["original_max_position_embeddings"] < 40
    ids = np.random.default_rng(2).integers(0, model.config.vocab_size, size=(1, 16))
    positions = np.arange(40, 56)[None]
    ref_prefill, nxt, ref_step = hf_prefill_decode(model, ids, positions)
    got_prefill, got_step = ort_prefill_decode(ort_model, ids, nxt, positions)
    assert np.abs(ref_prefill - got_prefill).max() <= 1e-4
    assert np.abs(ref_step - got_step).max() <= 1e-4


def test_left_padding_batch(make_ckpt, exported):
    """Batch of 2 with left padding on one row: the padding mask and per-row position_ids."""
    model, ort_model = hf_model(make_ckpt("qwen3")), OrtRunner(exported("qwen3"))
    ids = np.random.default_rng(3).integers(1, model.config.vocab_size, size=(2, 10))
    mask = np.ones((2, 10), np.int64)
    mask[1, :4] = 0
    ids[1, :4] = 0
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(pos)).logits.numpy()
    got, _ = ort_model.forward(ids, mask, pos)
    assert np.abs(ref[mask == 1] - got[mask == 1]).max() <= 1e-4


def test_graph_contract(exported):
    out = exported("qwen3")
    model = onnx.load(str(out / MODEL_NAME), load_external_data=False)
    meta = read_meta(out)
    n = meta["dims"]["layers"]
    assert {o.domain: o.version for o in model.opset_import} == {"": 23, "fuselm": 1}
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "position_ids"] + [
        f"past_key_values.{i}.{kind}" for i in range(n) for kind in ("key", "value")]
    assert [o.name for o in model.graph.output] == ["logits"] + [
        f"present.{i}.{kind}" for i in range(n) for kind in ("key", "value")]
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["past_key_values.0.key"] == ["batch_size", meta["dims"]["kv_heads"], "past_sequence_length",
                                              meta["dims"]["head_dim"]]
    assert [f.name for f in model.functions] == ["FusedRoPE"]
    # Weights keep their HF names and live in the one external data file.
    names = {t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"} == {
        "model.onnx.data"}
    assert "/model/layers.0/attn/q_proj/MatMul" in {nd.name for nd in model.graph.node}
    assert meta["stage"] == "exported" and meta["passes"] == []
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_no_per_step_constant_work(exported):
    """Nodes fed only by initializers are weight decoding a runtime folds at load (Cast of f16,
    DequantizeLinear, the tied head's Transpose); the mask is built once for all layers."""
    for quant in ("f32", "q4"):
        graph = onnx.load(str(exported("qwen3", quant) / MODEL_NAME), load_external_data=False).graph
        constant = {t.name for t in graph.initializer}
        for node in graph.node:
            if all(i in constant for i in node.input if i):
                assert node.op_type in ("DequantizeLinear", "Cast", "Transpose"), node.name
                constant.update(node.output)
        ops = [n.op_type for n in graph.node]
        assert ops.count("Where") == 1 and ops.count("Range") == 2 and ops.count("Shape") == 2


def test_onnxruntime_default_optimizations_agree(exported):
    """With ORT's own fusions on (MatMulNBits for q4), the graph computes the same."""
    out = exported("qwen3", "q4")
    ids = np.arange(3, 19)[None]
    fused, _ = OrtRunner(out, optimize=True).forward(ids, np.ones((1, 16)), np.arange(16)[None])
    plain, _ = OrtRunner(out).forward(ids, np.ones((1, 16)), np.arange(16)[None])
    assert np.abs(fused - plain).max() <= 1e-3
