"""fuselm::MoE in the runtime (runtime_metal/ops_moe.py): the sparse kernel on every backend against HF
transformers' greedy tokens (f32), the inlined function body, and q4 experts folded into QMoE with MLX
(`mx.gather_qmm`) == torch == numpy on the same graph."""

from __future__ import annotations

import numpy as np
import pytest
from fuselm.runtime_metal.backends.base import QuantizedWeight
from fuselm.runtime_metal.sampling import Sampler
from fuselm.runtime_metal.session import Session

import fuselm
from fuselm import synth
from fuselm.reference import hf_model, hf_steps

MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, intermediate_size=64)
PROMPT = [5, 9, 2, 7, 11, 3, 8, 20, 33, 4]


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    root = tmp_path_factory.mktemp("olmoe")
    hf = synth.make_checkpoint(root / "hf", "olmoe", generic=True, **MOE)
    opt = fuselm.optimize(fuselm.convert(hf, root / "out", exporter="torch", quiet=True), root / "opt", quiet=True)
    return hf, opt


def _greedy(sess, ids, n):
    sess.reset(len(ids) + n)
    return list(sess.generate(ids, n, Sampler()))


@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
def test_moe_greedy_matches_hf(olmoe, backend):
    hf, opt = olmoe
    want = hf_steps(hf_model(hf), PROMPT, 6).tokens
    sess = Session(opt, backend=backend)
    assert any(n.op_type == "MoE" for n in sess.graph.nodes)  # the sparse kernel, not the inlined body
    assert _greedy(sess, PROMPT, 6) == want
    if backend == "torch":  # the function body (every expert, dense) gives the same tokens
        plain = Session(opt, backend=backend, fused_kernels=False)
        assert not any(n.op_type == "MoE" for n in plain.graph.nodes)
        assert _greedy(plain, PROMPT, 6) == want


def _q4_tokens_agree(model) -> None:
    """A q4 MoE graph's experts folded into two QMoE nodes (MLX: 4-bit, its own packing), and the same greedy
    tokens after a 40-token prompt on torch, MLX and numpy."""
    runs = {}
    for backend in ("torch", "mlx", "numpy"):
        sess = Session(model, backend=backend)
        moes = [n for n in sess.graph.nodes if n.op_type == "QMoE"]
        assert len(moes) == 2 and all(isinstance(n.attrs["gate_up"], QuantizedWeight) for n in moes)
        if backend == "mlx":
            assert moes[0].attrs["gate_up"].kind == "mlx" and moes[0].attrs["gate_up"].bits == 4
        runs[backend] = _greedy(sess, list(range(3, 43)), 6)
    assert runs["mlx"] == runs["torch"] == runs["numpy"]


def test_moe_q4_experts_mlx_equals_torch(tmp_path):
    hf = synth.make_checkpoint(tmp_path / "hf", "qwen2_moe", generic=True, **MOE)  # with a shared expert
    out = fuselm.convert(hf, tmp_path / "q4", exporter="torch", quant="q4", quiet=True)
    _q4_tokens_agree(out)  # 40 tokens x top-2: MLX sorts by expert (mlx-lm's _gather_sort)


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_expert_matmul_backends(tokens):
    """x @ w[experts]^T per (token, slot) on each backend, against numpy's einsum: decode, a short and a
    long prompt (torch's gather and grouped paths, MLX's sorted path), shared and per-slot inputs."""
    from fuselm.runtime_metal.backends import make_backend

    rng = np.random.default_rng(tokens)
    w = rng.standard_normal((4, 6, 8)).astype(np.float32)
    experts = np.stack([rng.permutation(4)[:2] for _ in range(tokens)]).astype(np.int64)
    x2 = rng.standard_normal((tokens, 8)).astype(np.float32)
    x3 = rng.standard_normal((tokens, 2, 8)).astype(np.float32)
    for name in ("numpy", "torch", "mlx"):
        b = make_backend(name)
        for x in (x2, x3):
            xs = np.broadcast_to(x[:, None], (tokens, 2, 8)) if x.ndim == 2 else x
            want = np.einsum("tkc,tkrc->tkr", xs, w[experts])
            got = b.to_numpy(b.expert_matmul(b.asarray(x), b.asarray(w), b.asarray(experts)))
            np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)
        # the whole expert MLP (MLX sorts the rows by expert once for 40 tokens x 2 slots)
        down = rng.standard_normal((4, 8, 3)).astype(np.float32)
        h = np.einsum("tkc,tkrc->tkr", np.broadcast_to(x2[:, None], (tokens, 2, 8)), w[experts])
        want = np.einsum("tkc,tkrc->tkr", h[..., :3] * h[..., 3:], down[experts])
        got = b.to_numpy(b.expert_mlp(b.asarray(x2), b.asarray(w), b.asarray(down), b.asarray(experts),
                                      lambda g, u, b=b: b.binary("mul", g, u)))
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)


