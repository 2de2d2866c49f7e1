"""Recurrent-state hybrids through the traced exporter: Gated DeltaNet (Qwen3.5), Mamba-2 (Granite 4), with their
state carried as past_state / present_state beside the KV cache.

Tiny random checkpoints transformers itself builds (fuselm.synth.TINY), converted, checked against HF transformers
(f32, a prefill and a decode step that feeds the state back: exporter/check.py) before and after `fuselm optimize`;
the state ops' function bodies against their torch references; a prompt run in pieces against one run whole; the
graph cut into pipeline stages and lowered for onnxruntime. The other families run in scripts/traced_sweep.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from fuselm.exporter.check import check
from fuselm.exporter.traced import state_ops
from fuselm.passes.split import split
from onnx import TensorProto
from onnx import helper as oh

import fuselm
from fuselm import contract, synth
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner, ort_session

FAMILIES = {"qwen3_5_text": ("gated_delta_net", contract.GDN_OP), "granitemoehybrid": ("mamba2", contract.MAMBA2_OP)}


def _run_op(op: str, feeds: dict, **attrs) -> list[np.ndarray]:
    """One fuselm state op in onnxruntime, through its model-local function body."""
    names = list(contract.STATE_OPS[op])
    node = contract.state_op_node(op, names, ["Y", "present_state"], "op", **attrs)
    ranks = {"Y": feeds[names[0]].dim(), "present_state": feeds["past_state"].dim()}
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info(n, TensorProto.FLOAT, list(feeds[n].shape)) for n in names],
                          [oh.make_tensor_value_info(n, TensorProto.FLOAT, [f"{n}{i}" for i in range(r)]) for n, r in ranks.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", contract.OPSET),
                                                oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION)],
                          ir_version=11, functions=contract.functions_for([node]))
    onnx.checker.check_model(model, full_check=True)
    return ort_session(model).run(None, {n: feeds[n].numpy() for n in names})


def state_op_cases():
    """Random inputs per op: grouped heads (2 key heads / B,C groups serving 4 heads), a state from earlier tokens."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return {
        contract.CONV_OP: (dict(X=r(2, 5, 6), past_state=r(2, 3, 6), weight=r(6, 1, 4)), {},
                           lambda f: state_ops.causal_conv1d_reference(f["X"], f["past_state"], f["weight"])),
        contract.GDN_OP: (dict(query=r(2, 5, 2, 8, scale=0.3), key=r(2, 5, 2, 8, scale=0.3), value=r(2, 5, 4, 6),
                               decay=-r(2, 5, 4).abs(), beta=r(2, 5, 4).sigmoid(), past_state=r(2, 4, 6, 8)), {},
                          lambda f: state_ops.gated_delta_reference(*f.values())),
        "KimiDelta": (dict(query=r(2, 5, 4, 8, scale=0.3), key=r(2, 5, 4, 8, scale=0.3), value=r(2, 5, 4, 6),
                           decay=-r(2, 5, 4, 8).abs(), beta=r(2, 5, 4).sigmoid(), past_state=r(2, 4, 6, 8)), {},
                      lambda f: state_ops.gated_delta_reference(*f.values())),  # GatedDeltaNet, a decay per key channel
        contract.MAMBA2_OP: (dict(X=r(2, 5, 4, 3), dt=r(2, 5, 4), A_log=r(4, scale=0.5), B=r(2, 5, 2, 7), C=r(2, 5, 2, 7),
                                  D=r(4), dt_bias=r(4), past_state=r(2, 4, 3, 7)), dict(dt_min=0.0, dt_max=0.8),
                             lambda f: state_ops.mamba2_reference(*f.values(), 0.0, 0.8)),
        contract.MAMBA_OP: (dict(X=r(2, 5, 6), dt=r(2, 5, 6), A_log=r(6, 4, scale=0.5), B=r(2, 5, 4), C=r(2, 5, 4), D=r(6),
                                 dt_bias=r(6), past_state=r(2, 6, 4)), {},
                            lambda f: state_ops.mamba_reference(*f.values())),
    }


def op_of(case: str) -> str:
    return contract.GDN_OP if case == "KimiDelta" else case


CASES = [contract.CONV_OP, contract.GDN_OP, "KimiDelta", contract.MAMBA2_OP, contract.MAMBA_OP]


