"""fuselm: Hugging Face LLM checkpoints to fused ONNX graphs, run on Apple GPUs.

Every CLI command is a function of the same name here; imports are lazy so `import fuselm`
stays cheap.
"""

from pathlib import Path

from .errors import CheckFailed, FuselmError

__all__ = ["convert", "optimize", "diff", "split", "run", "validate", "stream_generate", "FuselmError", "CheckFailed"]
__version__ = "0.1.0"


def convert(hf_dir, out, **kwargs):
    """Convert a local HF checkpoint directory to a fuselm model directory (see `fuselm convert -h`)."""
    from .exporter.convert import convert as _convert

    _input_not_inside(hf_dir, out)
    return _convert(hf_dir, out, **kwargs)


def optimize(in_path, out, **kwargs):
    """Run the pass pipeline on a model directory or .onnx file (see `fuselm optimize -h`)."""
    from .passes.pipeline import optimize as _optimize

    _input_not_inside(in_path, out)
    return _optimize(in_path, out, **kwargs)


def _input_not_inside(source, out) -> None:
    """Replacing OUT (--force) must never delete the input it is made from."""
    if Path(out).resolve() in Path(source).resolve().parents:
        raise FuselmError(f"{source} lies inside OUT {out}: replacing OUT would delete it; choose another OUT")


def diff(in_path, **kwargs):
    """Walk the pass pipeline and report, pass by pass, what changed (see `fuselm diff -h`)."""
    from .passes.pipeline import diff as _diff

    return _diff(in_path, **kwargs)


def split(in_path, out, **kwargs):
    """Cut a model into pipeline stages at decoder-layer boundaries (see `fuselm split -h`)."""
    from .passes.split import split as _split

    _input_not_inside(in_path, out)
    return _split(in_path, out, **kwargs)


def run(model_dir, **kwargs):
    """Generate text from a model directory (see `fuselm run -h`); a `fuselm split` output runs one stage
    per process: this one under `mlx.launch`, else one local process per stage that fuselm starts
    (runtime_metal/pipeline_run.py, pipeline_launch.py). `--backend auto` picks the engine by
    fuselm/auto_backend.py's rule; the run's header says which and why."""
    from . import contract

    here = Path(model_dir)
    if (here / contract.SPLIT_NAME).is_file() or (here.parent / contract.SPLIT_NAME).is_file():
        from .runtime_metal import pipeline_run  # imported only here: it loads the runtime's whole stack

        if pipeline_run.is_split(model_dir):
            return pipeline_run.run(model_dir, **kwargs)
    kwargs.pop("pipe_timeout", None)
    backend, why, path = _backend_for(model_dir, kwargs)
    if backend == "onnxruntime":
        from .ort_run import run as _ort_run

        # auto's prepared copy was checked when it was written (its stamp says it is unchanged)
        return _ort_run(path, why=why, checked=_on_prepared_copy(path, model_dir, kwargs), **kwargs)
    from .runtime_metal.generate import run as _run

    return _run(model_dir, backend=backend, why=why, **kwargs)


def _backend_for(model_dir, kwargs: dict) -> tuple[str, str | None, object]:
    """Pop `backend` from run's / validate's keywords: the backend that runs `model_dir`, why (auto) and the
    directory it runs (auto's lowered copy of a standard quantized graph on a CPU, else `model_dir`)."""
    from .auto_backend import resolve
    from .ort_run import lowered_for_onnxruntime

    asked = kwargs.pop("backend", None) or "auto"
    if asked not in ("auto", "onnxruntime") and lowered_for_onnxruntime(model_dir):
        raise FuselmError(f"{model_dir} holds onnxruntime contrib ops (com.microsoft): it was lowered for onnxruntime "
                          f"(`fuselm optimize --target onnxruntime`); run it with --backend onnxruntime, or run "
                          f"--backend {asked} on the directory `fuselm optimize` wrote without --target")
    return resolve(model_dir, asked, kwargs)


def _on_prepared_copy(path, model_dir, kwargs: dict) -> bool:
    """Whether onnxruntime runs auto's prepared copy of `model_dir` (`path` is another directory); its logits
    are the last position's, so it runs on the IO-binding loop (fuselm/ort_prepared.py), set in `kwargs`."""
    copy = Path(path) != Path(model_dir)
    if copy:
        kwargs.setdefault("engine", "ort")
    return copy


def stream_generate(model, **kwargs):
    """Yield one Response (token, text, speeds, finish_reason) per generated token; `model` is a model
    directory, an .onnx file or a loaded runtime Session (mlx-lm's stream_generate shape)."""
    from .runtime_metal.generate import stream_generate as _stream

    return _stream(model, **kwargs)


def validate(model_dir, reference, **kwargs):
    """Greedy tokens of the runtime vs onnxruntime vs HF transformers (see `fuselm validate -h`); with
    `backend="onnxruntime"` (or auto's choice of it) the onnxruntime path vs the standard graph vs HF."""
    backend, why, path = _backend_for(model_dir, kwargs)
    if backend == "onnxruntime":
        from .ort_validate import validate as _ort_validate

        if _on_prepared_copy(path, model_dir, kwargs):  # held against the standard graph it was made from
            kwargs["standard"] = kwargs.get("standard") or model_dir
        return _ort_validate(path, reference, why=why, **kwargs)
    if kwargs.pop("standard", None) is not None:
        raise FuselmError(f"--standard compares the onnxruntime path with a standard graph; --backend {backend} "
                          "compares with onnxruntime on DIR itself: drop --standard or pass --backend onnxruntime")
    from .runtime_metal.validate import validate as _validate

    return _validate(model_dir, reference, backend=backend, why=why, **kwargs)
