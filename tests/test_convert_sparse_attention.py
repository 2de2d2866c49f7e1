"""DeepSeek sparse attention (DeepSeek-V3.2) through the traced exporter, the passes and the runtime.

Its indexer keeps keys of its own (the third cache tensor, past_key_values.{i}.index) and lets each query attend to
its top-k keys only. Each query here may attend to 4 keys of up to 16: onnxruntime == HF transformers (f32, a prefill
and a decode step with past, exporter/check.py) exported and optimized, where leaving keys out moves the logits (so a
wrong selection fails the check) and no two keys tie at the cut; the runtime's greedy tokens against HF's on torch,
numpy and MLX, and at q4 against one another.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from fuselm.exporter.check import check
from fuselm.runtime_metal.sampling import Sampler
from fuselm.runtime_metal.session import Session

import fuselm
from fuselm import contract, synth
from fuselm.reference import hf_model, hf_prefill_decode, hf_steps

TOP_K = 4
# MLA at the tiny size, both layers dense (one layer kind to trace); 8 index heads, so no two keys score exactly 0
DSA = dict(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48,
           num_key_value_heads=4, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, n_group=1, topk_group=1, index_topk=TOP_K, index_n_heads=8, index_head_dim=16)
PROMPT = [5, 9, 2, 7, 11, 3, 8, 20, 33, 4]


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v32")
    hf = synth.make_checkpoint(root / "hf", "deepseek_v32", generic=True, **DSA)
    out = fuselm.convert(hf, root / "out", exporter="torch", quiet=True)
    return hf, out, fuselm.optimize(out, root / "opt", quiet=True)


def _cut_gaps(model, ids) -> list[float]:
    """HF's prefill and decode step on `ids`, recording per query with more than TOP_K keys the gap between the
    k-th and the (k+1)-th index score (0: a tie at the cut)."""
    gaps, topk = [], torch.Tensor.topk

    def recording(scores, k, *args, **kwargs):
        if scores.dim() == 3 and k == TOP_K:  # the indexer's [B, S, T] scores
            for row in scores.reshape(-1, scores.shape[-1]):
                kept = row[row > torch.finfo(row.dtype).min / 2].sort(descending=True).values
                if kept.numel() > k:
                    gaps.append(float(kept[k - 1] - kept[k]))
        return topk(scores, k, *args, **kwargs)

    torch.Tensor.topk = recording
    try:
        hf_prefill_decode(model, ids)
    finally:
        torch.Tensor.topk = topk
    return gaps


def test_onnxruntime_equals_hf_with_keys_left_out(dsa):
    hf, out, opt = dsa
    for graph in (out, opt):
        assert check(graph, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    model = hf_model(hf)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(1, 16))  # check()'s prompt
    gaps = _cut_gaps(model, ids)
    assert len(gaps) > 10 and min(gaps) > 1e-4  # the selection leaves keys out, and no tie decides it
    sparse = hf_prefill_decode(model, ids)[0]
    for m in model.modules():
        if hasattr(m, "index_topk"):
            m.index_topk = 10**6
    assert np.abs(hf_prefill_decode(model, ids)[0] - sparse).max() > 0.01  # every key: other logits


def test_indexer_keys_are_a_third_cache(dsa):
    """Each layer carries past_key_values.{i}.index [B, 1, past, index_head_dim] beside the latent's two, recorded in
    fuselm.json and the graph's metadata; the indexer's rotate-half rotary, beside the attention's interleaved one,
    is written in standard ops (one FusedRoPE layout per graph)."""
    _, out, opt = dsa
    model = onnx.load(opt / contract.MODEL_NAME, load_external_data=False)
    shapes = {i.name: contract.dims(i) for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for layer in range(2):
        assert shapes[contract.past_name(layer, contract.INDEX)][1::2] == [1, 16]
        assert contract.present_name(layer, contract.INDEX) in outputs
    meta = json.loads((out / contract.META_NAME).read_text())
    assert meta["layer_types"] == ["indexed_attention"] * 2
    assert [(x["cache"], x["index_dim"], x["index_topk"]) for x in meta["attention"]["layers"]] == [("latent", 16, TOP_K)] * 2
    assert json.loads({p.key: p.value for p in model.metadata_props}[contract.ATTENTION_META]) == meta["attention"]
    assert {a.i for n in model.graph.node if n.op_type == contract.ROPE_OP for a in n.attribute
            if a.name == "interleaved"} == {1}
    assert sum(n.op_type == "TopK" for n in model.graph.node) == 2


def _greedy(path, backend: str, n: int = 6, **options) -> list[int]:
    sess = Session(path, backend=backend, **options)
    sess.reset(len(PROMPT) + n)
    return list(sess.generate(PROMPT, n, Sampler()))


def test_runtime_greedy_equals_hf(dsa):
    hf, _, opt = dsa
    want = hf_steps(hf_model(hf), PROMPT, 6).tokens
    assert len(set(want)) > 1
    for backend in ("torch", "numpy", "mlx"):
        assert _greedy(opt, backend) == want, backend
    assert _greedy(opt, "torch", kv_bits=8) == want  # the indexer's keys stored 8-bit too


def test_q4_runs_on_every_backend(dsa, tmp_path):
    hf, _, _ = dsa
    q4 = fuselm.convert(hf, tmp_path / "q4", exporter="torch", quant="q4", quiet=True)  # the trace is kept in-process
    runs = {b: _greedy(q4, b) for b in ("torch", "numpy", "mlx")}
    assert runs["torch"] == runs["numpy"] == runs["mlx"]


def test_a_layer_reusing_another_layers_selection(tmp_path):
    """GLM-MoE-DSA's layer 2 has no indexer: it attends to the keys layer 1's indexer chose (the model hands it what
    layer 1 returns beside its hidden state). The graph equals HF; the layer reads layer 1's TopK and has no index
    cache; the metadata says so, and a pipeline split keeps the two layers in one stage (chained stages equal the
    unsplit graph) and refuses a cut between them by name."""
    from fuselm.passes.split import split

    from fuselm.errors import FuselmError
    from fuselm.reference import OrtRunner, ort_session

    hf = synth.make_checkpoint(tmp_path / "hf", "glm_moe_dsa", generic=True,
                               **{**DSA, "num_hidden_layers": 3, "first_k_dense_replace": 3, "index_topk_freq": 2})
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    meta = json.loads((out / contract.META_NAME).read_text())
    assert [x.get("reads_layer") for x in meta["attention"]["layers"]] == [None, None, 1]
    assert meta["layer_types"] == ["indexed_attention", "indexed_attention", "full_attention"]
    model = onnx.load(out / contract.MODEL_NAME, load_external_data=False)
    assert [sum(n.op_type == "TopK" and f"layers.{i}/" in n.name for n in model.graph.node) for i in range(3)] == [1, 1, 0]
    assert contract.past_name(2, contract.INDEX) not in {i.name for i in model.graph.input}
    assert _greedy(out, "torch") == hf_steps(hf_model(hf), PROMPT, 6).tokens

    with pytest.raises(FuselmError, match="layer 2 reads a tensor .* of layer 1"):
        split(out, tmp_path / "bad", layers="0-1,2", quiet=True)
    report = split(out, tmp_path / "s", stages=2, quiet=True)
    assert [s["layers"] for s in report["stages"]] == [[0, 0], [1, 2]]
    ref = OrtRunner(out)
    ids = np.array([[5, 17, 3, 42, 8, 1, 9, 12]], np.int64)
    want, _ = ref.forward(ids)
    hidden, outs = None, {}
    for k in range(2):
        sess = ort_session(tmp_path / "s" / f"stage{k}")
        feeds = {contract.ATTENTION_MASK: np.ones((1, 8), np.int64), contract.POSITION_IDS: np.arange(8)[None]}
        for i in sess.get_inputs():
            if i.name in (contract.INPUT_IDS, contract.HIDDEN):
                feeds[i.name] = ids if i.name == contract.INPUT_IDS else hidden
            elif contract.is_past(i.name):
                feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        hidden = outs.get(contract.NEXT_HIDDEN)
    np.testing.assert_array_equal(outs[contract.LOGITS], want)


# Qwen4-Exp: a linear-attention layer, then attention whose block indexer pools its keys in blocks of 2 and lets each
# query attend to its top 2 complete blocks and its own incomplete one; 8 index heads, so that no two blocks tie
QSA = dict(full_attention_interval=2, indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4,
           indexer_compress_ratio=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, intermediate_size=64)


def test_block_indexer_converts_as_hf(tmp_path):
    """transformers selects per query in a Python loop over the cached positions' cos/sin; the graph selects over cache
    indices (block_indexer.py) and equals HF where the selection leaves keys out (every block: other logits) with no
    tie at the cut; the runtime's greedy tokens equal HF's on every backend; a selection that differs from the family's
    own `_select_tokens` is refused."""
    import importlib

    from fuselm.exporter.traced import block_indexer

    from fuselm.errors import FuselmError

    hf = synth.make_checkpoint(tmp_path / "hf", "qwen4_exp_text", generic=True, **QSA)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    meta = json.loads((out / contract.META_NAME).read_text())
    assert meta["layer_types"] == ["gated_delta_net", "indexed_attention"]
    assert meta["attention"]["layers"][1]["index_dim"] == 16
    model = hf_model(hf)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, size=(1, 16))  # check()'s prompt
    gaps, topk = [], torch.Tensor.topk

    def recording(scores, k, *args, **kwargs):  # transformers' per-query top-k over the complete blocks
        if scores.dim() == 1 and scores.numel() > k:
            kept = scores.sort(descending=True).values
            gaps.append(float(kept[k - 1] - kept[k]))
        return topk(scores, k, *args, **kwargs)

    torch.Tensor.topk = recording
    try:
        sparse = hf_prefill_decode(model, ids)[0]
    finally:
        torch.Tensor.topk = topk
    assert len(gaps) > 5 and min(gaps) > 1e-4
    for m in model.modules():
        if hasattr(m, "block_topk"):
            m.token_budget, m.block_topk = 64, 32
    assert np.abs(hf_prefill_decode(model, ids)[0] - sparse).max() > 0.01
    want = hf_steps(hf_model(hf), PROMPT, 6).tokens
    for backend in ("torch", "numpy", "mlx"):
        assert _greedy(out, backend) == want, backend

    modeling = importlib.import_module("transformers.models.qwen4_exp.modeling_qwen4_exp")
    right = block_indexer.select
    try:
        block_indexer.select = lambda ix, q, keys, rotate, mask: right(ix, q, keys, rotate, mask).flip(-1)
        with pytest.raises(FuselmError, match="selects other keys"):
            block_indexer.verify(modeling.Qwen4ExpForCausalLM(synth.make_config("qwen4_exp_text", generic=True, **QSA)),
                                 synth.make_config("qwen4_exp_text", generic=True, **QSA), "qwen4_exp_text")
    finally:
        block_indexer.select = right
