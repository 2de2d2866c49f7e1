"""The traced exporter (`fuselm convert --exporter torch`, exporter/traced/): breadth, equivalence, refusals.

References: HF transformers (f32 prefill + decode step with past, exporter/check.py), onnxruntime
on the same graph (q4 tokens, `fuselm validate`), the builder's optimized graph (structure and
logits), HF's own apply_rotary_pos_emb (the rope op, trap shapes).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from fuselm.exporter.check import check
from fuselm.exporter.traced import rope_op
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import fuselm
from fuselm import cli
from fuselm.modeldir import read_meta
from fuselm.reference import OrtRunner
from fuselm.synth import make_config

# Traps per family (fuselm/synth.py TINY): gemma3_text (sliding + global layers, per-layer-type rope,
# one kv head, soft-capping), phi3 (fused projections, partial rotary), olmo2 (post-norms, full-width
# q/k norms), smollm3 (a no-rope layer, yarn), granite (multipliers), glm4 (interleaved, partial rope);
# qwen3 / llama: builder families.
TRACED = ["gemma3_text", "phi3", "olmo2", "smollm3", "granite", "glm4", "qwen3", "llama"]


@pytest.fixture(scope="module")
def traced(make_ckpt, tmp_path_factory):
    """traced(family, quant) -> a model dir from `--exporter torch` (cached)."""
    cache = {}

    def get(family, quant="f32"):
        if (family, quant) not in cache:
            out = tmp_path_factory.mktemp(f"traced-{family}-{quant}") / "model"
            cache[family, quant] = fuselm.convert(make_ckpt(family), out, quant=quant, exporter="torch", quiet=True)
        return cache[family, quant]

    return get


def _rotary_modules(hf_dir):
    """{layer index: (inv_freq, attention_scaling)} the HF model uses, from its own rotary module."""
    from fuselm.reference import hf_model

    model = hf_model(hf_dir)
    config = model.config
    rotary = model.model.rotary_emb
    out = {}
    for i in range(config.num_hidden_layers):
        if getattr(config, "no_rope_layers", None) and not config.no_rope_layers[i]:
            continue
        layer_type = (getattr(config, "layer_types", None) or [None] * (i + 1))[i]
        prefix = f"{layer_type}_" if hasattr(rotary, f"{layer_type}_inv_freq") else ""
        out[i] = (getattr(rotary, f"{prefix}inv_freq").numpy(), getattr(rotary, f"{prefix}attention_scaling"))
    return model, out


@pytest.mark.parametrize("family", TRACED)
def test_traced_matches_hf_and_validates(family, make_ckpt, traced):
    """f32 vs HF (prefill + decode with past) <= 1e-4; FusedRoPE carries HF's inv_freq per layer;
    q4 runs in the runtime (torch) with onnxruntime's greedy tokens."""
    hf = make_ckpt(family)
    model_dir = traced(family)
    meta = json.loads((model_dir / "fuselm.json").read_text())
    assert meta["exporter"]["kind"] == "torch" and meta["model_type"] == family
    result = check(model_dir, hf, quiet=True)
    assert result["max_abs_logit_diff"] <= 1e-4, result
    graph = onnx.load(model_dir / "model.onnx", load_external_data=False).graph
    _, rotary = _rotary_modules(hf)
    for i in range(meta["dims"]["layers"]):
        ropes = [n for n in graph.node if n.op_type == "FusedRoPE" and n.name.startswith(f"/model/layers.{i}/")]
        if i not in rotary:
            assert not ropes, f"layer {i} has no rope in HF"
            continue
        assert len(ropes) == 2, f"layer {i}: q and k rope"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ropes[0].attribute}
        np.testing.assert_array_equal(np.array(attrs["inv_freq"], np.float32), rotary[i][0])
        assert attrs["attention_scaling"] == pytest.approx(rotary[i][1], rel=1e-6)
    assert sum(n.op_type == "Attention" for n in graph.node) == meta["dims"]["layers"]
    r = fuselm.validate(traced(family, "q4"), hf, tokens=6, backend="torch", quiet=True)
    assert r["quantized"] and r["tokens"] == r["onnxruntime"]


