"""Mixtures of experts through the traced exporter: one `fuselm::MoE` per sparse block.

Tiny random checkpoints made by transformers itself (per-expert tensors as save_pretrained writes
them; Granite-MoE's stacked input_linear), converted, checked against HF transformers (f32, prefill
+ a decode step with past, exporter/check.py) before and after `fuselm optimize`. Routing: Mixtral
and Granite-MoE renormalise the top-k (Granite takes the softmax over the top-k logits: the same);
OLMoE and Qwen2-MoE do not (their configs); Qwen3-MoE here with norm_topk_prob true; GLM-4.5 scores
each expert with a sigmoid and chooses with a bias. Qwen2-MoE's shared expert and its sigmoid gate are
plain nodes beside the op.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from fuselm.exporter.check import check
from onnx import helper as oh

import fuselm
from fuselm import contract, synth

MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, intermediate_size=64)
CASES = {
    "mixtral": (1, {}),
    "qwen3_moe": (1, dict(norm_topk_prob=True)),
    "olmoe": (0, {}),
    "qwen2_moe": (0, {}),
    "granitemoe": (1, {}),
}


def make(tmp_path, model_type, **extra):
    return synth.make_checkpoint(tmp_path / "hf", model_type, generic=True, **{**MOE, **CASES[model_type][1], **extra})


@pytest.mark.parametrize("model_type", CASES)
def test_moe_family_matches_hf_before_and_after_optimize(model_type, tmp_path):
    hf = make(tmp_path, model_type)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    meta = json.loads((out / "fuselm.json").read_text())["moe"]
    assert (meta["experts"], meta["top_k"], meta["normalize"]) == (4, 2, CASES[model_type][0])
    assert meta["shared_expert"] == (model_type == "qwen2_moe")
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    moes = [n for n in graph.node if n.op_type == contract.MOE_OP and n.domain == contract.DOMAIN]
    assert len(moes) == 2
    opt = fuselm.optimize(out, tmp_path / "opt", quiet=True)
    assert check(opt, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    optimized = onnx.load(opt / "model.onnx", load_external_data=False)
    ops = {n.op_type for n in optimized.graph.node}
    assert {"MoE", "Attention", "FusedRoPE", "RMSNormalization"} <= ops  # the dense fusions still apply
    assert [f.name for f in optimized.functions if f.name == "MoE"] == ["MoE"]


def test_moe_sigmoid_router_with_selection_bias(tmp_path):
    """GLM-4.5's router (DeepSeek-V3 style, one group): each expert's sigmoid, the top_k chosen with the
    checkpoint's e_score_correction_bias added, weighted without it, renormalised, times
    routed_scaling_factor; its shared experts beside the op. The bias is made random in the checkpoint
    (save_pretrained writes zeros), so choosing with it is what the comparison with HF checks; the
    runtime's sparse kernel (numpy, MLX) gives HF's greedy tokens."""
    from fuselm.runtime_metal.sampling import Sampler
    from fuselm.runtime_metal.session import Session
    from safetensors.torch import load_file, save_file

    from fuselm.reference import hf_model, hf_steps

    hf = synth.make_checkpoint(tmp_path / "hf", "glm4_moe", generic=True, **MOE, n_routed_experts=4, first_k_dense_replace=0,
                               n_group=1, topk_group=1, routed_scaling_factor=1.5)
    tensors = load_file(hf / "model.safetensors")
    biases = [k for k in tensors if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.rand(v.shape, generator=gen) if k in biases else v for k, v in tensors.items()},
              hf / "model.safetensors", metadata={"format": "pt"})
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    meta = json.loads((out / "fuselm.json").read_text())["moe"]
    assert (meta["scoring"], meta["selection_bias"], meta["normalize"], meta["scaling"]) == ("sigmoid", True, 1, 1.5)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    opt = fuselm.optimize(out, tmp_path / "opt", quiet=True)
    assert check(opt, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    want = hf_steps(hf_model(hf), [5, 9, 2, 7, 11], 5).tokens
    for backend in ("numpy", "mlx"):  # (MLX: the experts chosen by mx.argpartition, in no order)
        sess = Session(opt, backend=backend)
        sess.reset(10)
        assert list(sess.generate([5, 9, 2, 7, 11], 5, Sampler())) == want, backend


def test_moe_q4_experts_are_blocked_dequantize(tmp_path):
    hf = make(tmp_path, "qwen2_moe")
    out = fuselm.convert(hf, tmp_path / "q4", exporter="torch", quant="q4", quiet=True)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    moe = next(n for n in model.graph.node if n.op_type == "MoE")
    for w in moe.input[2:4]:
        dq = producers[w]
        assert dq.op_type == "DequantizeLinear" and oh.get_attribute_value(dq.attribute[0]) in (2, 32)
        assert inits[dq.input[0]].data_type == onnx.TensorProto.UINT4 and len(inits[dq.input[0]].dims) == 3
    # the shared expert's Linears (Gemm on [tokens, hidden] in the trace) are quantized MatMuls too
    shared = [n for n in model.graph.node if "shared_expert/" in n.name and n.op_type in ("MatMul", "Gemm")]
    assert shared and all(n.op_type == "MatMul" and producers[n.input[1]].op_type == "DequantizeLinear" for n in shared)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] < 1.0  # q4 noise, not a wrong graph


@pytest.mark.parametrize("scoring,normalize,clamped", [("softmax", 0, False), ("softmax", 1, False),
                                                      ("sigmoid", 1, False), ("softmax", 1, True)])
def test_moe_function_body_is_the_sparse_reference(scoring, normalize, clamped):
    """The op's FunctionProto (dense, in onnxruntime) against a per-token loop over the top-k experts; gpt-oss's
    form adds the router and expert biases and the clamped SwiGLU (inputs scaled so the clamp at 7 bites)."""
    n_exp, inter, hidden, k, scaling, alpha, limit = 4, 6, 8, 2, 1.5, 1.702, 7.0
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, hidden)).astype(np.float32) * (3 if clamped else 1)
    r = rng.standard_normal((n_exp, hidden)).astype(np.float32)
    gu = rng.standard_normal((n_exp, 2 * inter, hidden)).astype(np.float32)
    dn = rng.standard_normal((n_exp, hidden, inter)).astype(np.float32)
    bias = rng.random(n_exp).astype(np.float32)
    rb, gub, dnb = (rng.standard_normal(s).astype(np.float32) for s in ((n_exp,), (n_exp, 2 * inter), (n_exp, hidden)))
    sig = scoring == "sigmoid"
    node = contract.moe_node("x", "r", "gu", "dn", "y", "moe", k, normalize, scoring=scoring, scaling=scaling,
                             bias="b" if sig else None, biases=("rb", "gub", "dnb") if clamped else None,
                             activation="clamped_swiglu" if clamped else "silu", alpha=alpha, limit=limit)
    names, ranks, values = ["x", "r", "gu", "dn"], [3, 2, 3, 3], [x, r, gu, dn]
    if sig:
        names, ranks, values = names + ["b"], ranks + [1], values + [bias]
    if clamped:
        names, ranks, values = names + ["rb", "gub", "dnb"], ranks + [1, 2, 2], values + [rb, gub, dnb]
        assert list(node.input) == ["x", "r", "gu", "dn", "", "rb", "gub", "dnb"]
    info = [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [None] * rank) for n, rank in zip(names, ranks, strict=True)]
    graph = oh.make_graph([node], "g", info, [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None] * 3)])
    model = oh.make_model(graph, ir_version=11, functions=contract.functions_for([node]),
                          opset_imports=[oh.make_opsetid("", contract.OPSET), oh.make_opsetid(contract.DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    y = ort.InferenceSession(model.SerializeToString()).run(None, dict(zip(names, values, strict=True)))[0]
    y = y.reshape(-1, hidden)
    x2 = x.reshape(-1, hidden)
    logits = x2 @ r.T + (rb if clamped else 0)
    if sig:
        p = 1 / (1 + np.exp(-logits))
    else:
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
    want = np.zeros_like(x2)
    bites = 0
    for t in range(len(x2)):
        top = np.argsort(-(p[t] + bias if sig else p[t]))[:k]
        w = p[t, top] / (p[t, top].sum() if normalize else 1.0) * scaling
        for e, we in zip(top, w, strict=True):
            if clamped:  # gpt-oss's GptOssExperts._apply_gate, written out
                gate, up = np.split(gu[e] @ x2[t] + gub[e], 2)
                bites += int((gate > limit).sum() + (np.abs(up) > limit).sum())
                gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
                h = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
                want[t] += we * (dn[e] @ h + dnb[e])
            else:
                gate, up = np.split(gu[e] @ x2[t], 2)
                want[t] += we * (dn[e] @ (gate / (1 + np.exp(-gate)) * up))
    assert bites > 0 or not clamped  # the clamp is exercised
    np.testing.assert_allclose(y, want, atol=1e-4, rtol=1e-5)


def test_gpt_oss_converts_as_hf(gpt_oss):
    """gpt-oss: each sparse block one fuselm::MoE with its three biases and the clamped SwiGLU (alpha, limit read
    back from the experts module), experts in the op's layout; attention sinks traced as transformers' eager
    attention (the sink logit Concat-ed to the scores before Softmax, sliced off after: DESIGN.md's form);
    onnxruntime == HF (prefill past the window of 4 + a decode step)."""
    out = gpt_oss("f32")
    moe = json.loads((out / "fuselm.json").read_text())["moe"]
    assert (moe["activation"], moe["alpha"], moe["limit"], moe["biases"]) == ("clamped_swiglu", 1.702, 7.0, True)
    assert (moe["experts"], moe["top_k"], moe["normalize"], moe["expert_intermediate"]) == (4, 2, 1, 32)
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    moes = [n for n in graph.node if n.op_type == contract.MOE_OP]
    assert len(moes) == 2 and all(list(n.input)[4:] == [""] + [f"model.layers.{i}.mlp.{t}" for t in (
        "router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias")] for i, n in enumerate(moes))
    inits = {t.name: list(t.dims) for t in graph.initializer}
    assert inits["model.layers.0.mlp.experts.gate_up_proj"] == [4, 64, 64]  # [E, 2I, H]: the op's layout
    assert inits["model.layers.0.mlp.experts.down_proj"] == [4, 64, 32]  # [E, H, I]
    assert sum(n.op_type == "Softmax" and "self_attn" in n.name for n in graph.node) == 2  # the sinks' Softmax
    r = check(out, gpt_oss("hf"), quiet=True)
    assert r["positions"] > 4 and r["max_abs_logit_diff"] <= 1e-4  # past the sliding window


def test_gpt_oss_optimized_keeps_sinks_unfused(gpt_oss):
    """FuseAttention leaves attention with sinks unfused and says why (Attention-23 has no sinks); the other
    fusions apply; onnxruntime == HF after optimize; the MoE body is the biased form."""
    opt = gpt_oss("opt")
    assert check(opt, gpt_oss("hf"), quiet=True)["max_abs_logit_diff"] <= 1e-4
    passes = {p["pass"]: p for p in json.loads((opt / "fuselm.json").read_text())["passes"]}
    skipped = [s["reason"] for s in passes["FuseAttention"]["skipped"]]
    assert len(skipped) == 2 and all(s.startswith("attention sinks") for s in skipped)
    optimized = onnx.load(opt / "model.onnx", load_external_data=False)
    ops = {n.op_type for n in optimized.graph.node}
    assert "Attention" not in ops and {"MoE", "FusedRoPE", "RMSNormalization"} <= ops
    assert [list(f.input) for f in optimized.functions if f.name == "MoE"] == [list(contract.MOE_INPUTS)]


def test_gpt_oss_q4_experts_are_blocked_dequantize(gpt_oss):
    """q4: the relaid-out experts quantized along their input dim (axis 2), the biases float32."""
    out = gpt_oss("q4")
    model = onnx.load(out / "model.onnx", load_external_data=False)
    producers = {o: n for n in model.graph.node for o in n.output}
    inits = {i.name: i for i in model.graph.initializer}
    for moe in (n for n in model.graph.node if n.op_type == "MoE"):
        for w in moe.input[2:4]:
            dq = producers[w]
            assert dq.op_type == "DequantizeLinear" and inits[dq.input[0]].data_type == onnx.TensorProto.UINT4
        assert all(inits[b].data_type == onnx.TensorProto.FLOAT for b in moe.input[5:])
    assert check(out, gpt_oss("hf"), quiet=True)["max_abs_logit_diff"] < 1.0  # q4 noise, not a wrong graph


def test_gpt_oss_mxfp4_experts_are_refused(gpt_oss, tmp_path, capsys):
    """gpt-oss as released (experts as MXFP4 `_blocks` / `_scales`): exit 2 naming the format and the fix,
    nothing written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fuselm import cli

    hf = shutil.copytree(gpt_oss("hf"), tmp_path / "hf")
    tensors = {}
    for k, v in load_file(hf / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows, cols = v.shape
            tensors[k + "_blocks"] = torch.zeros(e, cols, rows // 32, 16, dtype=torch.uint8)
            tensors[k + "_scales"] = torch.zeros(e, cols, rows // 32, dtype=torch.uint8)
        else:
            tensors[k] = v
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    assert cli.main(["convert", str(hf), "-o", str(tmp_path / "out"), "--quiet", "--exporter", "torch"]) == 2
    err = capsys.readouterr().err
    assert "MXFP4-quantized" in err and "Mxfp4Config(dequantize=True)" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_type", ["qwen2_moe", "gpt_oss"])
def test_moe_from_the_trace_cache_is_the_same_model(model_type, tmp_path, monkeypatch, request):
    """A second convert stamps the cached trace (exporter/traced/cache.py) and stacks the per-expert tensors
    from the parts the entry recorded (gpt-oss: its stacks' layout, transposed and interleaved): the same
    bytes, without tracing."""
    from fuselm.exporter import traced as traced_pkg

    monkeypatch.setenv("FUSELM_TRACE_CACHE", "1")
    monkeypatch.setenv("FUSELM_TRACE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(traced_pkg, "_TRACED", {})
    hf = make(tmp_path, model_type) if model_type != "gpt_oss" else request.getfixturevalue("gpt_oss")("hf")
    first = fuselm.convert(hf, tmp_path / "first", exporter="torch", quant="q4", quiet=True)
    monkeypatch.setattr(traced_pkg, "_TRACED", {})
    monkeypatch.setattr(traced_pkg, "_traced", lambda *a: pytest.fail("traced again"))
    second = fuselm.convert(hf, tmp_path / "second", exporter="torch", quant="q4", quiet=True)
    for name in ("model.onnx", "model.onnx.data", "fuselm.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@pytest.mark.parametrize("model_type", ["phimoe", "ernie4_5_moe"])
def test_moe_router_forms_match_hf(moe_router, model_type):
    """Routers that are not plain top-k, read back from the model's own router and checked against HF (f32,
    prefill + decode) before and after optimize, on checkpoints that make the difference show (conftest):
    PhiMoE's sparsemixer (scoring="sparsemixer", its window router_jitter_noise = 0.01 read back as jitter_eps);
    Ernie-4.5-MoE's softmax router choosing with moe_statics.e_score_correction_bias ([1, E], given to the op as
    [E]), renormalised, its shared expert beside the op and its dense layer 0 a second layer kind."""
    hf, out = moe_router(model_type, "hf"), moe_router(model_type, "f32")
    meta = json.loads((out / "fuselm.json").read_text())
    moe = meta["moe"]
    if model_type == "phimoe":
        assert (moe["scoring"], moe["jitter_eps"], moe["normalize"], moe["blocks"]) == ("sparsemixer", 0.01, 0, 2)
    else:
        assert (moe["scoring"], moe["selection_bias"], moe["normalize"], moe["shared_expert"], moe["blocks"]) == (
            "softmax", True, 1, True, 1)
        assert meta["traced"]["layer_kinds"] == 2
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    opt = moe_router(model_type, "opt")
    assert check(opt, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    model = onnx.load(opt / "model.onnx", load_external_data=False)
    moes = [n for n in model.graph.node if n.op_type == contract.MOE_OP]
    assert moes and all(bool(n.input[4:5] and n.input[4]) == (model_type == "ernie4_5_moe") for n in moes)
    form = contract.moe_form(model.graph.node)
    assert (form.scoring, form.selection_bias) == (("sparsemixer", False) if model_type == "phimoe" else ("softmax", True))


def _ort_moe(node, names, values):
    info = [oh.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [None] * v.ndim) for n, v in zip(names, values, strict=True)]
    graph = oh.make_graph([node], "g", info, [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None] * 3)])
    model = oh.make_model(graph, ir_version=11, functions=contract.functions_for([node]),
                          opset_imports=[oh.make_opsetid("", contract.OPSET), oh.make_opsetid(contract.DOMAIN, 1)])
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString()).run(None, dict(zip(names, values, strict=True)))[0]


@pytest.mark.parametrize("scoring", ["sparsemixer", "softmax_bias"])
def test_moe_router_bodies_are_transformers_routers(scoring):
    """The op's function body (onnxruntime) and the runtime's sparse kernel (numpy backend) against transformers'
    own routers run as the experts' weights: `sparsemixer` (PhiMoE, eval mode) on logits within a few percent
    of each other, so its window both keeps and drops experts; Ernie-4.5-MoE's TopKRouter with a random bias."""
    from fuselm.runtime_metal.backends import make_backend
    from fuselm.runtime_metal.ops_moe import MoE
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    n_exp, inter, hidden, k = 4, 6, 8, 2
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, hidden)).astype(np.float32)
    base = rng.standard_normal((1, hidden)).astype(np.float32)
    r = (base + 0.01 * rng.standard_normal((n_exp, hidden)) if scoring == "sparsemixer"
         else rng.standard_normal((n_exp, hidden))).astype(np.float32)
    gu = rng.standard_normal((n_exp, 2 * inter, hidden)).astype(np.float32)
    dn = rng.standard_normal((n_exp, hidden, inter)).astype(np.float32)
    bias = rng.random(n_exp).astype(np.float32)
    logits = torch.from_numpy(x.reshape(-1, hidden) @ r.T)
    if scoring == "sparsemixer":
        weights, index = sparsemixer(logits, jitter_eps=0.01, training=False, top_k=k)
        assert (weights[:, 0] > 0.999).any() and (weights[:, 0] < 0.9).any()  # the window drops and keeps experts
        node = contract.moe_node("x", "r", "gu", "dn", "y", "moe", k, 0, scoring="sparsemixer", jitter_eps=0.01)
        names, values = ["x", "r", "gu", "dn"], [x, r, gu, dn]
    else:
        probs = torch.softmax(logits, -1)
        index = torch.topk(probs + torch.from_numpy(bias), k, -1).indices  # Ernie4_5_MoeTopKRouter.forward's steps
        weights = probs.gather(1, index)
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-12)
        assert not torch.equal(index.sort(-1).values, torch.topk(probs, k, -1).indices.sort(-1).values)  # it steers
        node = contract.moe_node("x", "r", "gu", "dn", "y", "moe", k, 1, bias="b")
        names, values = ["x", "r", "gu", "dn", "b"], [x, r, gu, dn, bias]
    x2 = x.reshape(-1, hidden)
    want = np.zeros_like(x2)
    for t in range(len(x2)):
        for e, w in zip(index[t].tolist(), weights[t].tolist(), strict=True):
            gate, up = np.split(gu[e] @ x2[t], 2)
            want[t] += w * (dn[e] @ (gate / (1 + np.exp(-gate)) * up))
    np.testing.assert_allclose(_ort_moe(node, names, values).reshape(-1, hidden), want, atol=1e-4, rtol=1e-5)
    b = make_backend("numpy")
    attrs = {a.name: oh.get_attribute_value(a) for a in node.attribute}
    attrs = {k_: v.decode() if isinstance(v, bytes) else v for k_, v in attrs.items()}
    got = MoE(b, *values, **attrs)
    np.testing.assert_allclose(np.asarray(got).reshape(-1, hidden), want, atol=1e-4, rtol=1e-5)


