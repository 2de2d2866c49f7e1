"""`fuselm convert`: a local HF checkpoint directory -> a fuselm model directory.

Two exporters implement one entry point, `build(hf_dir, config, precisions) -> graph.Export`:
the builder (exporter/families/build.py) and the traced exporter (exporter/traced/). This module
only chooses one (`--exporter auto|builder|torch`) and writes what it returns.

Order of work: read and check config.json and every tensor header (nothing written yet), build
the whole graph without weights, then stream the weights into model.onnx.data,
save model.onnx, run the ONNX checker, copy tokenizer files, write fuselm.json — all inside a
temporary directory that is renamed to OUT only at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from pathlib import Path

import onnx

from fuselm import __version__, contract
from fuselm.contract import DATA_NAME, MODEL_NAME
from fuselm.errors import FuselmError, Unsupported
from fuselm.modeldir import atomic_output_dir, copy_tokenizer_files, write_meta

from . import families, gguf
from .quant import Precision, precisions
from .weights import write_data

EXPORTERS = ("auto", "builder", "torch")
DEFAULT_METHOD = "mse"


def convert(hf_dir, out, quant: str = "f32", block_size: int = 32, lm_head: str | None = None,
            embed: str | None = None, force: bool = False, check: bool = False, quiet: bool = False,
            exporter: str = "auto", method: str = DEFAULT_METHOD, calib: str | bool | None = None,
            bits_per_weight: float | None = None) -> Path:
    """Convert the HF checkpoint at `hf_dir` to a model directory at `out`; returns `out`. `hf_dir` may be a
    GGUF file (or a directory holding one): its dequantized HF checkpoint is converted (exporter/gguf.py), and
    fuselm.json's `source` says what the file stored.

    quant: f32 | f16 | q8 | q4 for linear layers (blockwise asymmetric, `block_size` 32/64/128);
    lm_head / embed: their precision (default: the head q8 when quantizing, else as `quant`; a tied embedding as the head,
    one tensor for both; an untied one f16 when quantizing, else as `quant`).
    exporter: builder (the hand-written families), torch (trace transformers' modeling code,
    exporter/traced/) or auto (the builder where a family exists, else torch).
    check: afterwards compare onnxruntime with HF transformers (exporter/check.py).
    method: how each block's scale and zero point are chosen (rtn | mse | gptq: exporter/quant.py).
    calib: measure the weights' importance on a text first (a path, or True for the bundled text;
    exporter/calibrate.py); gptq and `bits_per_weight` always do; False never; None (default): a q4 `mse`
    convert does when the float32 model fits in a third of the free memory (the calibration holds it whole),
    else its errors are weighted by magnitude (data-free, streaming). bits_per_weight: mixed precision, each
    quantized tensor's precision chosen by its measured sensitivity within that average.
    """
    t0 = time.perf_counter()
    hf_dir = Path(hf_dir)
    precisions(quant, block_size, lm_head, embed, method=method)  # bad flags fail before the checkpoint is read
    if bits_per_weight is not None and (quant not in ("q4", "q8") or not bits_per_weight > 0):
        raise FuselmError(f"--bits-per-weight {bits_per_weight} spends a budget over quantized tensors; pass a "
                          "positive number with --quant q4 or q8")
    source = None
    if (gguf_file := gguf.find_gguf(hf_dir)) is not None:  # llama.cpp's format: its dequantized HF checkpoint
        hf_dir = gguf.checkpoint_for(gguf_file, quiet=quiet)
        source = gguf.source_of(hf_dir)
    config = read_config(hf_dir)
    tied = bool(config.get("tie_word_embeddings", False))
    precision = precisions(quant, block_size, lm_head, embed, tied=tied, method=method)
    chosen = choose_exporter(exporter, config)
    recipe = None
    auto = calib is None and method == "mse" and bits_per_weight is None
    if calib is None:
        calib = quant == "q4" and method == "mse" and _fits_in_memory(hf_dir)
    if quant in ("q4", "q8") and (calib or method == "gptq" or bits_per_weight is not None):
        try:
            recipe, precision = _calibrated(hf_dir, precision, method, calib, bits_per_weight, tied, quiet)
        except Exception as e:  # noqa: BLE001 - the default's calibration is a refinement: data-free still converts
            if not auto:
                raise
            if not quiet:
                print(f"fuselm convert: calibration failed ({type(e).__name__}: {str(e)[:200]}); blocks weighted by "
                      "magnitude instead (data-free)")
    try:
        builder, ckpt, meta, label = _exporter(chosen)(hf_dir, config, precision)
    except Unsupported as e:
        if exporter != "auto":
            raise
        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise Unsupported(f"model_type {config.get('model_type')!r} ({arch}) is not supported: the builder has "
                          f"{', '.join(families.SUPPORTED)}, and the traced exporter refused it: {e}") from None
    plan_meta = {"quantization": quantization_meta(quant, *precision, tied=tied, recipe=recipe),
                 "special_tokens": special_tokens(hf_dir, config),
                 "graph": {"opset": contract.OPSET, "domains": {contract.DOMAIN: contract.DOMAIN_VERSION}, "kv_dtype": "float32", "logits_dtype": "float32",
                           "linear_layout": "[in, out]"},
                 "exporter": {"fuselm_version": __version__, "kind": chosen}}
    meta = {"stage": "exported", "passes": [], **meta, **plan_meta, **({"source": source} if source else {})}
    out = Path(out)
    try:
        with atomic_output_dir(out, force=force) as tmp:
            with _progress(quiet, meta["dims"]["layers"]) as advance:
                write_data(tmp / DATA_NAME, builder.jobs, ckpt, advance)
            # The weights' TensorProtos now point into model.onnx.data; the graph holds no weight bytes.
            model = builder.model(contract.functions_for(builder.nodes), f"fuselm {__version__} export of {label}")
            if meta.get("attention"):  # per-layer attention variants, for any runtime that reads the graph alone
                onnx.helper.set_model_props(model, {contract.ATTENTION_META: json.dumps(meta["attention"])})
            onnx.save_model(model, tmp / MODEL_NAME)
            onnx.checker.check_model(str(tmp / MODEL_NAME), full_check=True)
            copy_tokenizer_files(hf_dir, tmp)
            write_meta(tmp, meta)
    except OSError as e:  # disk full, permissions, a shard that vanished: nothing was left at OUT
        raise FuselmError(f"converting to {out} failed: {e.strerror or e} ({e.filename or 'I/O'}); "
                          "free disk space or choose another OUT, then run again") from None
    finally:
        if recipe is not None and recipe.describe.get("folder"):
            shutil.rmtree(recipe.describe["folder"], ignore_errors=True)  # the calibration's E[x xᵀ] arrays
    if not quiet:
        size = sum(p.stat().st_size for p in out.iterdir()) / 2**20
        print(f"fuselm convert: wrote {out} ({label}, {chosen} exporter, {quant}, {size:.1f} MiB) in "
              f"{time.perf_counter() - t0:.1f} s")
    if check:
        from .check import check as run_check

        run_check(out, hf_dir, quiet=quiet)
    return out


def _fits_in_memory(hf_dir: Path) -> bool:
    """Whether the checkpoint in float32 takes at most a third of the memory free now."""
    import psutil

    from .weights import Checkpoint

    try:
        count = sum(math.prod(shape) for _, _, shape in Checkpoint(hf_dir).tensors.values())
    except FuselmError:
        return False  # the exporter names the problem
    return 4 * count <= psutil.virtual_memory().available / 3


def _calibrated(hf_dir: Path, precision: tuple, method: str, calib, budget, tied: bool, quiet: bool):
    """(recipe, precisions) after a calibration pass: the recipe rides on the three precisions (quant.Plan reads
    it); a tied table's chosen precision becomes the embedding's and the head's (one tensor serves both)."""
    from .calibrate import recipe as calibrated

    linear, embed, head = precision
    rec = calibrated(hf_dir, method, calib if isinstance(calib, (str, Path)) else None, budget, linear, quiet=quiet)
    table = families.hf_name("embed")
    if tied and table in rec.tensors:
        embed = head = rec.tensors.pop(table)
    return rec, tuple(dataclasses.replace(p, recipe=rec) for p in (linear, embed, head))