def test_mlx_moe_decode_kernels_at_most_mlx_lms(tmp_path):
    """One q4 MoE layer at a decode token launches no more MLX kernels than mlx-lm's OLMoE block of the same
    shape (quantized as mlx-lm converts it): argpartition for the top_k (no sort), the weights folded into
    the activation, one Sum for the combine, no arange in the step (bench/mlx_moe_layer.py counts both)."""
    import importlib.util
    from pathlib import Path

    import mlx.nn as nn
    from mlx_lm.models import olmoe

    spec = importlib.util.spec_from_file_location("bench_moe_layer", Path(__file__).parent.parent / "bench" /
                                                  "mlx_moe_layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hf = synth.make_checkpoint(tmp_path / "hf", "olmoe", generic=True, **MOE)
    out = fuselm.convert(hf, tmp_path / "q4", exporter="torch", quant="q4", quiet=True)
    ours = bench.fuselm_moe_kernels(Session(out, backend="mlx", device="cpu"), 1)
    cfg = synth.make_config("olmoe", generic=True, **MOE)
    args = olmoe.ModelArgs.from_dict({**cfg.to_dict(), "model_type": "olmoe"})
    block = olmoe.OlmoeSparseMoeBlock(args)
    nn.quantize(block, group_size=32, bits=4)
    theirs = bench.mlx_lm_moe_kernels(block, args.hidden_size, block.gate.scales.dtype, 1)
    assert ours["op"] == "QMoE" and theirs["op"] == "OlmoeSparseMoeBlock"
    top = dict(ours["top"])
    assert ours["kernels"] <= theirs["kernels"], (ours["top"], theirs["top"])
    assert top.get("ArgPartition") == 1 and "ArgSort" not in top and top.get("Sum") == 1 and "Arange" not in top
    assert top.get("GatherQMM") == 2  # gate and up as one matmul, then down


# --- gpt-oss (tests/conftest.py's gpt_oss): router and expert biases, clamped SwiGLU, attention sinks, a sliding
# window of 4 shorter than the prompts
@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
def test_gpt_oss_greedy_matches_hf(gpt_oss, backend):
    """The sparse kernel with the biases and the clamped SwiGLU, and the sinks' standard ops, on each backend: HF's
    greedy tokens from the optimized f32 graph."""
    want = hf_steps(hf_model(gpt_oss("hf")), PROMPT, 6).tokens
    sess = Session(gpt_oss("opt"), backend=backend)
    assert sum(n.op_type == "MoE" for n in sess.graph.nodes) == 2
    assert _greedy(sess, PROMPT, 6) == want
    if backend == "torch":  # the biased, clamped function body (every expert, dense) gives the same tokens
        plain = Session(gpt_oss("opt"), backend=backend, fused_kernels=False)
        assert not any(n.op_type == "MoE" for n in plain.graph.nodes)
        assert _greedy(plain, PROMPT, 6) == want


def test_gpt_oss_q4_experts_mlx_equals_torch(gpt_oss):
    """The q4 graph: experts folded into QMoE (MLX: 4-bit `mx.gather_qmm`, its sorted path for 40 tokens x top-2
    with the gate/up bias gathered in that order), the same greedy tokens on MLX, torch and numpy; and
    `fuselm validate` passes on torch and MLX (runtime tokens == onnxruntime's)."""
    _q4_tokens_agree(gpt_oss("q4"))
    for backend in ("torch", "mlx"):
        r = fuselm.validate(gpt_oss("q4"), gpt_oss("hf"), tokens=6, backend=backend, quiet=True)
        assert r["quantized"] and r["tokens"] == r["onnxruntime"], backend


@pytest.mark.parametrize("model_type", ["phimoe", "ernie4_5_moe"])
def test_moe_router_forms_validate(moe_router, model_type):
    """`fuselm validate` on the optimized graphs of PhiMoE (sparsemixer) and Ernie-4.5-MoE (a softmax router with
    a selection bias): each backend's greedy tokens equal onnxruntime's and HF's, its logits within 1e-4 of HF's."""
    hf, opt = moe_router(model_type, "hf"), moe_router(model_type, "opt")
    for backend in ("numpy", "torch", "mlx"):
        r = fuselm.validate(opt, hf, tokens=6, backend=backend, quiet=True)
        assert r["tokens"] == r["hf"] == r["onnxruntime"], backend
        assert max(r["max_logit_diff_hf"]) <= 1e-4, backend


def test_moe_unknown_scoring_is_refused():
    """A MoE node whose router scoring this runtime does not know is an error naming it and the fix, never another
    router run in its place."""
    from fuselm.runtime_metal.backends import make_backend
    from fuselm.runtime_metal.ops_moe import MoE

    from fuselm.errors import FuselmError

    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((1, 3, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    gu, dn = rng.standard_normal((4, 12, 8)).astype(np.float32), rng.standard_normal((4, 8, 6)).astype(np.float32)
    with pytest.raises(FuselmError, match="scoring 'grouped' is not one of softmax, sigmoid, sparsemixer.*convert"):
        MoE(make_backend("numpy"), x, r, gu, dn, top_k=2, scoring="grouped")
