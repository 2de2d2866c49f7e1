"""`--backend auto`: which engine runs a model directory, and why (`fuselm.load`'s rule, the one place it lives).

The rule (docs/benchmarks.md, "Which CPU engine auto runs"):
- a graph lowered for onnxruntime (`fuselm optimize --target onnxruntime`, com.microsoft ops):
  onnxruntime; only it runs those ops, and on a CPU it is the fastest path;
- a GPU (Metal, CUDA): runtime_metal's own choice (MLX on Metal, torch on CUDA);
- a CPU and a standard quantized (q4/q8) graph, onnxruntime importable and the prepared store on
  (FUSELM_PREPARED): onnxruntime on the graph lowered for it, prepared once in fuselm's cache folder
  (ort_prepared.py); never the standard graph itself (onnxruntime dequantizes its tied head every token). A
  graph the passes cannot lower runs on the torch backend, the reason in the header;
- a CPU and a float graph: the torch backend (the f32 reference);
- options only runtime_metal honours (--compile, --kv-bits, ...) keep a standard graph there.
`--backend torch` always runs the torch backend (the f32 reference on a CPU).
"""

from __future__ import annotations

import glob
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.options import Options

ONNXRUNTIME, RUNTIME = "onnxruntime", "auto"  # RUNTIME: runtime_metal's make_backend("auto") decides
LOWER = "onnxruntime-lowered"  # choose's answer: onnxruntime on the prepared lowered copy (resolve makes it)
SPEEDUP = ("onnxruntime on the lowered 0.6B q4 graph decoded 4.3x the torch backend's tok/s "
           "(bench/results/cpu-auto-rerun.json)")


@dataclass(frozen=True)
class Facts:
    """What the choice reads: the machine (a GPU a backend can use) and the graph."""

    gpu: str | None  # "metal", "cuda" or None
    lowered: bool  # com.microsoft contrib ops (onnxruntime's own)
    weight_bits: frozenset[int]  # bits of the graph's quantized weights (blocked DequantizeLinear); empty: float
    flags: tuple[str, ...] = ()  # options given that only runtime_metal's backends honour (--compile, --kv-bits)
    lowerable: bool = False  # onnxruntime importable and the prepared store on (FUSELM_PREPARED)


def choose(facts: Facts) -> tuple[str, str]:
    """(backend, why): "onnxruntime", LOWER (onnxruntime on the graph lowered for it, prepared beside the
    model), or "auto" for runtime_metal's own choice (MLX on Metal, torch elsewhere)."""
    if facts.lowered:
        return ONNXRUNTIME, "auto: the graph is lowered for onnxruntime (com.microsoft ops only onnxruntime runs)"
    if facts.gpu is not None:
        return RUNTIME, f"auto: a {facts.gpu} GPU"
    if facts.flags:
        return RUNTIME, f"auto: {', '.join(facts.flags)} asks for the torch backend"
    if facts.weight_bits:
        bits = "/".join(str(b) for b in sorted(facts.weight_bits))
        if facts.lowerable:
            return LOWER, f"no GPU and a standard {bits}-bit graph: {SPEEDUP}"
        return RUNTIME, (f"auto: no GPU and a standard {bits}-bit graph: the torch backend (onnxruntime is not "
                         "importable or FUSELM_PREPARED=0 keeps the lowered copy off; `fuselm optimize --target "
                         f"onnxruntime` lowers the graph for onnxruntime: {SPEEDUP})")
    return RUNTIME, "auto: no GPU and a float graph: the torch backend (the f32 reference)"


def gpu() -> str | None:
    """"metal" on a Mac with Metal, "cuda" where torch sees a CUDA device, else None (torch is imported only
    where an NVIDIA device node exists, so a CPU-only run need not load it)."""
    from ..backends import mlx_metal_available

    if mlx_metal_available():
        return "metal"
    if glob.glob("/dev/nvidia[0-9]*") and importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return None


def graph_facts(model_dir) -> tuple[bool, frozenset[int]]:
    """(lowered, weight bits) of a model directory's graph, read without its weights; (False, {}) for a path
    that holds no readable graph (the backend's own checks name the problem)."""
    import onnx

    from fuselm.graphcheck import ORT_DOMAIN

    path = Path(model_dir)
    path = path / contract.MODEL_NAME if path.is_dir() else path
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - not ONNX: the backend's own check names the problem
        return False, frozenset()
    lowered = any(n.domain == ORT_DOMAIN for n in graph.node) and (path.parent / contract.META_NAME).is_file()
    types = {t.name: t.data_type for t in graph.initializer}
    bits = {4 if types.get(n.input[0]) in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4) else 8
            for n in graph.node if n.op_type == "DequantizeLinear" and n.input[0] in types
            and types[n.input[0]] in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4, onnx.TensorProto.UINT8,
                                      onnx.TensorProto.INT8)}
    return lowered, frozenset(bits)


