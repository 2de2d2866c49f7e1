"""fuselm: Hugging Face LLM checkpoints to fused ONNX graphs, run on Apple GPUs.

Every CLI command is a function of the same name here; imports are lazy so `import fuselm`
stays cheap.
"""

from pathlib import Path

from .errors import CheckFailed, FuselmError
from .options import KVFormat, Options

__all__ = ["convert", "optimize", "diff", "split", "load", "run", "validate", "eval", "stream_generate", "Options",
           "KVFormat", "FuselmError", "CheckFailed"]
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


def diff(in_path, target=None, skip=(), **kwargs):
    """Walk the pass pipeline and report, pass by pass, what changed (see `fuselm diff -h`); `target` "mlx", "torch"
    or "numpy" adds that runtime's load-time rewrites (runtime_metal/rewrites/) after the passes, with their drift."""
    from .passes.pipeline import diff as _diff

    if target in ("mlx", "torch", "numpy"):
        from functools import partial

        from .runtime_metal.rewrites import split_skip, stages

        rewrites, passes = split_skip(skip)
        return _diff(in_path, skip=passes, runtime=partial(stages, backend=target, skip=rewrites), **kwargs)
    return _diff(in_path, target=target, skip=skip, **kwargs)


def split(in_path, out, **kwargs):
    """Cut a model into pipeline stages at decoder-layer boundaries (see `fuselm split -h`)."""
    from .passes.split import split as _split

    _input_not_inside(in_path, out)
    return _split(in_path, out, **kwargs)


def load(model, options=None, **keywords):
    """The engine `fuselm run` would use for `model` (a model directory or .onnx file) under `options` (a
    fuselm.Options; keywords replace its fields): `--backend auto`'s rule lives in one place
    (runtime_metal/engines/auto.py). Pass it to `stream_generate`, `run`, `eval`; its `describe()` says what runs."""
    from .runtime_metal.engines import load as _load

    return _load(model, options, **keywords)


def run(model, prompt=None, options=None, chat=False, stream=None, quiet=False, **keywords):
    """Generate text from a model directory or a loaded engine (see `fuselm run -h`); `prompt`: text or token ids.
    A `fuselm split` output runs one stage per process: this one under `mlx.launch`, else one local process per
    stage that fuselm starts (runtime_metal/pipeline_run.py)."""
    from . import contract

    here = Path(model) if isinstance(model, (str, Path)) else None
    if here is not None and ((here / contract.SPLIT_NAME).is_file() or (here.parent / contract.SPLIT_NAME).is_file()):
        from .runtime_metal import pipeline_run  # imported only here: it loads the runtime's whole stack

        if pipeline_run.is_split(model):
            return pipeline_run.run(model, prompt, Options.of(options, **keywords), chat, stream, quiet)
    from .runtime_metal.generate import run as _run

    return _run(model, prompt, options, chat, stream, quiet, **keywords)


def stream_generate(model, prompt=None, options=None, chat=False, **keywords):
    """Yield one Response (token, text, speeds, finish_reason) per generated token; `model` is an engine from
    `fuselm.load` or a model directory (mlx-lm's stream_generate shape)."""
    from .runtime_metal.generate import stream_generate as _stream

    return _stream(model, prompt, options, chat, **keywords)


def validate(model, reference, options=None, tokens=16, prompt=None, standard=None, quiet=False, **keywords):
    """Greedy tokens of the engine `load` picks vs onnxruntime vs HF transformers (see `fuselm validate -h`)."""
    from .runtime_metal.validate import validate as _validate

    return _validate(model, reference, options, tokens, prompt, standard, quiet, **keywords)


def eval(model, reference=None, options=None, text=None, window=512, max_tokens=None, quiet=False,  # noqa: A001
         **keywords):
    """Perplexity, KL divergence from HF and top-1 agreement on a text, teacher-forced over windows (see `fuselm eval
    -h`), on the engine `load` gives `model` under `options` (backend "onnxruntime": the graph as written); returns
    the record (runtime_metal/evaluate.py)."""
    from .runtime_metal.evaluate import evaluate

    return evaluate(model, reference, options, text, window, max_tokens, quiet, **keywords)
