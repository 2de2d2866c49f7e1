"""The attention variants of the 2026 families through the traced exporter, the passes and the runtime.

DeepSeek-V3 (multi-head latent attention with its interleaved rotary: the compressed latent is the cache,
fuselm::LatentAttention reads it), Llama 4 (chunked local attention, a NoPE layer with attention temperature
tuning, L2 q/k norms), Gemma 4 (per-layer head_dim, a layer that reads another layer's keys and values,
per-layer inputs). Each: onnxruntime == HF transformers (f32, a prefill and a decode step with past,
exporter/check.py) exported and optimized; the runtime's greedy tokens against HF's on torch, numpy and MLX;
LatentAttention's kernel (expanded and absorbed) against its function body; the pipeline split with KV sharing.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from fuselm.exporter.check import check
from fuselm.passes.split import split
from fuselm.runtime_metal.ops_latent import absorbed
from fuselm.runtime_metal.sampling import Sampler
from fuselm.runtime_metal.session import Session

import fuselm
from fuselm import contract, synth
from fuselm.errors import FuselmError
from fuselm.reference import hf_model, hf_steps

MLA = dict(head_dim=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=32, q_lora_rank=48,
           num_key_value_heads=4, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, n_group=1, topk_group=1)  # dense layers: the attention is what is tested
# a chunk of 4 and a floor_scale of 4 make the chunks and the NoPE layer's temperature change inside the prompts
LLAMA4 = dict(no_rope_layers=[1, 0], attention_chunk_size=4, floor_scale=4, moe_layers=[], intermediate_size_mlp=128)
# layer 0 sliding (head_dim 16), layers 1-2 global (head_dim 32, k = v); layer 2 reads layer 1's keys and values
GEMMA4 = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "full_attention"],
              num_kv_shared_layers=1, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=384, sliding_window=4,
              tie_word_embeddings=False)
PROMPT = [5, 9, 2, 7, 11, 3, 8, 20, 33, 4]


def _converted(root, model_type: str, **overrides):
    hf = synth.make_checkpoint(root / "hf", model_type, generic=True, **overrides)
    out = fuselm.convert(hf, root / "out", exporter="torch", quiet=True)
    return hf, out, fuselm.optimize(out, root / "opt", quiet=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", **MLA)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("llama4_text"), "llama4_text", **LLAMA4)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return _converted(tmp_path_factory.mktemp("gemma4_text"), "gemma4_text", **GEMMA4)


def _meta(path) -> dict:
    return json.loads((path / contract.META_NAME).read_text())


def _greedy(path, backend: str, n: int = 6) -> list[int]:
    sess = Session(path, backend=backend)
    sess.reset(len(PROMPT) + n)
    return list(sess.generate(PROMPT, n, Sampler()))


@pytest.mark.parametrize("family", ["deepseek", "llama4", "gemma4"])
def test_onnxruntime_equals_hf_exported_and_optimized(family, request):
    hf, out, opt = request.getfixturevalue(family)
    for graph in (out, opt):
        assert check(graph, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    model = onnx.load(opt / contract.MODEL_NAME, load_external_data=False)
    props = {p.key: json.loads(p.value) for p in model.metadata_props}
    assert props[contract.ATTENTION_META] == _meta(out)["attention"]  # the graph carries it through the passes


def test_latent_attention_caches_the_latent(deepseek):
    """Both layers' caches are the normalized latent [B, 1, past, kv_lora_rank] (`.key`) and the rotary key
    [B, 1, past, qk_rope_head_dim] (`.value`), read by fuselm::LatentAttention; DeepSeek-V3's interleaved rotary
    is FusedRoPE's interleaved layout."""
    hf, out, _ = deepseek
    graph = onnx.load(out / contract.MODEL_NAME, load_external_data=False).graph
    shapes = {i.name: contract.dims(i) for i in graph.input}
    for layer in range(2):
        assert shapes[contract.past_name(layer, "key")][1::2] == [1, MLA["kv_lora_rank"]]
        assert shapes[contract.past_name(layer, "value")][1::2] == [1, MLA["qk_rope_head_dim"]]
    latent = [n for n in graph.node if n.op_type == contract.LATENT_OP]
    assert [n.input[1] for n in latent] == [contract.present_name(i, "key") for i in range(2)]
    assert {a.name: a.i for a in latent[0].attribute if a.type == onnx.AttributeProto.INT} == \
        {"num_heads": 4, "qk_nope_head_dim": 8, "v_head_dim": 16}
    assert {a.i for n in graph.node if n.op_type == contract.ROPE_OP for a in n.attribute if a.name == "interleaved"} == {1}
    layers = _meta(out)["attention"]["layers"]
    assert [x["cache"] for x in layers] == ["latent", "latent"] and layers[0]["key_dim"] == MLA["kv_lora_rank"]


@pytest.mark.parametrize("family", ["deepseek", "llama4", "gemma4"])
def test_runtime_greedy_equals_hf(family, request):
    hf, _, opt = request.getfixturevalue(family)
    want = hf_steps(hf_model(hf), PROMPT, 6).tokens
    assert len(set(want)) > 1  # not a degenerate model
    for backend in ("torch", "numpy", "mlx"):
        assert _greedy(opt, backend) == want, backend


