"""`fuselm validate --backend onnxruntime` (runtime_metal/validate_ort.py) on tiny q4 models, a standard graph and
graphs lowered by `--target onnxruntime`; `--backend auto`'s rule (runtime_metal/engines/auto.py); the flags the
onnxruntime engine refuses (CLI exit 2)."""

from __future__ import annotations

import io

import pytest
from fuselm.runtime_metal.checks import INT8_KL_FACTOR
from fuselm.runtime_metal.engines import ort
from fuselm.runtime_metal.engines.auto import Facts, choose, graph_facts, resolve

import fuselm
from fuselm.cli import main
from fuselm.options import Options

ENGINES = ["ort", pytest.param("genai", marks=pytest.mark.skipif(not ort.genai_installed(),
                                                                  reason="onnxruntime-genai not installed"))]


@pytest.fixture
def loop(request, monkeypatch):
    """The onnxruntime loop a test runs: onnxruntime-genai's where the directory has its config, or IO binding."""
    if request.param == "ort":
        monkeypatch.setattr(ort, "genai_installed", lambda: False)
    return request.param


@pytest.fixture(scope="module")
def lowered(exported, tmp_path_factory):
    """lowered(level) -> the tiny untied qwen2 q4 model through `fuselm optimize --target onnxruntime` (cached)."""
    cache: dict = {}

    def get(level: int):
        if level not in cache:
            out = tmp_path_factory.mktemp(f"ortval-{level}") / "model"
            cache[level] = fuselm.optimize(exported("qwen2", "q4"), out, target="onnxruntime", accuracy_level=level,
                                           quiet=True)
        return cache[level]

    return get


PROMPT, TOKENS = [100, 200, 300, 50], 8


@pytest.mark.parametrize("loop", ENGINES, indirect=True)
def test_validate_standard_graph(optimized, make_ckpt, loop):
    """A standard q4 graph: onnxruntime fuses its DequantizeLinear -> MatMul at level 4 (int8 activations):
    held against that fusion's own drift from the graph as written."""
    r = fuselm.validate(optimized("qwen2", "q4"), make_ckpt("qwen2"), tokens=TOKENS, prompt=PROMPT,
                        backend="onnxruntime", quiet=True)
    assert r["backend"] == "onnxruntime" and r["quantized"] and not r["lowered"] and r["activations"] == "int8"
    assert r["int8"]["kl"] <= INT8_KL_FACTOR * r["int8"]["ort_level4_kl"] + 1e-6
    assert len(r["hf"]) == len(r["standard"]) == TOKENS


@pytest.mark.parametrize("loop", ENGINES, indirect=True)
def test_validate_lowered_graph_f32_activations(lowered, make_ckpt, loop):
    """Level 1 (f32 activations): the tokens equal the standard graph's, which validate derives from the
    lowered one (`fuselm optimize` without --target maps the contrib ops back)."""
    r = fuselm.validate(lowered(1), make_ckpt("qwen2"), tokens=TOKENS, prompt=PROMPT, backend="onnxruntime",
                        quiet=True)
    assert r["lowered"] and r["activations"] == "f32" and r["tokens"] == r["standard"]
    assert max(r["max_logit_diff_standard"]) < 1e-3


def test_validate_lowered_graph_int8_by_auto_against_the_given_standard(lowered, optimized, make_ckpt):
    """Level 4, `--backend auto` (a lowered graph runs on onnxruntime), the standard graph passed in."""
    r = fuselm.validate(lowered(4), make_ckpt("qwen2"), tokens=TOKENS, prompt=PROMPT,
                        standard=optimized("qwen2", "q4"), quiet=True)
    assert r["lowered"] and r["activations"] == "int8" and "lowered for onnxruntime" in r["describe"]
    assert r["int8"]["kl"] <= INT8_KL_FACTOR * r["int8"]["ort_level4_kl"] + 1e-6


def test_validate_float_graph_equals_hf(optimized, make_ckpt):
    r = fuselm.validate(optimized("qwen2", "f32"), make_ckpt("qwen2"), tokens=4, prompt=PROMPT,
                        backend="onnxruntime", quiet=True)
    assert not r["quantized"] and r["tokens"] == r["hf"] and max(r["max_logit_diff_hf"]) < 1e-3


