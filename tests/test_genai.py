"""onnxruntime-genai both ways: its builder's graphs into `fuselm optimize` / `diff` / `run`
(passes/from_genai.py), and fuselm's directories run by `onnxruntime_genai.Model` (genai_config.json)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from fuselm.passes.check import drift, run_steps

import fuselm
from fuselm import contract
from fuselm.errors import FuselmError

og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is a dev dependency (pyproject [dev])")


def _builder(*argv: str) -> None:
    """`python -m onnxruntime_genai.models.builder ARGV`, run in this process: a child would spend
    ~10 s importing torch and transformers again."""
    old = sys.argv
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    finally:
        sys.argv = old


@pytest.fixture(scope="module")
def genai_dir(make_ckpt, tmp_path_factory):
    """Factory: genai_dir(family, precision) -> a directory written by onnxruntime-genai's builder."""
    cache: dict = {}

    def get(family: str, precision: str) -> Path:
        if (family, precision) not in cache:
            root = tmp_path_factory.mktemp(f"genai-{family}-{precision}")
            _builder("-i", str(make_ckpt(family)), "-o", str(root / "model"), "-p", precision, "-e", "cpu",
                     "-c", str(root / "cache"))
            cache[family, precision] = root / "model"
        return cache[family, precision]

    return get


def _nodes(path: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(path), load_external_data=False).graph.node)


def _exact_reference(src: Path, dst: Path) -> Path:
    """The genai graph with MatMulNBits at accuracy level 1 (f32 activations): its default, 4,
    quantizes activations to int8, which the standard DequantizeLinear + MatMul does not."""
    shutil.copytree(src, dst)
    m = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 1
    onnx.save(m, str(dst / "model.onnx"))
    return dst / "model.onnx"