def test_latent_attention_kernel_forms_equal_its_function():
    """The runtime kernel, expanded (a prompt) and absorbed (decode), against onnxruntime running the op's
    function body, on every backend."""
    from fuselm.runtime_metal.backends import make_backend
    from fuselm.runtime_metal.ops_latent import LatentAttention

    heads, nope, rot, v, r = 4, 8, 8, 16, 32
    rng = np.random.default_rng(0)
    func = contract.latent_attention_function()
    node = contract.latent_attention_node("q", "latent", "k_rot", "weight", "mask", "y", "la", heads, nope, v, 0.3)
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info(n, f32, None) for n in node.input],
                                   [onnx.helper.make_tensor_value_info("y", f32, None)])
    model = onnx.helper.make_model(graph, functions=[func], opset_imports=[
        onnx.helper.make_opsetid("", contract.OPSET), onnx.helper.make_opsetid(contract.DOMAIN, 1)])
    from fuselm.reference import ort_session

    sess = ort_session(model.SerializeToString())
    for s, t in ((5, 5), (1, 9)):
        feeds = {"q": rng.standard_normal((1, heads, s, nope + rot)), "latent": rng.standard_normal((1, 1, t, r)),
                 "k_rot": rng.standard_normal((1, 1, t, rot)), "weight": rng.standard_normal((r, heads * (nope + v))),
                 "mask": np.where(np.arange(t)[None] <= np.arange(t - s, t)[:, None], 0.0, -1e9)[None, None]}
        feeds = {k: x.astype(np.float32) for k, x in feeds.items()}
        want = sess.run(None, feeds)[0]
        assert absorbed(s, t, r, nope, v) == (s == 1)  # decode absorbs, a prompt expands
        for name in ("numpy", "torch", "mlx"):
            b = make_backend(name)
            got = LatentAttention(b, *(b.asarray(feeds[k]) for k in node.input), num_heads=heads,
                                  qk_nope_head_dim=nope, v_head_dim=v, scale=0.3)
            np.testing.assert_allclose(b.to_numpy(got), want, atol=2e-5, err_msg=f"{name} s={s}")


def test_latent_attention_q4_runs_on_every_backend(deepseek, tmp_path):
    hf, _, _ = deepseek
    q4 = fuselm.convert(hf, tmp_path / "q4", exporter="torch", quant="q4", quiet=True)  # the trace is kept in-process
    runs = {b: _greedy(q4, b) for b in ("torch", "numpy", "mlx")}
    assert runs["torch"] == runs["numpy"] == runs["mlx"]


def test_chunked_attention_is_recorded_and_read_by_rows(llama4):
    """The chunked layer's mask is a chunked band of 4 in fuselm.json and for the runtime (MLX reads the rows of
    the query's chunk, decoding with static shapes); the NoPE layer carries no FusedRoPE."""
    _, out, opt = llama4
    meta = _meta(out)
    assert meta["attention"]["chunk_size"] == 4 and [x["mask"] for x in meta["attention"]["layers"]] == ["chunked", "causal"]
    assert meta["rope"]["layers_without_rope"] == [1]
    sess = Session(opt, backend="mlx")
    attention = [n for n in sess.graph.nodes if n.op_type == "Attention"]
    assert [(n.attrs.get("causal_rows"), n.attrs.get("causal_chunk")) for n in attention] == [(0, 4), (0, None)]
    assert sess.causal_reads


def test_kv_sharing_reader_has_no_cache_of_its_own(gemma4):
    """Layer 2 reads layer 1's keys and values: no past_key_values.2.*, its Attention's past is layer 1's; each
    layer's cache has its own head_dim; the split keeps layer 2 with layer 1."""
    _, out, _ = gemma4
    model = onnx.load(out / contract.MODEL_NAME, load_external_data=False)
    pasts = {i.name: contract.dims(i) for i in model.graph.input if contract.is_past(i.name)}
    assert sorted(pasts) == [contract.past_name(i, k) for i in (0, 1) for k in contract.KINDS]
    assert pasts["past_key_values.0.key"][3] == 16 and pasts["past_key_values.1.key"][3] == 32
    reader = next(n for n in model.graph.node if n.op_type == "Attention" and "layers.2/" in n.name)
    assert list(reader.input[4:6]) == ["past_key_values.1.key", "past_key_values.1.value"]
    layers = _meta(out)["attention"]["layers"]
    assert [x.get("kv_source") for x in layers] == [None, None, 1] and layers[2]["cache"] == "shared"
    assert contract.kv_sources({p.key: p.value for p in model.metadata_props}) == {2: 1}


def test_split_refuses_to_separate_shared_kv_or_per_layer_inputs(gemma4, tmp_path):
    """A cut between layer 1 and layer 2, which reads its keys and values, is refused by name; any cut of this model
    is, since every layer reads a per-layer input computed from the token ids before the first layer."""
    _, _, opt = gemma4
    with pytest.raises(FuselmError, match="layer 2 reads the keys and values of layer 1"):
        split(opt, tmp_path / "bad", layers="0-1,2-2", quiet=True)
    with pytest.raises(FuselmError, match="per-layer inputs"):
        split(opt, tmp_path / "ple", stages=2, quiet=True)
