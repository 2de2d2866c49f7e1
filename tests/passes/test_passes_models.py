"""The pipeline on real exports: every family in f32 and q4, HF's greedy tokens, a torch.onnx export."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
from fuselm.passes.check import drift, run_steps

import fuselm
from fuselm.reference import ort_session

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]


def _nodes(path):
    return onnx.load(str(path), load_external_data=False).graph.node


@pytest.mark.parametrize("quant", ["f32", "q4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_pass_keeps_the_numbers(exported, family, quant):
    """fuselm diff: after each pass, onnxruntime on the new graph equals the previous stage."""
    data = fuselm.diff(exported(family, quant), quiet=True)
    layers = 2
    fired = {r["pass"]: r["fired"] for r in data["passes"]}
    assert fired["FuseQKV"] == fired["FuseGateUp"] == fired["FuseAttention"] == fired["AttentionTo3D"] == layers
    assert fired["FuseRMSNorm"] == (4 if family == "qwen3" else 2) * layers + 1
    assert fired["FuseRoPE"] == 0  # fuselm's exporter writes FusedRoPE already
    assert fired["RoPETo3D"] == 2 * layers and fired["FuseSwiGLU"] == layers
    assert fired["FuseRoPENorm"] == (2 * layers if family == "qwen3" else 0)  # only Qwen3 has q/k norms
    for r in data["passes"]:
        if not r["changed"]:
            continue
        assert r["checker"] == "ok", r["pass"]
        for step in ("prefill", "decode"):
            assert r["drift"][step]["logits_rel"] <= 1e-5, (r["pass"], step, r["drift"])
            assert r["drift"][step]["all_outputs_rel"] <= 1e-5, (r["pass"], step, r["drift"])
    assert data["nodes_out"] < data["nodes_in"]


@pytest.mark.parametrize("quant", ["f32", "q4"])
def test_optimized_qwen3_layer(optimized, quant):
    out = optimized("qwen3", quant)
    nodes = _nodes(out / "model.onnx")
    layer = Counter(n.op_type for n in nodes if n.name.startswith("/model/layers.0/"))
    assert layer["MatMul"] == 4  # qkv, o, gate/up, down
    names = {n.name for n in nodes if n.op_type == "MatMul" and n.name.startswith("/model/layers.0/")}
    assert names == {f"/model/layers.0/{s}/MatMul" for s in ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj",
                                                              "mlp/down_proj")}
    assert layer["FusedRoPE"] == 2 and layer["Attention"] == 1 and layer["RMSNormalization"] == 2
    assert layer["SwiGLU"] == 1 and layer["Sigmoid"] == 0 and layer["Mul"] == 0
    assert layer["Softmax"] == layer["Pow"] == layer["ReduceMean"] == layer["Expand"] == 0
    assert layer["DequantizeLinear"] == (4 if quant == "q4" else 0)
    # Attention in its 3-D form: no head Transposes nor Reshapes; q and k go to FusedRoPE as [B,S,H·D]
    # (num_heads) with their q/k norm weights, v straight from the Split.
    assert layer["Transpose"] == 0 and layer["Reshape"] == 0
    ropes = [n for n in nodes if n.op_type == "FusedRoPE" and n.name.startswith("/model/layers.0/")]
    assert all(len(n.input) == 3 and n.input[2].endswith(("q_norm.weight", "k_norm.weight")) for n in ropes)
    # RMSNorm x2, MatMul x4, Split, residual Add x2, FusedRoPE x2, Attention, SwiGLU
    assert sum(layer.values()) == 13 + (4 if quant == "q4" else 0)
    # No dead node anywhere: every output is read or is a graph output.
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    read = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    assert all(any(o in read for o in n.output) for n in graph.node)
    meta = json.loads((out / "fuselm.json").read_text())
    assert meta["stage"] == "optimized" and [p["pass"] for p in meta["passes"]][:3] == ["UpgradeOpset", "FromGenAI", "RemoveDeadShapeOp"]
    assert (out / "tokenizer.json").is_file()


def _ort_greedy(path, prompt: list[int], steps: int) -> list[int]:
    sess = ort_session(path)
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name: i for i in sess.get_inputs()}
    past = {n: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for n, i in inputs.items()
            if n.startswith("past_key_values.")}
    ids, done, tokens = list(prompt), 0, []
    while len(tokens) < steps:
        new = ids[done:]
        feeds = {"input_ids": np.array([new], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                 "position_ids": np.arange(done, len(ids), dtype=np.int64)[None], **past}
        out = dict(zip(names, sess.run(None, feeds), strict=True))
        past = {n: out[n.replace("past_key_values.", "present.")] for n in past}
        done = len(ids)
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        ids.append(token)
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_hf(optimized, make_ckpt, family):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 42, 99, 7, 250]
    model = AutoModelForCausalLM.from_pretrained(make_ckpt(family), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert _ort_greedy(optimized(family, "f32") / "model.onnx", prompt, 16) == hf


def _signature(path):
    m = onnx.load(str(path), load_external_data=False)
    nodes = [(n.op_type, n.name, tuple(n.input), tuple(n.output), tuple(str(a) for a in n.attribute))
             for n in m.graph.node]
    inits = sorted((i.name, i.data_type, tuple(i.dims)) for i in m.graph.initializer)
    return nodes, inits, [f.name for f in m.functions]


def test_pipeline_twice_gives_the_same_graph(optimized, tmp_path):
    once = optimized("qwen2", "q4")
    twice = fuselm.optimize(once, tmp_path / "twice", quiet=True)
    meta = json.loads((twice / "fuselm.json").read_text())
    assert not any(p["changed"] for p in meta["passes"])
    assert _signature(once / "model.onnx") == _signature(twice / "model.onnx")
    a = run_steps(once / "model.onnx")
    b = run_steps(twice / "model.onnx", steps=a)
    assert all(v["all_outputs_rel"] == 0.0 for v in drift(a, b).values())



def test_passes_keep_nothing_of_the_graph_they_ran_on(exported, tmp_path):
    """PIPELINE's pass objects live as long as the process: after a run none may hold a value of the graph
    (one that did kept every source weight mapped: 0.5 GB resident after `--backend auto` lowered the 0.6B q4)."""
    import onnx_ir as ir
    from fuselm.passes.pipeline import PIPELINE

    fuselm.optimize(exported("qwen3", "q4"), tmp_path / "o", quiet=True, target="onnxruntime")

    def holds(x) -> bool:
        if isinstance(x, ir.Value | ir.Node | ir.Graph | ir.Model):
            return True
        if isinstance(x, dict):
            return any(holds(k) or holds(v) for k, v in x.items())
        return isinstance(x, list | tuple | set) and any(holds(v) for v in x)

    assert not [p.name for p in PIPELINE if holds(vars(p))]

@pytest.mark.slow
@pytest.mark.parametrize("attn,onnxscript_optimize", [("eager", False), ("sdpa", True)])
def test_passes_on_a_torch_onnx_export(make_ckpt, tmp_path, attn, onnxscript_optimize):
    """A plain HF model exported by torch.onnx (dynamo): fully decomposed (eager attention, no
    onnxscript rewrites), and torch's defaults (sdpa; onnxscript already wrote RotaryEmbedding,
    RMSNormalization and a cache-less Attention)."""
    from torch_export import export_hf

    src = export_hf(make_ckpt("qwen3"), tmp_path / "torch" / "model.onnx", attn_implementation=attn,
                    optimize=onnxscript_optimize)
    out = fuselm.optimize(src, tmp_path / "opt", quiet=True)
    ops = Counter(n.op_type for n in _nodes(out / "model.onnx"))
    # q/k norms folded into FusedRoPE (9 - 4), the SiLU gates one SwiGLU each
    assert ops["FusedRoPE"] == 4 and ops["Attention"] == 2 and ops["RMSNormalization"] == 5 and ops["SwiGLU"] == 2
    assert ops["Softmax"] == ops["Cos"] == ops["Neg"] == ops["Pow"] == ops["RotaryEmbedding"] == 0
    attention = [n for n in _nodes(out / "model.onnx") if n.op_type == "Attention"]
    assert all(len(n.input) == 6 and len(n.output) == 3 for n in attention)  # the cache is inside
    qkv = [n for n in _nodes(out / "model.onnx") if n.op_type == "MatMul" and "qkv_proj" in n.name]
    assert len(qkv) == 2 and ops["MatMul"] == 2 * 4 + 1
    made_by = {o: n.op_type for n in _nodes(out / "model.onnx") for o in n.output}
    assert all(made_by[n.input[i]] != "Transpose" for n in attention for i in range(3))  # 3-D q/k/v
    assert {r["pass"]: r["fired"] for r in json.loads((out / "fuselm.json").read_text())["passes"]}["AttentionTo3D"] == 2
    before = run_steps(src)
    after = run_steps(out / "model.onnx", steps=before)
    for step, d in drift(before, after).items():
        assert d["logits_rel"] <= 1e-5 and d["all_outputs_rel"] <= 1e-5, (step, d)
    meta = json.loads((out / "fuselm.json").read_text())
    assert meta["dims"]["layers"] == 2 and meta["dims"]["kv_heads"] == 2 and meta["dims"]["heads"] == 4


def test_passes_never_read_weights(exported, tmp_path):
    """The whole pipeline runs on the graph alone: with model.onnx.data absent nothing fails, every
    fusion fires, and the fused weights are lazy concatenations (read only when written)."""
    import shutil

    import onnx_ir as ir
    from fuselm.passes import graphio
    from fuselm.passes.pipeline import run_pipeline

    shutil.copy(exported("qwen3", "q4") / "model.onnx", tmp_path / "model.onnx")
    model = graphio.load(tmp_path / "model.onnx")
    records = run_pipeline(model)
    assert {r["pass"]: r["fired"] for r in records}["FuseQKV"] == 2
    lazy = [v.name for v in model.graph.initializers.values() if isinstance(v.const_value, ir.LazyTensor)]
    assert any("qkv_proj" in n for n in lazy) and any("gate_up_proj" in n for n in lazy)