@pytest.mark.parametrize("family", ["gemma3_text", "smollm3"])
def test_traced_runs_on_mlx(family, make_ckpt, traced):
    pytest.importorskip("mlx.core")
    r = fuselm.validate(traced(family), make_ckpt(family), tokens=6, backend="mlx", quiet=True)
    assert r["tokens"] == r["hf"]


def test_run_cli_on_traced(traced, capsys):
    assert cli.main(["run", str(traced("gemma3_text")), "--prompt", "hello world", "--max-tokens", "4",
                     "--backend", "torch", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()


def test_convert_prints_only_its_own_lines(make_ckpt, tmp_path, capfd, caplog, monkeypatch):
    """A traced convert's stderr holds fuselm's lines only: torch.onnx's registry, built once per process (here
    again), logs a warning per torchvision op when torchvision is not installed; none of them is ours."""
    from fuselm.exporter.traced import trace

    monkeypatch.setattr(trace, "_REGISTRIES", {})
    assert cli.main(["convert", str(make_ckpt("llama")), "-o", str(tmp_path / "m"), "--exporter", "torch"]) == 0
    err = capfd.readouterr().err + "".join(r.getMessage() for r in caplog.records)
    assert "torchvision" not in err and "Traceback" not in err, err


def test_traced_qwen3_optimizes_like_the_builder(traced, optimized, tmp_path):
    """After `fuselm optimize`, a traced Qwen3 layer has the builder's fused ops; logits within 1e-5."""
    ours = fuselm.optimize(traced("qwen3"), tmp_path / "opt", quiet=True)
    theirs = optimized("qwen3")
    fused = ("MatMul", "RMSNormalization", "Attention", "FusedRoPE", "Split", "Sigmoid")

    def layer_ops(d, i):
        g = onnx.load(d / "model.onnx", load_external_data=False).graph
        return sorted(n.op_type for n in g.node if n.name.startswith(f"/model/layers.{i}/") and n.op_type in fused)

    for i in range(2):
        assert layer_ops(ours, i) == layer_ops(theirs, i)
        assert layer_ops(ours, i).count("MatMul") == 4  # qkv, o, gate_up, down
    a, b = OrtRunner(ours), OrtRunner(theirs)
    ids = np.random.default_rng(3).integers(0, read_meta(ours)["dims"]["vocab"], size=(1, 7))
    la, pa = a.forward(ids, np.ones((1, 7)), np.arange(7)[None])
    lb, pb = b.forward(ids, np.ones((1, 7)), np.arange(7)[None])
    assert np.abs(la - lb).max() <= 1e-5
    sa, _ = a.forward(ids[:, :1], np.ones((1, 8)), np.array([[7]]), pa)
    sb, _ = b.forward(ids[:, :1], np.ones((1, 8)), np.array([[7]]), pb)
    assert np.abs(sa - sb).max() <= 1e-5


def test_auto_picks_builder_or_traced(make_ckpt, tmp_path, capsys):
    assert cli.main(["convert", str(make_ckpt("granite")), "-o", str(tmp_path / "g")]) == 0
    assert "torch exporter" in capsys.readouterr().out
    assert json.loads((tmp_path / "g" / "fuselm.json").read_text())["exporter"]["kind"] == "torch"
    assert cli.main(["convert", str(make_ckpt("qwen2")), "-o", str(tmp_path / "q"), "--quiet"]) == 0
    assert json.loads((tmp_path / "q" / "fuselm.json").read_text())["exporter"]["kind"] == "builder"


# --- the rope op: HF's apply_rotary_pos_emb on the shapes where a wrong unsqueeze errors or is wrong

# (batch, seq, heads, head_dim): head_dim != hidden/heads, one (kv) head, S == H
TRAP_SHAPES = [(2, 5, 3, 32), (1, 4, 1, 16), (2, 4, 4, 8)]


def _wrong_unsqueeze(x, pos, inv):  # cos [B,S,D] -> [B,S,D,1]... : the trap, for contrast
    freqs = pos[..., None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * emb.cos().unsqueeze(1) + rot * emb.sin().unsqueeze(1)


@pytest.mark.parametrize("shape", TRAP_SHAPES)
def test_rope_op_equals_hf_on_trap_shapes(shape):
    b, s, h, d = shape
    config = make_config("llama", hidden_size=16 * h, head_dim=d, num_attention_heads=h, num_key_value_heads=h)
    x = torch.randn(b, s, h, d, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(s)[None] + 7 * torch.arange(b)[:, None]
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(x, pos)
    want, _ = apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    inv = rotary.inv_freq
    got = torch.ops.fuselm_trace.rope(x, pos, inv.tolist(), float(rotary.attention_scaling), 0)
    torch.testing.assert_close(got, want.transpose(1, 2), atol=2e-6, rtol=0)
    try:  # the wrong broadcast fails on these shapes: raises, or gives other numbers
        wrong = _wrong_unsqueeze(x, pos, inv)
        assert wrong.shape != got.shape or not torch.allclose(wrong, got, atol=1e-3)
    except RuntimeError:
        pass


@pytest.mark.parametrize("interleaved,rotary_dim", [(0, 8), (1, 16), (1, 8)])
def test_rope_op_equals_the_onnx_function(interleaved, rotary_dim):
    """The torch op (what is traced) and FusedRoPE's FunctionProto (what runtimes inline) agree."""
    from onnx import TensorProto
    from onnx import helper as oh

    from fuselm import contract
    from fuselm.reference import ort_session

    inv = (1.0 / 100 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    node = contract.fused_rope_node("x", "pos", "y", "rope", inv, 1.3, interleaved)
    graph = oh.make_graph([node], "r", [oh.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 16]),
                                        oh.make_tensor_value_info("pos", TensorProto.INT64, [1, 3])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 2, 16])])
    model = oh.make_model(graph, ir_version=11, functions=contract.functions_for([node]),
                          opset_imports=[oh.make_opsetid("", contract.OPSET),
                                         oh.make_opsetid(contract.DOMAIN, contract.DOMAIN_VERSION)])
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 2, 16)).astype(np.float32)
    pos = np.array([[0, 4, 11]])
    got = ort_session(model).run(None, {"x": x, "pos": pos})[0]
    want = rope_op.reference(torch.tensor(x), torch.tensor(pos), torch.tensor(inv), 1.3, interleaved)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-6)


