"""`fuselm validate`: greedy tokens of the runtime vs onnxruntime (same graph) vs HF transformers.

f32/f16 graphs: the runtime's tokens must equal HF's. q8/q4 graphs: they must equal
onnxruntime's on the same graph (its MatMulNBits at accuracy level 1, i.e. f32 activations), and
the drift from HF is reported. Exit 1 (CheckFailed) on a mismatch.

Where the runtime's quantized matmuls take int8 activations (the CPU kernels' default, kind `*-int8`), the criterion
is the KL divergence on real text against onnxruntime's own int8 fusion (runtime_metal/checks.py int8_kl).
The default prompt goes through the checkpoint's chat template when it has one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fuselm.errors import CheckFailed, FuselmError
from fuselm.options import Options
from fuselm.reference import OrtRunner, hf_model, hf_steps
from fuselm.tokenizer import load_tokenizer

from .checks import _first_diff, _max_diff, int8_kl, step_table, text_ids, verdict
from .engines import load
from .engines.native import NativeEngine

DEFAULT_PROMPT = "hello world! what is the capital of france?"


def default_prompt(model_dir, tok) -> list[int]:
    """validate's prompt when none is given: DEFAULT_PROMPT through the chat template where the checkpoint has one
    (an instruct model answers that, not a bare string), else encoded plainly; without a tokenizer, ids 1..8."""
    from fuselm.tokenizer import encode_prompt

    if tok is None:
        return list(range(1, 9))
    chat = load_tokenizer(model_dir, required=False, chat=True)
    if getattr(chat, "chat_template", None):
        return encode_prompt(chat, DEFAULT_PROMPT, True)
    return tok.encode(DEFAULT_PROMPT)


# What a half-precision run may drift from the f32 reference beyond HF's own run in that format: one
# rounding of the format's mantissa (bf16 8 bits, f16 11) of the largest logit.
HALF_FLOOR = {"bf16": 2.0**-8, "f16": 2.0**-11}


def validate(model, reference, options: Options | None = None, tokens: int = 16, prompt=None, standard=None,
             quiet: bool = False, **keywords) -> dict:
    """Greedy-generate `tokens` tokens on the engine `fuselm.load` gives `model` under `options`, on onnxruntime and
    on HF transformers, and compare; raises CheckFailed on a mismatch. `prompt`: text or ids (default: a short
    sentence); `standard`: for the onnxruntime engine on a lowered graph, the standard graph it is held against."""
    if tokens < 1:
        raise FuselmError(f"--tokens must be at least 1, got {tokens}")
    ref = Path(reference)
    if not (ref / "config.json").is_file():
        raise FuselmError(f"--reference {ref} is not a HF checkpoint directory (no config.json); pass the "
                          "checkpoint the model was converted from")
    engine = load(model, options, **keywords)
    tok = load_tokenizer(engine.source, required=isinstance(prompt, str))
    ids = default_prompt(engine.source, tok) if prompt is None else \
        tok.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not isinstance(engine, NativeEngine):
        from .validate_ort import validate as _ort

        return _ort(engine, ref, ids, tokens, standard, quiet, tok)
    if standard is not None:
        raise FuselmError(f"--standard compares the onnxruntime engine with a standard graph; --backend {engine.name} "
                          "compares with onnxruntime on DIR itself: drop --standard or pass --backend onnxruntime")
    from rich.console import Console

    sess, why = engine.session, engine.why
    mode = (sess.meta.get("quantization") or {}).get("mode")
    quantized = mode in ("q4", "q8") or any(n.op_type in ("QMatMul", "QGather", "DequantizeLinear")
                                            for n in sess.graph.nodes)
    if sess.backend.compute != "f32":
        return _validate_half(engine, ref, ids, tokens, quantized, mode, quiet)
    ours = engine.trace(ids, tokens)
    onnxrt = OrtRunner(sess.lm.path).greedy(ids, tokens)
    hf = hf_steps(hf_model(ref), ids, tokens)

    d_ort, d_hf = _max_diff(ours, onnxrt), _max_diff(ours, hf)
    target, target_name = (onnxrt, "onnxruntime") if quantized else (hf, "HF transformers")
    first = _first_diff(ours.tokens, target.tokens)
    weights = [n.attrs["weight"] for n in sess.graph.nodes if n.op_type == "QMatMul"]
    hf_drift = _first_diff(ours.tokens, hf.tokens)
    console = Console(quiet=quiet)
    table = step_table(f"fuselm validate: {sess.describe()} · {mode or 'f32'} graph, reference {target_name}"
                       f"{f' · {why}' if why else ''}", ("fuselm", "onnxruntime", "max|Δlogit| vs ORT"),
                       ours, onnxrt, hf, d_ort, d_hf)
    console.print(table)
    result = {"tokens": ours.tokens, "onnxruntime": onnxrt.tokens, "hf": hf.tokens, "quantized": quantized,
              "reference": target_name, "first_mismatch": first, "hf_first_diff": hf_drift,
              "max_logit_diff_ort": d_ort, "max_logit_diff_hf": d_hf, "backend": sess.backend.name,
              "device": sess.backend.device, "static_decode": sess.static_decode and sess.static_checked,
              "compiled": sess.compiled is not None, "compile_failed": sess.compile_failed,
              "describe": sess.describe(), "why": why, "quantized_kernel": weights[0].kind if weights else None}
    int8 = None  # held against onnxruntime's own int8 fusion on real text (scoring resets the session: last)
    if quantized and sess.backend.int8_activations(weights):
        text = text_ids(tok, ids)
        int8 = int8_kl(engine.score(text), sess.lm.path, text)
    return verdict(console, result, target, d_ort if quantized else d_hf, "fuselm", int8,
                   f" ({'/'.join(sorted({w.kind for w in weights}))})", "; FUSELM_CPU_ACTIVATIONS=int16 runs f32-faithful",
                   mode)


def _validate_half(engine: NativeEngine, ref: Path, ids: list[int], n: int, quantized: bool, mode, quiet: bool) -> dict:
    """Half-precision compute against the f32 reference, HF transformers' own run in the same dtype as the
    yardstick. All runs are teacher-forced on the reference's greedy tokens, so every step compares logits
    over the same context: fuselm's drift from the f32 reference must stay within twice HF's drift in that
    format plus one rounding of the largest logit (HALF_FLOOR; two for a quantized graph). Free-running greedy tokens are reported
    (first step that differs from the reference, for fuselm and for HF in that dtype), not required equal:
    near-ties flip under any rounding."""
    from rich.console import Console
    from rich.table import Table

    sess = engine.session
    dtype = sess.backend.compute
    hf_f32, hf_dtype = hf_model(ref), hf_model(ref, dtype)
    f32 = OrtRunner(sess.lm.path).greedy(ids, n) if quantized else hf_steps(hf_f32, ids, n)
    target_name = "onnxruntime (f32 activations)" if quantized else "HF transformers f32"
    force = f32.tokens
    ours = engine.trace(ids, n, force=force)
    hf32 = f32 if not quantized else hf_steps(hf_f32, ids, n, force=force)
    hf_half = hf_steps(hf_dtype, ids, n, force=force)
    drift, yard = _max_diff(ours, f32), _max_diff(hf_half, hf32)
    scale = max(1.0, max(float(np.abs(x).max()) for x in f32.logits))
    # a quantized graph rounds its affine dequantization too: scale and bias = -zero_point * scale are each
    # rounded to the compute type (MLX's w = scale * q + bias; the bias is as large as the weight itself),
    # where HF's half run rounds each weight once: one more rounding of the largest logit
    floors = 2 if quantized else 1
    tol = [2 * y + floors * HALF_FLOOR[dtype] * scale for y in yard]
    free = engine.trace(ids, n)
    first = _first_diff(free.tokens, f32.tokens)
    hf_first = _first_diff(hf_steps(hf_dtype, ids, n).tokens, hf32.tokens if not quantized else
                           hf_steps(hf_f32, ids, n).tokens)
    console = Console(quiet=quiet)
    table = Table(title=f"fuselm validate: {sess.describe()} · {mode or 'f32'} graph in {dtype}, reference {target_name}")
    for col in ("step", "reference", f"fuselm {dtype} (forced)", f"max|Δlogit| fuselm {dtype}",
                f"max|Δlogit| HF {dtype}", "allowed"):
        table.add_column(col, justify="right")
    for i in range(n):
        mark = f"[red]{drift[i]:.2e}[/red]" if drift[i] > tol[i] else f"{drift[i]:.2e}"
        table.add_row(str(i), str(f32.tokens[i]), str(ours.tokens[i]), mark, f"{yard[i]:.2e}", f"{tol[i]:.2e}")
    console.print(table)
    console.print(f"free-running greedy tokens first differ from the reference at step {first} (fuselm {dtype}) "
                  f"and {hf_first} (HF {dtype})")
    result = {"dtype": dtype, "reference": target_name, "tokens": free.tokens, "reference_tokens": f32.tokens,
              "first_mismatch": first, "hf_half_first_mismatch": hf_first, "drift": drift, "hf_half_drift": yard,
              "allowed": tol, "quantized": quantized, "backend": sess.backend.name, "device": sess.backend.device,
              "static_decode": sess.static_checked, "compiled": sess.compiled is not None,
              "compile_failed": sess.compile_failed, "describe": sess.describe()}
    bad = [i for i in range(n) if drift[i] > tol[i]]
    if bad:
        i = bad[0]
        raise CheckFailed(f"{dtype} logits drift {drift[i]:.3g} from {target_name} at step {i}, beyond the "
                          f"{tol[i]:.3g} allowed (HF transformers in {dtype} drifts {yard[i]:.3g} there)")
    console.print(f"[green]OK[/green]: {n} steps within the {dtype} tolerance of {target_name}")
    return result