@pytest.mark.parametrize("family,precision", [("qwen3", "int4"), ("llama", "fp32")])
def test_genai_graph_optimizes_to_standard_ops(genai_dir, make_ckpt, tmp_path, family, precision):
    """qwen3 int4 (separate q/k/v after q/k norms, MatMulNBits, an int4 embedding) and llama fp32
    (packed qkv into GQA, one kv head, llama3 rope scaling): no contrib op is left, RoPE carries
    HF's inv_freq, and onnxruntime gives the same logits and cache before and after."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    src = genai_dir(family, precision)
    out = fuselm.optimize(src, tmp_path / "opt", quiet=True)
    nodes = _nodes(out / "model.onnx")
    ops = Counter(n.op_type for n in nodes)
    assert not [n for n in nodes if n.domain == "com.microsoft"] and ops["SimplifiedLayerNormalization"] == 0
    norms = 9 if family == "qwen3" else 5  # qwen3 adds q_norm and k_norm per layer
    assert ops["FusedRoPE"] == 4 and ops["Attention"] == 2 and ops["RMSNormalization"] == norms
    # qkv, o, gate_up (fused by FuseGateUp), down per layer; the head; the int4 embedding
    assert ops["DequantizeLinear"] == (0 if precision == "fp32" else 4 * 2 + 1 + 1)
    inputs = [i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input]
    assert inputs[:2] == ["input_ids", "attention_mask"] and "position_ids" in inputs

    config = AutoConfig.from_pretrained(make_ckpt(family))
    inv, scaling = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, torch.device("cpu")) \
        if config.rope_parameters["rope_type"] != "default" else (None, 1.0)
    if inv is None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv = 1.0 / config.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    rope = next(n for n in nodes if n.op_type == "FusedRoPE")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in rope.attribute}
    np.testing.assert_allclose(attrs["inv_freq"], np.asarray(inv, np.float64), rtol=1e-5)
    assert attrs["attention_scaling"] == pytest.approx(float(scaling))

    reference = _exact_reference(src, tmp_path / "ref") if precision == "int4" else src / "model.onnx"
    before = run_steps(reference)
    after = run_steps(out / "model.onnx", steps=before)
    for step, d in drift(before, after).items():
        assert d["logits_rel"] <= 1e-5 and d["all_outputs_rel"] <= 1e-5, (step, d)


def test_genai_graph_diff_and_run(genai_dir, tmp_path):
    """`fuselm diff` walks the same passes with numbers (the genai graph's symbolic head dim comes
    from its genai_config.json); `fuselm run` generates from the optimized directory."""
    src = genai_dir("llama", "fp32")
    with pytest.raises(FuselmError, match=r"run `fuselm optimize DIR -o OUT` first"):
        fuselm.run(src, prompt=[5], max_tokens=1, backend="torch", quiet=True, stream=io.StringIO())
    data = fuselm.diff(src, quiet=True)
    first = {r["pass"]: r for r in data["passes"]}
    assert first["FromGenAI"]["changed"] and first["FromGenAI"]["counts"]["GroupQueryAttention"] == 2
    assert "error" not in first["FromGenAI"]["drift"], first["FromGenAI"]["drift"]
    assert data["opset_upgrade"].startswith("default-domain opset 2")
    out = fuselm.optimize(src, tmp_path / "opt", quiet=True)
    meta = json.loads((out / "fuselm.json").read_text())
    assert meta["max_position_embeddings"] == 256 and meta["dims"]["head_dim"] == 16
    from fuselm.reference import OrtRunner

    result = fuselm.run(out, prompt=[5, 17, 33], max_tokens=4, ignore_eos=True, backend="torch", quiet=True,
                        stream=io.StringIO())
    assert result["tokens"] == OrtRunner(out / "model.onnx").greedy([5, 17, 33], 4).tokens


def _edited(src: Path, dst: Path, edit, weights: bool = False) -> Path:
    shutil.copytree(src, dst)
    m = onnx.load(str(dst / "model.onnx"), load_external_data=weights)
    edit(m)
    onnx.save(m, str(dst / "model.onnx"))
    return dst


def _set(m, op: str, name: str, value) -> None:
    for n in m.graph.node:
        if n.op_type == op:
            n.attribute.append(onnx.helper.make_attribute(name, value)) if name not in [a.name for a in n.attribute] \
                else None
            for a in n.attribute:
                if a.name == name:
                    a.CopyFrom(onnx.helper.make_attribute(name, value))


def _rename(m, old: str, new: str, domain: str | None = None) -> None:
    n = next(n for n in m.graph.node if n.op_type == old)
    n.op_type = new
    if domain is not None:
        n.domain = domain


@pytest.mark.parametrize("edit,match", [
    (lambda m: _set(m, "GroupQueryAttention", "local_window_size", 4),
     r"GroupQueryAttention\) has no standard ONNX equivalent fuselm can map: local_window_size"),
    (lambda m: _set(m, "GroupQueryAttention", "smooth_softmax", 1), r"smooth_softmax"),
    (lambda m: _rename(m, "GroupQueryAttention", "PagedAttention"), r"com\.microsoft::PagedAttention\) has no standard"),
    (lambda m: _rename(m, "SimplifiedLayerNormalization", "LayerNormalizationV9"),
     r"uses op 'LayerNormalizationV9', which is not an ONNX op at default-domain opset 22"),
])
def test_unmappable_contrib_ops_are_named_not_blamed_on_the_file(genai_dir, tmp_path, edit, match):
    src = _edited(genai_dir("qwen3", "int4"), tmp_path / "edited", edit)
    with pytest.raises(FuselmError, match=match) as e:
        fuselm.optimize(src, tmp_path / "opt", quiet=True)
    assert "restore the file" not in str(e.value) and e.value.exit_code == 2


def test_cache_that_is_not_cos_of_positions_is_refused(genai_dir, tmp_path):
    """FusedRoPE needs inv_freq; a cos/sin table that is not cos/sin(p · inv_freq) has none."""
    def scramble(m):
        for t in m.graph.initializer:
            if t.name == "cos_cache":
                a = onnx.numpy_helper.to_array(t).copy()
                np.random.default_rng(0).shuffle(a[1:])
                t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))

    src = _edited(genai_dir("qwen3", "int4"), tmp_path / "edited", scramble, weights=True)
    with pytest.raises(FuselmError, match=r"the cos/sin tables are not cos/sin\(position × inv_freq\)"):
        fuselm.optimize(src, tmp_path / "opt", quiet=True)


def _genai_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    model = og.Model(str(model_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(prompt):]]


@pytest.mark.parametrize("stage", ["exported", "optimized"])
def test_onnxruntime_genai_runs_fuselm_directories(exported, optimized, stage):
    """genai's greedy search on `fuselm convert` / `optimize` output (f32, untied qwen2: random
    tied embeddings just repeat the prompt) gives plain onnxruntime's tokens."""
    from fuselm.reference import OrtRunner

    model_dir = exported("qwen2") if stage == "exported" else optimized("qwen2")
    config = json.loads((model_dir / "genai_config.json").read_text())
    assert config["model"]["type"] == "decoder" and config["search"]["past_present_share_buffer"] is False
    assert config["model"]["decoder"]["inputs"]["position_ids"] == "position_ids"
    prompt = [100, 200, 300, 50]
    tokens = _genai_greedy(model_dir, prompt, 10)
    assert tokens == OrtRunner(model_dir / "model.onnx").greedy(prompt, 10).tokens
    assert len(set(tokens)) > 3  # not a degenerate repetition


def test_no_genai_config_for_an_index_cache():
    """genai's decoder feeds past_key_values.{i}.key / .value only: a graph with a sparse-attention layer's
    `.index` cache gets no genai_config.json, the same graph without it does."""
    from fuselm.genai_config import genai_config

    meta = {"dims": {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "layers": 1, "vocab": 100},
            "attention": {"layers": [{"cache": "kv", "kv_heads": 2, "key_dim": 16, "value_dim": 16}]}}
    inputs = [*contract.STEP_INPUTS, contract.past_name(0, "key"), contract.past_name(0, "value")]
    assert genai_config(meta, inputs) is not None
    assert genai_config(meta, [*inputs, contract.past_name(0, contract.INDEX)]) is None