# --- refusals: exit 2, the thing named, nothing at OUT

def _fails(hf, tmp_path, capsys) -> str:
    out = tmp_path / "out"
    code = cli.main(["convert", str(hf), "-o", str(out), "--quiet", "--exporter", "torch"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fuselm-tmp")]
    return err


def _config_only(tmp_path, model_type, **kwargs):
    from transformers import AutoConfig

    hf = tmp_path / "hf"
    AutoConfig.for_model(model_type, **kwargs).save_pretrained(hf)
    return hf


@pytest.mark.parametrize("model_type,kwargs,message", [
    ("rwkv", dict(num_hidden_layers=2, hidden_size=64, vocab_size=128), "RWKV (recurrent) layers"),
    ("gemma3", {}, "vision tower"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope type 'dynamic' is not supported by the traced exporter"),
    ("openai-gpt", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128), "keeps no key/value cache"),
])
def test_refused_architectures(model_type, kwargs, message, tmp_path, capsys):
    hf = _config_only(tmp_path, model_type, **kwargs)  # no weights: the architecture is refused first
    assert message in _fails(hf, tmp_path, capsys)


def test_remote_code_and_unknown_model_type(make_ckpt, tmp_path, capsys):
    hf = shutil.copytree(make_ckpt("phi3"), tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "x.Model"}}))
    assert "never runs a checkpoint's own code" in _fails(hf, tmp_path, capsys)
    (hf / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model"}))
    assert "'no_such_model' is not known to the installed transformers" in _fails(hf, tmp_path, capsys)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.self_attn.qkv_proj.weight"), "model.layers.1.self_attn.qkv_proj.weight: missing"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}),
     "model.layers.0.mlp.extra.weight: not a tensor of this architecture"),
    (lambda t: t.update({"model.layers.0.mlp.gate_up_proj.weight": t["model.layers.0.mlp.gate_up_proj.weight"][:-2]}),
     "model.layers.0.mlp.gate_up_proj.weight: shape [254, 64], expected [256, 64]"),
])
def test_tensors_not_matching_the_model(edit, message, make_ckpt, tmp_path, capsys):
    hf = shutil.copytree(make_ckpt("phi3"), tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, hf / "model.safetensors", metadata={"format": "pt"})
    assert message in _fails(hf, tmp_path, capsys)