def test_validate_cli_and_bad_combinations(optimized, lowered, make_ckpt, capsys):
    model, ref = str(optimized("qwen2", "q4")), str(make_ckpt("qwen2"))
    assert main(["validate", model, "--reference", ref, "--backend", "onnxruntime", "--tokens", "3",
                 "--prompt-ids", "5,17,33"]) == 0
    assert "onnxruntime" in capsys.readouterr().out
    assert main(["validate", model, "--reference", ref, "--backend", "onnxruntime", "--kv-bits", "8"]) == 2
    assert "--backend onnxruntime does not take --kv-bits" in capsys.readouterr().err
    assert main(["validate", model, "--reference", ref, "--backend", "torch", "--standard", model]) == 2
    assert "drop --standard" in capsys.readouterr().err
    assert main(["validate", str(lowered(4)), "--reference", ref, "--backend", "torch"]) == 2
    assert "--backend onnxruntime" in capsys.readouterr().err
    assert main(["run", model, "--prompt-ids", "5", "--backend", "onnxruntime", "--device", "cuda"]) == 2
    assert "does not take --device" in capsys.readouterr().err


# --- --backend auto -------------------------------------------------------------------------------
@pytest.mark.parametrize("facts,backend,why", [
    (Facts(gpu=None, lowered=True, weight_bits=frozenset({4, 8})), "onnxruntime", "lowered"),
    (Facts(gpu="cuda", lowered=True, weight_bits=frozenset()), "onnxruntime", "lowered"),
    (Facts(gpu="cuda", lowered=False, weight_bits=frozenset({4})), "auto", "cuda GPU"),
    (Facts(gpu="metal", lowered=False, weight_bits=frozenset({4})), "auto", "metal GPU"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset()), "auto", "f32 reference"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset({4, 8})), "auto", "--target onnxruntime"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset({4, 8}), lowerable=True), "onnxruntime-lowered", "4.3x"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset(), lowerable=True), "auto", "f32 reference"),
    (Facts(gpu="metal", lowered=False, weight_bits=frozenset({4}), lowerable=True), "auto", "metal GPU"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset({4}), flags=("--compile",), lowerable=True), "auto",
     "--compile"),
    (Facts(gpu=None, lowered=False, weight_bits=frozenset({4}), flags=("--kv-bits",)), "auto", "--kv-bits"),
])
def test_auto_rule(facts, backend, why):
    got, reason = choose(facts)
    assert got == backend and why in reason, reason


def test_auto_reads_the_graph_and_says_why(optimized, lowered, monkeypatch):
    monkeypatch.setattr("fuselm.runtime_metal.engines.auto.gpu", lambda: None)
    assert graph_facts(lowered(4)) == (True, frozenset())
    assert graph_facts(optimized("qwen2", "q4"))[0] is False and graph_facts(optimized("qwen2", "q4"))[1] >= {4}
    assert graph_facts(optimized("qwen2", "f32")) == (False, frozenset())
    assert resolve(optimized("qwen2", "q4"), Options(backend="torch"))[:2] == ("torch", None)
    assert resolve(optimized("qwen2", "q4"), Options(device="cuda:1"))[:2] == ("auto", None)
    r = fuselm.run(lowered(4), prompt=[5, 17], max_tokens=2, ignore_eos=True, quiet=True, stream=io.StringIO())
    assert r["backend"].startswith("onnxruntime") and "lowered for onnxruntime" in r["why"]
    r = fuselm.run(optimized("qwen2", "f32"), prompt=[5], max_tokens=1, quiet=True, stream=io.StringIO())
    assert r["backend"] == "torch" and "f32 reference" in r["why"]


def test_onnxruntime_backend_without_genai(lowered, monkeypatch):
    """Without onnxruntime-genai the onnxruntime backend runs plain onnxruntime with IO binding."""
    monkeypatch.setattr(ort, "genai_installed", lambda: False)
    r = fuselm.run(lowered(4), prompt=[5, 17], max_tokens=3, ignore_eos=True, quiet=True, stream=io.StringIO())
    assert r["backend"] == "onnxruntime" and "IO binding" in r["what"]
    with pytest.raises(fuselm.FuselmError, match="needs onnxruntime-genai"):
        ort.OrtEngine(lowered(4), lowered(4), Options(), loop="genai")