def test_jetmoe_experts_sorted_by_expert_convert_as_hf(tmp_path):
    """JetMoE: a mixture of attention experts (per-token top-k query / output projections) and MLP experts, both
    on token groups its router sorts by expert: traced per (token, slot) row, the graph equals HF (prefill and a
    decode step), with no fuselm::MoE (no op expresses attention experts)."""
    hf = synth.make_checkpoint(tmp_path / "hf", "jetmoe", generic=True, num_local_experts=4, num_experts_per_tok=2)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    ops = {n.op_type for n in onnx.load(out / "model.onnx", load_external_data=False).graph.node}
    assert contract.MOE_OP not in ops and "Gather" in ops


def _sweep_overrides(model_type: str) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from traced_sweep import tiny_overrides

    return {k: v for k, v in tiny_overrides(model_type).items() if not k.startswith("_")}


def test_dbrx_looped_experts_convert_as_hf(tmp_path):
    """DBRX: experts that loop over the routed experts, each a GLU of w1 / v1 / w2 [E·I, H] viewed per expert:
    computed from gathered weights, the graph equals HF (prefill and a decode step; logits of about 0.2 at this
    size, the diff some 1e-7 of them)."""
    hf = synth.make_checkpoint(tmp_path / "hf", "dbrx", generic=True, **_sweep_overrides("dbrx"))
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    r = check(out, hf, quiet=True)
    assert r["max_abs_logit_diff"] <= 1e-4 * max(1.0, r["max_abs_logit"]) and r["max_abs_logit"] > 0.1, r


