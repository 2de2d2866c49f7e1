"""`fuselm run`: generate text from a model directory, streaming tokens as they come."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuselm.errors import FuselmError
from fuselm.tokenizer import Detokenizer, encode_prompt, eos_ids, load_tokenizer

from .sampling import Sampler
from .session import Session, kv_options

PROFILE_SKIP_TOKENS = 3  # compilation and warm-up happen in the first decode steps


@dataclass
class Response:
    """One generated token, as `stream_generate` yields it (mlx-lm's GenerationResponse shape)."""

    token: int
    text: str  # the text this token adds (may be empty while a UTF-8 sequence is incomplete)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float | None  # decode tokens/s so far (None for the first token)
    finish_reason: str | None  # "stop" (eos), "length", or None while generating


def stream_generate(model, prompt=None, prompt_ids=None, max_tokens=64, ignore_eos=False, chat=False,
                    temperature=0.0, top_k=0, top_p=1.0, seed=None, backend="auto", device=None, dtype="auto",
                    no_fused_kernels=False, compile=None, threads=None, profile=False, **kv) -> Iterator[Response]:
    """Generate from `model` (a model directory, an .onnx file, or a loaded Session), one Response per token.

    `kv_bits`, `kv_bits_k`, `kv_bits_v`, `kv_group_size`: the KV cache's storage (runtime_metal/kvcache.py).

    Tokens are picked on the device and the next step is queued while this one is read (Session.generate)."""
    if max_tokens < 1:
        raise FuselmError(f"--max-tokens must be at least 1, got {max_tokens}")
    sampler = Sampler(temperature, top_k, top_p, seed)
    if isinstance(model, Session):
        sess, path = model, model.lm.path.parent if model.lm.path.name == "model.onnx" else model.lm.path
    else:
        path = Path(model)
        sess = Session(path, backend=backend, device=device, fused=not no_fused_kernels, compile=compile,
                       threads=threads, dtype=dtype, **kv_options(**kv))
    tok = load_tokenizer(path, required=prompt is not None, chat=chat)
    ids = encode_prompt(tok, prompt, prompt_ids, chat)
    vocab = sess.meta.get("dims", {}).get("vocab")
    if vocab and any(not 0 <= i < vocab for i in ids):
        raise FuselmError(f"prompt ids must lie in [0, {vocab}); got {[i for i in ids if not 0 <= i < vocab][:5]}")
    stops = set() if ignore_eos else eos_ids(path, sess.meta, tok)
    detok = Detokenizer(tok)
    sess.reset(len(ids) + max_tokens)
    t0 = time.perf_counter()
    t_first = None
    for n, token in enumerate(sess.generate(ids, max_tokens, sampler)):
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        if profile and n == PROFILE_SKIP_TOKENS - 1:  # the step after this token is queued already
            sess.profiler.enabled = True
        done = "stop" if token in stops else ("length" if n + 1 >= max_tokens else None)
        yield Response(token, detok.add(token), len(ids), len(ids) / max(t_first - t0, 1e-9), n + 1,
                       n / (now - t_first) if n else None, done)
        if done:
            return


def run(model_dir, prompt=None, prompt_ids=None, max_tokens=64, ignore_eos=False, chat=False, temperature=0.0,
        top_k=0, top_p=1.0, seed=None, profile=False, backend="auto", device=None, no_fused_kernels=False,
        compile=None, threads=None, stream=None, quiet=False, dtype="auto", why=None, **kv) -> dict:
    """Generate up to `max_tokens` tokens after the prompt; prints them as they come. `why`: why this backend
    runs (`--backend auto`'s reason, fuselm/auto_backend.py), printed in the header.

    `kv_bits`, `kv_bits_k`, `kv_bits_v`, `kv_group_size`: the KV cache's storage (runtime_metal/kvcache.py).
    Returns the generated ids, the text, prefill and decode tokens per second and what ran."""
    from rich.console import Console

    Sampler(temperature, top_k, top_p, seed)  # bad sampling values fail before the model loads
    path = Path(model_dir)
    sess = Session(path, backend=backend, device=device, fused=not no_fused_kernels, compile=compile, threads=threads,
                   dtype=dtype, **kv_options(**kv))
    out = stream or sys.stdout
    console = Console(stderr=True, quiet=quiet)
    console.print(f"[dim]fuselm run: {sess.describe()}{f' · {why}' if why else ''}[/dim]")
    generated, last = [], None
    for r in stream_generate(sess, prompt, prompt_ids, max_tokens, ignore_eos, chat, temperature, top_k, top_p, seed,
                             profile=profile):
        generated.append(r.token)
        out.write(r.text)
        out.flush()
        last = r
    out.write("\n")
    out.flush()
    tok = load_tokenizer(path, required=False) if prompt is not None else None
    text = tok.decode(generated, skip_special_tokens=True) if tok is not None else None
    decode_n = last.generation_tokens - 1
    result = {
        "tokens": generated, "text": text, "prompt_tokens": last.prompt_tokens, "backend": sess.backend.name,
        "device": sess.backend.device, "dtype": sess.backend.compute, "prefill_tok_s": last.prompt_tps,
        "decode_tok_s": last.generation_tps, "stopped_at_eos": last.finish_reason == "stop",
        "what": sess.describe(), "why": why,
    }
    decode = f"{result['decode_tok_s']:.1f} tok/s" if decode_n else "n/a (one token)"
    console.print(f"[dim]prefill {last.prompt_tokens} tokens: {result['prefill_tok_s']:.1f} tok/s (to the first token) "
                  f"· decode {decode_n} tokens: {decode} · {sess.describe()}[/dim]")
    if profile:
        from .profile import report

        result["profile"] = report(sess, decode_n - PROFILE_SKIP_TOKENS, console)
    return result
