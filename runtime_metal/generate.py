"""`fuselm run` and `stream_generate`: text from a loaded engine, streamed token by token.

Both take the engine `fuselm.load` returns (or load one), so the Python iterator and the command line run
the same loop on the same engine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from fuselm.errors import FuselmError
from fuselm.options import Options
from fuselm.tokenizer import Detokenizer, encode_prompt, eos_ids, load_tokenizer

from .engines import Engine, load
from .sampling import Sampler


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


def engine_for(model, options: Options | None, keywords: dict) -> Engine:
    """`model` itself when it is a loaded engine (keywords then name nothing to change), else `load`'s engine."""
    if isinstance(model, Engine):
        if keywords or options is not None and options != model.options:
            opts = Options.of(options, **keywords)
            engine_keys = set(opts.given()) - set(Engine.HONOURS)
            if any(getattr(opts, k) != getattr(model.options, k) for k in engine_keys):
                raise FuselmError(f"the engine is loaded already; {', '.join(sorted(engine_keys))} are chosen at "
                                  "`fuselm.load`: pass them there")
        return model
    return load(model, options, **keywords)


def stream_generate(model, prompt=None, options: Options | None = None, chat: bool = False,
                    **keywords) -> Iterator[Response]:
    """Generate from `model` (an engine from `fuselm.load`, or a model directory), one Response per token.
    `prompt`: text, or a list of token ids; `options` (keywords replace its fields): sampling, max_tokens,
    ignore_eos; the engine's own options where `model` is a directory."""
    engine = engine_for(model, options, keywords)
    opts = engine.options.replace(**{k: v for k, v in Options.of(options, **keywords).given().items()
                                     if k in Engine.HONOURS})
    sampler = Sampler(opts.temperature, opts.top_k, opts.top_p, opts.seed)
    tok = load_tokenizer(engine.source, required=isinstance(prompt, str), chat=chat)
    ids = encode_prompt(tok, prompt, chat)
    vocab = engine.vocab
    if vocab and any(not 0 <= i < vocab for i in ids):
        raise FuselmError(f"prompt ids must lie in [0, {vocab}); got {[i for i in ids if not 0 <= i < vocab][:5]}")
    stops = set() if opts.ignore_eos else eos_ids(engine.source, engine.meta, tok)
    detok = Detokenizer(tok)
    t0 = time.perf_counter()
    t_first = None
    for n, token in enumerate(_tokens(engine, ids, opts, sampler)):
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        done = "stop" if token in stops else ("length" if n + 1 >= opts.max_tokens else None)
        text = "" if done == "stop" else detok.add(token)  # the end-of-turn token is not text
        yield Response(token, text, len(ids), len(ids) / max(t_first - t0, 1e-9), n + 1,
                       n / (now - t_first) if n else None, done)
        if done:
            return


def _tokens(engine: Engine, ids: list[int], opts: Options, sampler) -> Iterator[int]:
    """The engine's own generation loop, or speculative decoding over its steps (runtime_metal/speculative.py)."""
    engine.speculation = None
    if not opts.speculative:
        return engine.generate(ids, opts.max_tokens, sampler)
    from . import speculative

    key = (opts.speculative, opts.draft_model)
    max_len = len(ids) + opts.max_tokens + opts.num_draft + 1  # (the cache's room: a verification's k + 1 rows too)
    if key not in engine.drafters:
        engine.drafters[key] = speculative.drafter_for(opts, sampler, max_len, engine)
    drafter = engine.drafters[key]
    if isinstance(drafter, speculative.ModelDrafter):
        drafter.sampler, drafter.max_len = sampler, max_len
    engine.speculation = speculative.Stats(opts.speculative, opts.num_draft)
    return engine.profiling(speculative.generate(engine, ids, opts.max_tokens, sampler, drafter, opts.num_draft,
                                                 engine.speculation))


def run(model, prompt=None, options: Options | None = None, chat: bool = False, stream=None, quiet: bool = False,
        **keywords) -> dict:
    """Generate up to `max_tokens` tokens after the prompt, printing them as they come; returns the generated
    ids, the text, prefill and decode tokens per second and what ran."""
    from rich.console import Console

    engine = engine_for(model, options, keywords)
    out = stream or sys.stdout
    console = Console(stderr=True, quiet=quiet)
    why = engine.why
    console.print(f"[dim]fuselm run: {engine.describe()}{f' · {why}' if why else ''}[/dim]")
    generated, last = [], None
    for r in stream_generate(engine, prompt, options, chat, **keywords):
        generated.append(r.token)
        out.write(r.text)
        out.flush()
        last = r
    out.write("\n")
    out.flush()
    tok = load_tokenizer(engine.source, required=False) if isinstance(prompt, str) else None
    text = tok.decode(generated, skip_special_tokens=True) if tok is not None else None
    decode_n = last.generation_tokens - 1
    result = {
        "tokens": generated, "text": text, "prompt_tokens": last.prompt_tokens, "backend": engine.name,
        "device": engine.device, "dtype": engine.compute, "prefill_tok_s": last.prompt_tps, "decode_tok_s": last.generation_tps,
        "stopped_at_eos": last.finish_reason == "stop", "what": engine.describe(), "why": why,
    }
    decode = f"{result['decode_tok_s']:.1f} tok/s" if decode_n else "n/a (one token)"
    console.print(f"[dim]prefill {last.prompt_tokens} tokens: {result['prefill_tok_s']:.1f} tok/s (to the first token) "
                  f"· decode {decode_n} tokens: {decode} · {engine.describe()}[/dim]")
    if engine.speculation is not None:
        result["speculative"] = engine.speculation.as_dict()
        console.print(f"[dim]{engine.speculation.describe()}[/dim]")
    report = getattr(engine, "report", None)
    if report is not None and (profile := report(console)) is not None:
        result["profile"] = profile
    return result