def test_llama4_scaled_input_experts_convert_as_hf(tmp_path):
    """Llama 4's MoE layer: the router's score (zero off its top-k) scales each expert's input: each token's top-k
    experts from gathered weights, beside the shared expert; the graph equals HF before and after optimize."""
    hf = synth.make_checkpoint(tmp_path / "hf", "llama4_text", generic=True, **_sweep_overrides("llama4_text"))
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    assert json.loads((out / "fuselm.json").read_text())["traced"]["chunked_layers"] == [0]


def test_moe_routing_form_survives_an_underflowing_softmax():
    """A wide router (OLMoE-1B-7B: hidden 2048, 64 experts, top 8) on the probe's random tokens makes logits
    ~45 apart, so a chosen expert's softmax can be exactly 0 in f32; the form is still read (0/0 was nan and
    refused OLMoE-1B-7B as "neither softmax-top-k nor sigmoid-top-k")."""
    from types import SimpleNamespace

    from fuselm.exporter.traced import moe as traced_moe

    gen = torch.Generator().manual_seed(0)
    router = torch.randn(64, 2048, generator=gen)
    x2 = torch.randn(32, 2048, generator=gen) * torch.tensor([2.0] * 16 + [0.002] * 16)[:, None]  # wide, and spread
    probs = torch.softmax(x2 @ router.T, dim=-1)  # OlmoeTopKRouter, norm_topk_prob false
    weights, index = torch.topk(probs, 8, dim=-1)
    assert bool((weights == 0).any())  # the case: an underflowed weight among the chosen
    block = SimpleNamespace(router=SimpleNamespace(), bias=None, router_weight=router, router_bias=None, bias_at=None)
    assert traced_moe._routing_form(block, x2, index, weights, 8)
    assert (block.top_k, block.scoring, block.normalize, block.scaling) == (8, "softmax", 0, 1.0)
