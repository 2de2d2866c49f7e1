"""`fuselm run`: generate text from a model directory, streaming tokens as they come."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fuselm.errors import FuselmError

from .sampling import Sampler
from .session import Session, kv_options

PROFILE_SKIP_TOKENS = 3  # compilation and warm-up happen in the first decode steps


def load_tokenizer(model_dir: Path, required: bool):
    """The checkpoint's tokenizer, copied into the model directory by convert/optimize (offline)."""
    directory = model_dir if model_dir.is_dir() else model_dir.parent
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        if required:
            raise FuselmError(f"{directory} has no tokenizer files; pass --prompt-ids, or use a model directory "
                              "written by `fuselm convert` (it copies the tokenizer)")
        return None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False: an auto_map in tokenizer_config.json is refused, never prompted for
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for broken tokenizer files
        if required:
            raise FuselmError(f"cannot load the tokenizer in {directory} ({type(e).__name__}: {e}); "
                              "pass --prompt-ids instead") from None
        return None


def eos_ids(model_dir: Path, meta: dict, tok) -> set[int]:
    """Every eos id the checkpoint names: generation_config.json, fuselm.json, the tokenizer."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(i) for i in v if isinstance(i, int))

    directory = model_dir if model_dir.is_dir() else model_dir.parent
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            add(json.loads(gen.read_text()).get("eos_token_id"))
        except (ValueError, RecursionError, AttributeError):  # broken, deeply nested or not an object: as HF, ignore
            pass
    add((meta.get("special_tokens") or {}).get("eos_token_id"))
    if tok is not None:
        add(tok.eos_token_id)
    return ids


def encode_prompt(tok, prompt: str | None, prompt_ids: list[int] | None, chat: bool) -> list[int]:
    if prompt_ids is not None:
        if chat:
            raise FuselmError("--chat applies the chat template to --prompt text; it cannot be used with --prompt-ids")
        return [int(i) for i in prompt_ids]
    if prompt is None:
        raise FuselmError("pass --prompt TEXT or --prompt-ids 1,2,3")
    if chat:
        if not getattr(tok, "chat_template", None):
            raise FuselmError("this checkpoint has no chat template; run without --chat")
        try:  # transformers renders it in jinja2's ImmutableSandboxedEnvironment; it refuses unsafe templates
            out = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
        except Exception as e:  # noqa: BLE001 - SecurityError, TemplateError, and whatever a template raises
            raise FuselmError(f"the checkpoint's chat template failed ({type(e).__name__}: {str(e)[:200]}); it is "
                              "broken or tried something the sandbox forbids. Run without --chat") from None
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tok.encode(prompt)]


class _Detokenizer:
    """The text each new token adds; holds back an incomplete UTF-8 sequence. Without a tokenizer, the ids."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], ""

    def add(self, token: int) -> str:
        if self.tok is None:
            return f"{token} "
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return new


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
    tok = load_tokenizer(path, required=prompt is not None)
    ids = encode_prompt(tok, prompt, prompt_ids, chat)
    vocab = sess.meta.get("dims", {}).get("vocab")
    if vocab and any(not 0 <= i < vocab for i in ids):
        raise FuselmError(f"prompt ids must lie in [0, {vocab}); got {[i for i in ids if not 0 <= i < vocab][:5]}")
    stops = set() if ignore_eos else eos_ids(path, sess.meta, tok)
    detok = _Detokenizer(tok)
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
