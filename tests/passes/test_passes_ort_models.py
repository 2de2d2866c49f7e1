"""`fuselm optimize --target onnxruntime` on tiny checkpoints: onnxruntime on the lowered graph equals
onnxruntime (optimizations off) on the standard graph, prefill and decode with past; onnxruntime-genai
generates the same greedy tokens from both; `fuselm diff --target` shows every lowering with its drift."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import pytest
from fuselm.passes.check import drift, run_steps

import fuselm
from fuselm import contract
from fuselm.cli import main
from fuselm.graphcheck import check_graph_file
from fuselm.reference import OrtRunner

LOWERED = ("MatMulNBits", "GroupQueryAttention", "SkipSimplifiedLayerNormalization")


def _ops(model_dir) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(model_dir / "model.onnx"), load_external_data=False).graph.node)


@pytest.fixture(scope="module")
def lowered(exported, optimized, tmp_path_factory):
    """lowered(family, quant, level) -> `fuselm optimize --target onnxruntime` output (cached)."""
    cache: dict = {}

    def get(family: str, quant: str, level: int = 4):
        if (family, quant, level) not in cache:
            out = tmp_path_factory.mktemp(f"ort-{family}-{quant}-{level}") / "model"
            cache[family, quant, level] = fuselm.optimize(exported(family, quant), out, target="onnxruntime",
                                                          accuracy_level=level, quiet=True)
        return cache[family, quant, level]

    return get


# Tolerances (relative to the largest logit): f32 and level 1 (float32 activations) only reorder float
# sums; level 4 quantizes activations to int8 per block (measured 3e-3 on these checkpoints).
@pytest.mark.parametrize("family,quant,level,tol", [
    ("qwen3", "f32", 4, 1e-5), ("qwen3", "q4", 1, 1e-5), ("qwen3", "q4", 4, 2e-2), ("qwen2", "q4", 1, 1e-5)])
def test_lowered_graph_matches_the_standard_one(lowered, optimized, family, quant, level, tol):
    out = lowered(family, quant, level)
    ops = _ops(out)
    check_graph_file(out / "model.onnx")
    assert not {"Attention", "RMSNormalization", "FusedRoPE", "DequantizeLinear"} & set(ops), ops
    assert ops["GroupQueryAttention"] == 2 and ops["SkipSimplifiedLayerNormalization"] == 4
    # qwen2's fused qkv goes into GQA packed (OrtPackedQKV); qwen3's q/k norms keep its Split
    assert ops["Split"] == (2 if family == "qwen3" else 0), ops
    if quant == "q4":  # qkv, o, gate_up, down per layer and the lm_head; qwen3's tied q8 embedding too
        assert ops["MatMulNBits"] == 9 and ops["GatherBlockQuantized"] == (family == "qwen3")
    before = run_steps(optimized(family, quant) / "model.onnx")
    after = run_steps(out / "model.onnx", steps=before)
    for step, d in drift(before, after).items():
        assert d["logits_rel"] <= tol and d["all_outputs_rel"] <= 10 * tol, (step, d)
    config = json.loads((out / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True and config["model"]["type"] == "decoder"
    assert config["model"]["decoder"]["session_options"]["graph_optimization_level"] == "ORT_DISABLE_ALL"
    assert config["search"]["max_length"] == config["model"]["context_length"] == 256
    cos = next(t for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer
               if t.name.endswith("cos_cache"))
    assert cos.dims[0] == 256  # GQA's caches cover genai's max_length


def test_tied_table_is_one_copy_on_disk_that_each_reader_maps_by_itself(lowered):
    """qwen3's tied q8 table: GatherBlockQuantized reads initializers of its own over the lm_head's bytes
    (passes/ort_gather_quantized.py's map_tables_apart), so onnxruntime drops the head's mapping once it has
    prepacked it and pages in only the embedding rows looked up; the data file keeps one copy."""
    out = lowered("qwen3", "q4")
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    inits = {t.name: t for t in graph.initializer}
    made_by = {o: n for n in graph.node for o in n.output}
    readers = Counter(i for n in graph.node for i in n.input)
    head = next(n for n in graph.node if n.op_type == "MatMulNBits" and n.output[0] == contract.LOGITS)
    gbq = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    own = [made_by[i].input[0] if i in made_by else i for i in (gbq.input[0], gbq.input[2], gbq.input[3])]

    def place(name: str) -> dict:
        return {e.key: e.value for e in inits[name].external_data}

    for mine, shared in zip(own, head.input[1:4], strict=True):
        assert mine != shared and readers[mine] == readers[shared] == 1, (mine, shared)
        assert place(mine) == place(shared) and place(mine)["location"] == "model.onnx.data"


@pytest.mark.parametrize("quant,level", [("f32", 4), ("q4", 1), ("q4", 4)])
def test_onnxruntime_genai_generates_the_standard_graphs_tokens(lowered, optimized, quant, level):
    """Untied qwen2 (random tied embeddings repeat the prompt). genai runs the lowered graph with one
    shared past/present buffer. Level 1 equals plain onnxruntime on the standard graph; level 4 equals
    genai on the standard graph (onnxruntime turns its DequantizeLinear + MatMul into MatMulNBits at
    level 4 itself)."""
    pytest.importorskip("onnxruntime_genai")
    from test_genai import _genai_greedy  # tests/test_genai.py: genai's own greedy loop

    prompt, n = [100, 200, 300, 50], 12
    tokens = _genai_greedy(lowered("qwen2", quant, level), prompt, n)
    standard = optimized("qwen2", quant)
    want = _genai_greedy(standard, prompt, n) if level == 4 and quant == "q4" else \
        OrtRunner(standard).greedy(prompt, n).tokens
    assert tokens == want and len(set(tokens)) > 3


def test_diff_shows_each_lowering_with_its_drift(exported, tmp_path):
    data = fuselm.diff(exported("qwen3", "q4"), quiet=True, target="onnxruntime", accuracy_level=1)
    records = {r["pass"]: r for r in data["passes"]}
    for name in ("OrtGroupQueryAttention", "OrtSkipRMSNorm", "OrtMatMulNBits", "OrtGatherBlockQuantized"):
        r = records[name]
        assert r["changed"] and r["checker"] == "ok", (name, r.get("checker"))
        assert r["drift"]["decode"]["logits_rel"] <= 1e-5, (name, r["drift"])
    assert "OrtMatMulNBits" not in {r["pass"] for r in fuselm.diff(exported("qwen3", "q4"), quiet=True)["passes"]}
    assert not records["OrtPackedQKV"]["changed"]  # qwen3's q/k norms sit between the Split and GQA


def test_cli_target_flag_and_skip(exported, tmp_path, capsys):
    src = exported("qwen3", "q4")
    assert main(["optimize", str(src), "-o", str(tmp_path / "a"), "--target", "onnxruntime", "--skip", "gqa",
                 "--quiet"]) == 0
    ops = _ops(tmp_path / "a")
    assert ops["GroupQueryAttention"] == 0 and ops["Attention"] == 2 and ops["MatMulNBits"] == 9
    config = json.loads((tmp_path / "a" / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is False  # Attention-23 reads the past: no sharing
    assert main(["optimize", str(src), "-o", str(tmp_path / "b"), "--skip", "gqa", "--quiet"]) == 2
    assert "no such pass" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["genai", "ort"])
def test_run_backend_onnxruntime(lowered, optimized, engine, monkeypatch):
    """`fuselm run --backend onnxruntime` (runtime_metal/engines/ort.py): onnxruntime-genai, or onnxruntime with IO
    binding and one preallocated past/present buffer (the GQA graph) / presents fed back (the standard
    graph); greedy tokens equal plain onnxruntime's on the standard graph."""
    import io

    from fuselm.runtime_metal.engines import ort

    if engine == "genai":
        pytest.importorskip("onnxruntime_genai")
    else:
        monkeypatch.setattr(ort, "genai_installed", lambda: False)
    prompt = [100, 200, 300, 50]
    want = OrtRunner(optimized("qwen2", "q4")).greedy(prompt, 10).tokens
    for model_dir in (lowered("qwen2", "q4", 1), optimized("qwen2", "f32")):
        got = fuselm.run(model_dir, prompt, backend="onnxruntime", max_tokens=10, ignore_eos=True, quiet=True,
                         stream=io.StringIO())
        ref = want if model_dir.parent.name.startswith("ort-") else OrtRunner(model_dir).greedy(prompt, 10).tokens
        assert got["tokens"] == ref and got["decode_tok_s"] > 0, (model_dir, engine)


def test_run_backend_onnxruntime_cli(lowered, capsys):
    out = lowered("qwen2", "q4", 4)
    assert main(["run", str(out), "--prompt-ids", "5,17,33", "--max-tokens", "3", "--ignore-eos",
                 "--backend", "onnxruntime"]) == 0
    captured = capsys.readouterr()
    assert "decode 2 tokens" in captured.err and "onnxruntime" in captured.err and captured.out.strip()
    assert main(["run", str(out), "--prompt-ids", "5", "--backend", "onnxruntime", "--compile"]) == 2
    assert "--backend onnxruntime does not take --compile" in capsys.readouterr().err


def test_lowered_graph_runs_on_onnxruntime_by_default_and_torch_refuses(lowered):
    import io

    out = lowered("qwen2", "q4", 4)
    r = fuselm.run(out, prompt=[5, 17], max_tokens=2, ignore_eos=True, quiet=True, stream=io.StringIO())
    assert r["backend"].startswith("onnxruntime") and len(r["tokens"]) == 2
    with pytest.raises(fuselm.FuselmError, match=r"lowered for onnxruntime .* --backend onnxruntime"):
        fuselm.run(out, prompt=[5], max_tokens=1, backend="torch", quiet=True, stream=io.StringIO())


def test_builder_graph_round_trips_to_the_same_numbers_in_no_more_nodes(make_ckpt, tmp_path):
    """onnxruntime-genai's builder int4 graph -> FromGenAI (standard ops) -> the target (its contrib ops
    again, level 4 as the builder): onnxruntime gives the builder's own logits and cache, from no more
    compute nodes in a decoder layer (fewer MatMulNBits: gate/up fused; layer 0 also holds the shared
    seqlens_k / total_sequence_length nodes, which differ by one)."""
    pytest.importorskip("onnxruntime_genai")
    import onnx_ir as ir
    from fuselm.passes.draw import layer_assignment
    from test_genai import _builder  # tests/test_genai.py: the builder run in this process

    _builder("-i", str(make_ckpt("qwen3")), "-o", str(tmp_path / "genai"), "-p", "int4", "-e", "cpu",
             "-c", str(tmp_path / "cache"))
    out = fuselm.optimize(tmp_path / "genai", tmp_path / "ort", target="onnxruntime", quiet=True)
    before = run_steps(tmp_path / "genai" / "model.onnx")
    after = run_steps(out / "model.onnx", steps=before)
    for step, d in drift(before, after).items():
        assert d["logits_rel"] <= 1e-5 and d["all_outputs_rel"] <= 1e-5, (step, d)

    def per_layer(path) -> list[int]:
        counts = Counter(i for n, i in layer_assignment(ir.load(path).graph).items() if n.op_type != "Constant")
        return [counts[i] for i in sorted(counts) if i < 2]

    ours, theirs = per_layer(out / "model.onnx"), per_layer(tmp_path / "genai" / "model.onnx")
    assert ours[1] <= theirs[1] and ours[0] <= theirs[0] + 1, (ours, theirs)
    assert _ops(out)["MatMulNBits"] < _ops(tmp_path / "genai")["MatMulNBits"]
