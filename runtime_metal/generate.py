"""`fuselm run`: generate text from a model directory, streaming tokens as they come."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from fuselm.errors import FuselmError

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


def sample(logits: np.ndarray, temperature: float, top_k: int, top_p: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else temperature, then top-k, then top-p (nucleus) sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        cut = order[np.searchsorted(cum, top_p) + 1:]
        p[cut] = 0.0
        p /= p.sum()
    return int(rng.choice(p.size, p=p))


class _Streamer:
    """Prints the decoded text as it grows; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tok, out):
        self.tok, self.out, self.ids, self.shown = tok, out, [], ""

    def put(self, token: int) -> None:
        self.ids.append(token)
        if self.tok is None:
            self.out.write(f"{token} ")
        else:
            text = self.tok.decode(self.ids, skip_special_tokens=False)
            if text.endswith("\ufffd"):
                return
            self.out.write(text[len(self.shown):] if text.startswith(self.shown) else text)
            self.shown = text
        self.out.flush()


def _checked(logits: np.ndarray, step: int) -> np.ndarray:
    """NaN or +inf logits mean broken weights or a broken graph: stop rather than emit garbage tokens."""
    if np.isnan(logits).any() or np.isposinf(logits).any():
        raise FuselmError(f"the model produced NaN or infinite logits at step {step}; its weights or graph are broken "
                          "(`fuselm validate` compares it with the checkpoint)")
    return logits


def run(model_dir, prompt=None, prompt_ids=None, max_tokens=64, ignore_eos=False, chat=False, temperature=0.0,
        top_k=0, top_p=1.0, seed=None, profile=False, backend="auto", device=None, no_fused_kernels=False,
        compile=None, threads=None, stream=None, quiet=False, **kv) -> dict:
    """Generate up to `max_tokens` tokens after the prompt; prints them as they come.

    `kv_bits`, `kv_bits_k`, `kv_bits_v`, `kv_group_size`: the KV cache's storage (runtime_metal/kvcache.py).
    Returns the generated ids, the text, prefill and decode tokens per second and what ran."""
    from rich.console import Console

    if max_tokens < 1:
        raise FuselmError(f"--max-tokens must be at least 1, got {max_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise FuselmError("sampling needs --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 0")
    path = Path(model_dir)
    sess = Session(path, backend=backend, device=device, fused=not no_fused_kernels, compile=compile, threads=threads,
                   **kv_options(**kv))
    tok = load_tokenizer(path, required=prompt is not None)
    ids = encode_prompt(tok, prompt, prompt_ids, chat)
    vocab = sess.meta.get("dims", {}).get("vocab")
    if vocab and any(not 0 <= i < vocab for i in ids):
        raise FuselmError(f"prompt ids must lie in [0, {vocab}); got {[i for i in ids if not 0 <= i < vocab][:5]}")
    stops = set() if ignore_eos else eos_ids(path, sess.meta, tok)
    rng = np.random.default_rng(seed)
    out = stream or sys.stdout
    console = Console(stderr=True, quiet=quiet)
    console.print(f"[dim]fuselm run: {sess.describe()}[/dim]")

    sess.reset(len(ids) + max_tokens)
    t0 = time.perf_counter()
    logits = _checked(sess.logits_to_numpy(sess.prefill(ids)), 0)
    t_prefill = time.perf_counter() - t0
    streamer = _Streamer(tok, out)
    generated: list[int] = []
    decode_times: list[float] = []
    token = sample(logits, temperature, top_k, top_p, rng)
    while True:
        generated.append(token)
        streamer.put(token)
        if token in stops or len(generated) >= max_tokens:
            break
        if profile and len(decode_times) == PROFILE_SKIP_TOKENS:
            sess.profiler.enabled = True
        t = time.perf_counter()
        logits = _checked(sess.logits_to_numpy(sess.decode(token)), len(generated))
        decode_times.append(time.perf_counter() - t)
        token = sample(logits, temperature, top_k, top_p, rng)
    out.write("\n")
    out.flush()
    text = tok.decode(generated, skip_special_tokens=True) if tok is not None else None
    result = {
        "tokens": generated, "text": text, "prompt_tokens": len(ids), "backend": sess.backend.name,
        "device": sess.backend.device, "prefill_tok_s": len(ids) / t_prefill if t_prefill else float("inf"),
        "decode_tok_s": len(decode_times) / sum(decode_times) if decode_times else None,
        "stopped_at_eos": bool(generated and generated[-1] in stops),
    }
    decode = f"{result['decode_tok_s']:.1f} tok/s" if decode_times else "n/a (one token)"
    console.print(f"[dim]prefill {len(ids)} tokens: {result['prefill_tok_s']:.1f} tok/s · decode "
                  f"{len(decode_times)} tokens: {decode}[/dim]")
    if profile:
        from .profile import report

        result["profile"] = report(sess, len(decode_times) - PROFILE_SKIP_TOKENS, console)
    return result