def _exporter(kind: str):
    """The `build(hf_dir, config, precisions) -> graph.Export` of an exporter kind."""
    if kind == "builder":
        from .families.build import build
    else:
        from .traced import build
    return build


def choose_exporter(exporter: str, config: dict) -> str:
    """builder or torch: `auto` takes the builder for the families it has (and their aliases)."""
    if exporter not in EXPORTERS:
        raise FuselmError(f"--exporter {exporter!r} is not an exporter; choose one of {', '.join(EXPORTERS)}")
    if exporter != "auto":
        return exporter
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        families.family_for(config)  # its error names the problem
    return "builder" if families.ALIASES.get(model_type, model_type) in families.FAMILIES else "torch"


def read_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not hf_dir.is_dir():
        raise FuselmError(f"{hf_dir} is not a directory; pass a local Hugging Face checkpoint directory")
    if not path.is_file():
        raise FuselmError(f"{path} is missing; HF_DIR must be a Hugging Face checkpoint directory "
                          "(config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, deep nesting
        raise FuselmError(f"{path} is not valid JSON ({e}); restore the checkpoint's config.json") from None
    if not isinstance(config, dict):
        raise FuselmError(f"{path} is not a JSON object; restore the checkpoint's config.json")
    return config


def quantization_meta(quant: str, linear: Precision, embed: Precision, lm_head: Precision, tied: bool = False,
                      recipe=None) -> dict:
    shares = {"shares": "embed"} if tied and lm_head == embed else {}  # one stored tensor for both (quant.Plan)
    out = {"mode": quant, "linear": linear.describe(), "embed": embed.describe(), "lm_head": {**lm_head.describe(), **shares},
           "norms": {"bits": 32, "dtype": "float32"}, "biases": {"bits": 32, "dtype": "float32"}}
    if recipe is not None:
        out["calibration"] = recipe.describe["calibration"]
        # mixed precision: every tensor stored otherwise than its class, as "q8/32" (kind / block size)
        out["tensors"] = {name: p.name() for name, p in sorted(recipe.tensors.items()) if p != linear}
    return out


def special_tokens(hf_dir: Path, config: dict) -> dict:
    """bos / eos / pad ids: generation_config.json first (eos may be a list), then config.json."""
    gen = {}
    path = hf_dir / "generation_config.json"
    if path.is_file():
        try:
            gen = json.loads(path.read_text())
        except (ValueError, RecursionError):
            gen = {}  # HF ignores a broken generation config too; config.json still has the ids
        gen = gen if isinstance(gen, dict) else {}
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: gen[k] if gen.get(k) is not None else config.get(k) for k in keys}


@contextlib.contextmanager
def _progress(quiet: bool, layers: int):
    """A rich progress bar that advances per decoder layer (and once for embedding + head)."""
    if quiet:
        yield lambda job: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("converting {task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True) as bar:
        task, last = bar.add_task("embedding", total=layers), [None]

        def advance(job):
            if job.layer is not None and job.layer != last[0]:
                if last[0] is not None:
                    bar.advance(task)
                last[0] = job.layer
                bar.update(task, description=f"layer {job.layer}")
        try:
            yield advance
        finally:
            bar.update(task, completed=layers)
