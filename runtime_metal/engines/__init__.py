"""The engines a model runs on, and `load`: the one place that picks one (`fuselm.load`, `fuselm run`, ...).

- NativeEngine (native.py): fuselm's executor over a backend, MLX on Metal, torch (CPU, CUDA), numpy;
- OrtEngine (ort.py): onnxruntime's CPU engine, on a graph lowered for it (prepared once: ort_prepared.py);
- a `fuselm split` output runs one stage per process (pipeline_run.py), each stage loaded here.
auto.py holds `--backend auto`'s rule.
"""

from __future__ import annotations

from pathlib import Path

from fuselm.errors import FuselmError
from fuselm.options import Options

from .base import Engine

__all__ = ["Engine", "load"]


def load(model, options: Options | None = None, **keywords) -> Engine:
    """The engine `fuselm run` uses for `model` (a model directory or an .onnx file) under `options` (keywords
    replace its fields). Options the chosen engine cannot honour are refused by name (exit 2)."""
    from .auto import ONNXRUNTIME, resolve

    options = Options.of(options, **keywords)
    source = Path(model)
    if not source.exists():
        raise FuselmError(f"{source} does not exist; pass a model directory written by `fuselm convert` / `optimize`")
    kind, why, path = resolve(source, options)
    if kind == ONNXRUNTIME:
        from .ort import OrtEngine

        if flags := options.unhonoured(OrtEngine.HONOURS):
            raise FuselmError(f"--backend onnxruntime does not take {', '.join(flags)}; drop them or use --backend torch")
        # auto's prepared copy was checked when it was written (its stamp says it is unchanged); the IO-binding
        # loop runs it (its logits are the last positions', which onnxruntime-genai 0.18 refuses), and speculative
        # decoding (onnxruntime-genai runs whole generations only)
        copy = path != source
        return OrtEngine(source, path, options, why, loop="ort" if copy or options.speculative else "auto",
                         checked=copy)
    from .native import NativeEngine

    return NativeEngine(source, options if kind == options.backend else options.replace(backend=kind), why)
