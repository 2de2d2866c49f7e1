"""The traced exporter on decoders without rotary layers: GPT-2's learned position table (gathered by the graph's
position_ids before the first layer) and BLOOM's ALiBi (a [B·H, 1, T] bias the model computes from the graph's
attention_mask and hands every layer). Checked against HF transformers (f32, prefill + a decode step with past,
exporter/check.py) exported and optimized, and run by runtime_metal's torch backend (`fuselm validate`)."""

from __future__ import annotations

import json

import onnx
import pytest
from fuselm.exporter.check import check

import fuselm
from fuselm import synth

SIZES = {"gpt2": dict(n_layer=2, n_embd=64, n_head=4), "bloom": dict(n_layer=2, hidden_size=64, n_head=4)}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """model_type -> (HF checkpoint, exported dir, optimized dir)."""
    out = {}
    for model_type, sizes in SIZES.items():
        work = tmp_path_factory.mktemp(model_type)
        hf = synth.make_checkpoint(work / "hf", model_type, generic=True, **sizes)
        exported = fuselm.convert(hf, work / "out", exporter="torch", quiet=True)
        out[model_type] = (hf, exported, fuselm.optimize(exported, work / "opt", quiet=True))
    return out


@pytest.mark.parametrize("model_type", SIZES)
def test_matches_hf_exported_and_optimized(model_type, converted):
    hf, exported, optimized = converted[model_type]
    assert check(exported, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    assert check(optimized, hf, quiet=True)["max_abs_logit_diff"] <= 1e-4
    graph = onnx.load(exported / "model.onnx", load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type == "FusedRoPE"]
    meta = json.loads((exported / "fuselm.json").read_text())
    assert meta["rope"]["layers_without_rope"] == [0, 1]
    if model_type == "gpt2":  # the position table, gathered at the graph's position_ids
        assert meta["positions"] == "learned: transformer.wpe"
        gathers = [n for n in graph.node if n.op_type == "Gather" and "transformer.wpe.weight" in n.input[0]]
        assert gathers and "position_ids" in _ancestors(graph, gathers[0].input[1])
    else:  # the ALiBi bias: one side input of every layer, computed from the graph's attention_mask
        assert meta["positions"] == "alibi" and meta["traced"]["side_inputs"] == ["alibi"]


def test_runtime_runs_them(converted):
    """runtime_metal's torch backend: greedy tokens and logits equal HF transformers'."""
    for model_type in SIZES:
        hf, _, optimized = converted[model_type]
        r = fuselm.validate(optimized, hf, tokens=6, backend="torch", quiet=True)
        assert r["tokens"] == r["hf"] and max(r["max_logit_diff_hf"]) < 1e-3, model_type


def _ancestors(graph: onnx.GraphProto, value: str) -> set[str]:
    producer = {o: n for n in graph.node for o in n.output}
    seen, todo = set(), [value]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in producer:
            todo.extend(producer[v].input)
    return seen