@pytest.mark.parametrize("case", CASES)
def test_state_op_bodies_equal_their_references(case):
    feeds, attrs, reference = state_op_cases()[case]
    got = _run_op(op_of(case), feeds, **attrs)
    for g, w in zip(got, reference(feeds), strict=True):
        np.testing.assert_allclose(g, w.numpy(), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_hybrid_matches_hf_exported_and_optimized(hybrid, model_type):
    hf, out, opt = hybrid(model_type, "hf"), hybrid(model_type, "f32"), hybrid(model_type, "opt")
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4  # prefill + a decode step feeding the state back
    assert check(opt, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    kind, op = FAMILIES[model_type]
    assert read_meta(out)["layer_types"] == [kind, "full_attention"]
    model = onnx.load(opt / contract.MODEL_NAME, load_external_data=False)
    inputs = {i.name: contract.dims(i) for i in model.graph.input}
    outputs = {o.name: contract.dims(o) for o in model.graph.output}
    for kind_ in contract.STATE_KINDS:  # fixed size, no growing axis, its present of the same shape
        past = inputs[contract.state_name(0, kind_)]
        assert past[0] == "batch_size" and all(isinstance(d, int) for d in past[1:])
        assert outputs[contract.state_name(0, kind_, contract.STATE_PRESENT)] == past
    assert contract.past_name(1, "key") in inputs and contract.past_name(0, "key") not in inputs
    ops = {n.op_type for n in model.graph.node if n.domain == contract.DOMAIN}
    assert {contract.CONV_OP, op} <= ops and {f.name for f in model.functions} >= {contract.CONV_OP, op}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_prompt_in_pieces_carries_the_state(hybrid, model_type):
    runner = OrtRunner(hybrid(model_type, "opt"))
    ids = np.random.default_rng(1).integers(0, 300, size=(1, 11))
    whole, _ = runner.forward(ids)
    runner.reset()
    pieces = [runner.step(ids[:, a:b]) for a, b in ((0, 4), (4, 5), (5, 11))]
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=2e-5, rtol=1e-5)


def test_q4_converts_and_runs(hybrid):
    runner = OrtRunner(hybrid("granitemoehybrid", "q4"))
    trace = runner.greedy([5, 17, 3, 42, 8], 4)
    assert len(trace.tokens) == 4 and all(np.isfinite(x).all() for x in trace.logits)
    assert read_meta(hybrid("granitemoehybrid", "q4"))["quantization"]["mode"] == "q4"


def test_split_stages_carry_their_states(hybrid, tmp_path):
    src = hybrid("qwen3_5_text", "opt")
    split(src, tmp_path / "s", stages=2, quiet=True)
    stages = [tmp_path / "s" / f"stage{k}" for k in range(2)]
    names = [{i.name for i in ort_session(d).get_inputs()} for d in stages]
    assert contract.state_name(0, "recurrent") in names[0] and contract.past_name(1, "key") in names[1]
    ref = OrtRunner(src)
    ids = np.array([[5, 17, 3, 42, 8, 1]], np.int64)
    want, present = ref.forward(ids)
    past = dict(zip([i.name for i in ref._pasts], present, strict=True))
    nxt = np.array([[int(want[0, -1].argmax())]], np.int64)
    want_step, _ = ref.forward(nxt, past=present)
    for step_ids, feed_past, expect in ((ids, None, want), (nxt, past, want_step)):
        hidden, done = None, 0 if feed_past is None else ids.shape[1]
        for d in stages:
            sess = ort_session(d)
            feeds = {contract.ATTENTION_MASK: np.ones((1, done + step_ids.shape[1]), np.int64),
                     contract.POSITION_IDS: np.arange(done, done + step_ids.shape[1])[None]}
            for i in sess.get_inputs():
                if i.name in (contract.INPUT_IDS, contract.HIDDEN):
                    feeds[i.name] = step_ids if i.name == contract.INPUT_IDS else hidden
                elif contract.is_step_past(i.name):
                    feeds[i.name] = feed_past[i.name] if feed_past else contract.empty_past([_vi(i)])[i.name]
            out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
            hidden = out.get(contract.NEXT_HIDDEN)
        np.testing.assert_array_equal(out[contract.LOGITS], expect)


def _vi(arg) -> onnx.ValueInfoProto:
    """An onnxruntime NodeArg as the ValueInfoProto contract.empty_past reads."""
    return oh.make_tensor_value_info(arg.name, TensorProto.FLOAT, arg.shape)


def test_lowered_for_onnxruntime_keeps_the_state_ops(hybrid, tmp_path):
    hf = hybrid("qwen3_5_text", "hf")
    low = fuselm.optimize(hybrid("qwen3_5_text", "f32"), tmp_path / "ort", target="onnxruntime", quiet=True)
    model = onnx.load(low / contract.MODEL_NAME, load_external_data=False)
    assert any(n.domain == "com.microsoft" for n in model.graph.node)
    assert {contract.CONV_OP, contract.GDN_OP} <= {n.op_type for n in model.graph.node if n.domain == contract.DOMAIN}
    assert check(low, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4


def test_minimax_lightning_attention_converts_as_hf(tmp_path):
    """MiniMax: lightning attention (a state decaying by exp(-slope) per head and token) as fuselm::Mamba2 with
    dt = 1, beside attention and MoE layers: the graph equals HF (prefill, then a decode step from the state);
    a swapped forward that computes something else is refused by the check on the family's own code."""
    from transformers.models.minimax import modeling_minimax

    from fuselm.errors import FuselmError

    hf = synth.make_checkpoint(tmp_path / "hf", "minimax", generic=True, num_local_experts=4, num_experts_per_tok=2,
                               intermediate_size=64)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    assert "mamba2" in read_meta(out)["layer_types"]
    right = state_ops._lightning_forward
    try:
        state_ops._lightning_forward = lambda self, *a, **k: (right(self, *a, **k)[0] * 1.01, None)
        with pytest.raises(FuselmError, match="lightning attention"):
            state_ops.verify(modeling_minimax, "minimax", synth.make_config("minimax", generic=True))
    finally:
        state_ops._lightning_forward = right


def _runtime_equals_onnxruntime(model_dir, prompt: list[int], steps: int = 3) -> None:
    """The runtime's logits, a prefill then decode steps, equal onnxruntime's on every backend."""
    from fuselm.runtime_metal.session import Session

    want = OrtRunner(model_dir).greedy(prompt, steps)
    for backend in ("torch", "numpy", "mlx"):
        sess = Session(model_dir, backend=backend)
        sess.reset(len(prompt) + steps + 3)
        logits = sess.prefill(prompt)
        for token, expect in zip(want.tokens, want.logits, strict=True):
            np.testing.assert_allclose(sess.logits_to_numpy(logits).ravel(), np.asarray(expect).ravel(), atol=2e-4,
                                       rtol=1e-5, err_msg=backend)
            logits = sess.decode(token)


# families whose recurrent blocks state_ops.py writes around fuselm's ops: their tiny config, the layer type their
# recurrent layer gets, and the tracing function (state_ops) whose error the check on the family's own code catches
REWRITTEN = {
    # a Mamba-1 scan per head (mamba_selective_scan, each head its own B and C): a fuselm::Mamba per head on its rows
    # of the layer's state, beside a shared attention block
    "zamba": ({}, "mamba", "_selective_scan", "mamba_selective_scan"),
    # Griffin's RG-LRU (h = a·h + u per channel) as fuselm::Mamba2 with a head per channel, its convolution as
    # fuselm::CausalConv1D (transformers keeps both states in the modules), beside sliding-window attention
    "recurrent_gemma": ({"block_types": ["recurrent", "attention"], "attention_window_size": 8}, "mamba2", "_rnn_scan",
                        "recurrent block"),
}


@pytest.mark.parametrize("model_type", REWRITTEN)
def test_rewritten_recurrences_convert_as_hf(model_type, tmp_path):
    """The graph equals HF (prefill, then a decode step from the states), the runtime's logits equal onnxruntime's on
    every backend at every step; a tracing function that computes something else is refused by the check on the
    family's own code."""
    import importlib

    from fuselm.errors import FuselmError

    overrides, layer_type, function, what = REWRITTEN[model_type]
    hf = synth.make_checkpoint(tmp_path / "hf", model_type, generic=bool(overrides), **overrides)
    out = fuselm.optimize(fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True), tmp_path / "opt", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    assert read_meta(out)["layer_types"][0] == layer_type
    # traced constants are named by their layer kind's number in stamping order: the same file every run
    model = onnx.load(tmp_path / "out" / contract.MODEL_NAME, load_external_data=False)
    kinds = {i.name.split("/")[3] for i in model.graph.initializer if i.name.startswith("/model/traced/layer_kind_")}
    assert kinds <= {"layer_kind_0", "layer_kind_1"}, kinds
    _runtime_equals_onnxruntime(out, [5, 17, 3, 42, 8, 1, 99, 7, 12, 30])
    right = getattr(state_ops, function)
    try:
        setattr(state_ops, function, lambda *a, **k: tuple(x * 1.01 for x in right(*a, **k)))
        with pytest.raises(FuselmError, match=what):
            state_ops.verify(importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}"),
                             model_type, synth.make_config(model_type, generic=bool(overrides), **overrides))
    finally:
        setattr(state_ops, function, right)


def test_layers_with_several_convolutions_and_relative_positions(tmp_path):
    """Inkling: four causal convolutions a layer (on keys, values, the attention's and the MLP's outputs) share its
    conv state, their channels side by side; its attention adds a bias from each query's distance to each key
    (relative positions up to 12, a window of 8 on the sliding layer), its shared experts run on every token. The graph
    equals HF (prefill, then a decode step from the states); the runtime's logits equal onnxruntime's on every
    backend."""
    overrides = dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=8, rel_extent=12,
                     swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, n_routed_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64,
                     logits_mup_width_multiplier=1.0)
    hf = synth.make_checkpoint(tmp_path / "hf", "inkling_text", generic=True, **overrides)
    out = fuselm.convert(hf, tmp_path / "out", exporter="torch", quiet=True)
    assert check(out, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    model = onnx.load(out / contract.MODEL_NAME, load_external_data=False)
    conv = {i.name: contract.dims(i) for i in model.graph.input if contract.is_state_past(i.name)}
    # keys and values of each layer's kv heads, then the attention's and the MLP's outputs (hidden 64), kernel 4
    assert conv == {contract.state_name(0, "conv"): ["batch_size", 3, 2 * 2 * 16 + 2 * 64],
                    contract.state_name(1, "conv"): ["batch_size", 3, 2 * 2 * 16 + 2 * 64]}
    assert sum(n.op_type == contract.CONV_OP for n in model.graph.node) == 8
    _runtime_equals_onnxruntime(out, [5, 17, 3, 42, 8, 1, 99, 7, 12, 30, 2, 9, 14, 21])