def lowered_for_onnxruntime(model_dir) -> bool:
    """Whether the directory is fuselm's and its graph holds onnxruntime contrib ops (`fuselm optimize
    --target onnxruntime`; read without weights). onnxruntime-genai's own directories are not."""
    return Path(model_dir).is_dir() and graph_facts(model_dir)[0]


def resolve(model_dir, options: Options) -> tuple[str, str | None, Path]:
    """(engine, why, directory) that runs `model_dir` under `options`: engine "onnxruntime" or a runtime_metal
    backend ("auto": runtime_metal's own choice); why is None when the engine was asked for by name; the directory is
    the prepared lowered copy where onnxruntime runs one. `--backend onnxruntime` on a standard 4-/8-bit graph runs
    the lowered copy too (the graph as written decodes 7-13x slower there: its tied head is dequantized every token)."""
    from ..prepared import enabled
    from .ort import OrtEngine
    from .ort_prepared import existing

    path = Path(model_dir)
    asked = options.backend
    if asked not in ("auto", ONNXRUNTIME):
        if lowered_for_onnxruntime(path):
            raise FuselmError(f"{model_dir} holds onnxruntime contrib ops (com.microsoft): it was lowered for onnxruntime "
                              f"(`fuselm optimize --target onnxruntime`); run it with --backend onnxruntime, or run "
                              f"--backend {asked} on the directory `fuselm optimize` wrote without --target")
        return asked, None, path
    lowerable = path.is_dir() and enabled() and importlib.util.find_spec("onnxruntime") is not None
    if asked == ONNXRUNTIME:
        if not lowerable:
            return ONNXRUNTIME, None, path
        if found := existing(path):  # the lowered copy, found without reading the graph
            return ONNXRUNTIME, None, found[0]
        lowered, bits = graph_facts(path)
        if lowered or not bits:
            return ONNXRUNTIME, None, path
        kind, why, out = _lowered(path, "--backend onnxruntime", bits)
        if kind != ONNXRUNTIME:
            raise FuselmError(f"--backend onnxruntime: {why.removeprefix('auto: the torch backend: ')}; run "
                              "`fuselm optimize --target onnxruntime` to see why, or use --backend torch")
        return ONNXRUNTIME, None, out
    device = options.device
    flags = tuple(f for f in options.unhonoured(OrtEngine.HONOURS) if f != "--device")
    machine = gpu() if device is None else None
    if device in (None, "cpu") and machine is None and lowerable and not flags:
        if found := existing(path):  # a copy lowered from the model as it is now: the graph need not be read
            copy, kept = found
            backend, why = choose(Facts(gpu=None, lowered=False, weight_bits=frozenset(kept.get("weight_bits", ())),
                                        lowerable=True))
            if backend == LOWER:
                return ONNXRUNTIME, _said(copy, "read", why), copy
    lowered, bits = graph_facts(model_dir)
    if device not in (None, "cpu") and not lowered:
        return RUNTIME, None, path  # a device was named: runtime_metal's backends take it
    facts = Facts(gpu=machine, lowered=lowered, weight_bits=bits, flags=flags, lowerable=lowerable)
    backend, why = choose(facts)
    if backend != LOWER:
        return backend, why, path
    return _lowered(path, why, bits)


def _lowered(path: Path, why: str, bits: frozenset[int]) -> tuple[str, str, Path]:
    """onnxruntime on the prepared lowered copy of `path`, or the torch backend with the reason it failed."""
    from ..prepared import CannotPrepare
    from .ort_prepared import lowered_copy

    try:
        out, how = lowered_copy(path, {"weight_bits": sorted(bits)})
    except Exception as e:  # noqa: BLE001 - a graph that cannot be lowered (or a store that cannot be written) runs on torch
        reason = str(e) if isinstance(e, CannotPrepare) else f"{type(e).__name__}: {e}"
        return RUNTIME, f"auto: the torch backend: lowering the graph for onnxruntime failed ({reason})", path
    return ONNXRUNTIME, _said(out, how, why), out


def _said(out: Path, how: str, why: str) -> str:
    when = "" if how == "read" else f" ({how.replace('written', 'lowered now', 1)})"
    return f"auto: onnxruntime on the graph lowered for it, prepared once in {out}{when}, because {why}"