def test_diff_on_traced_gemma3_skips_with_reasons(traced, tmp_path):
    """Gemma 3's GELU MLP: FuseGateUp is skipped with its reason; its (1 + w) RMSNorms still fuse
    (4 per layer, q/k norms, the final norm: 13); every stage checked equal by diff itself."""
    fuselm.diff(traced("gemma3_text"), json_path=tmp_path / "d.json")
    passes = {p["pass"]: p for p in json.loads((tmp_path / "d.json").read_text())["passes"]}
    gate_up = passes["FuseGateUp"]
    assert gate_up["fired"] == 0 and gate_up["skipped"]
    assert all("SiLU" in s["reason"] for s in gate_up["skipped"])
    assert passes["FuseRMSNorm"]["fired"] == 13


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "mistral"])
def test_builder_and_traced_give_the_same_logits(family, make_ckpt, exported, traced):
    """The two exporters of the shared families agree in onnxruntime (f32): a 7-token prefill with a
    padded row, then two decode steps with the presents fed back. Both also match HF (exporter/check.py)."""
    meta_a, meta_b = read_meta(exported(family)), read_meta(traced(family))
    assert meta_a["exporter"]["kind"] == "builder" and meta_b["exporter"]["kind"] == "torch"
    assert meta_a["rope"]["rotary_dim"] == meta_b["rope"]["rotary_dim"]
    builder, torch_dir = OrtRunner(exported(family)), OrtRunner(traced(family))
    rng = np.random.default_rng(11)
    ids = rng.integers(0, meta_a["dims"]["vocab"], size=(2, 7))
    mask = np.ones((2, 7), np.int64)
    mask[1, :2] = 0  # left padding: positions start at 0 after the pad
    pos = np.stack([np.arange(7), np.maximum(np.arange(7) - 2, 0)])
    (la, pa), (lb, pb) = builder.forward(ids, mask, pos), torch_dir.forward(ids, mask, pos)
    np.testing.assert_allclose(la[0], lb[0], atol=1e-5, rtol=1e-6)
    np.testing.assert_allclose(la[1, 2:], lb[1, 2:], atol=1e-5, rtol=1e-6)
    for step in range(2):
        nxt = la[:, -1:].argmax(-1)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        pos = pos[:, -1:] + 1
        (la, pa), (lb, pb) = builder.forward(nxt, mask, pos, pa), torch_dir.forward(nxt, mask, pos, pb)
        np.testing.assert_allclose(la, lb, atol=1e-5, rtol=1e-6, err_msg=f"decode step {step}")
        for a, b in zip(pa, pb, strict=True):  # a pad's own k/v above layer 0 is never read: its query sees no key
            np.testing.assert_allclose(a[0], b[0], atol=1e-5, rtol=0)
            np.testing.assert_allclose(a[1, :, 2:], b[1, :, 2:], atol=1e-5, rtol=0)
