"""What `fuselm.load` returns: one model on one engine, ready to generate and to score.

Every way of running a model goes through an Engine: `fuselm run`, `stream_generate`, `validate`, `eval`,
the benchmarks and the pipeline's ranks. An engine declares the options it honours (`HONOURS`, field ->
the values it takes, None for any); `load` refuses the others by name.

The steps beneath generation are the same on every engine: `reset(max_len)` empties the cache, `forward(ids, rows)`
appends tokens and gives the logits of the last `rows` of them, `rollback(n)` drops the last n tokens from the
cache, `verify(ids, greedy)` is forward's multi-token step as speculative decoding reads it. `generate` is each
engine's fast loop over them (tokens picked on the device, steps queued ahead); `score` and `trace` are the
teacher-forced and greedy runs eval and validate read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fuselm import contract
from fuselm.options import GENERATION, Options
from fuselm.reference import Trace

from ..step_runs import FINISH

SCORE_CHUNK = 512  # tokens per forward while scoring: the activations stay bounded


class Engine:
    name = "engine"
    device = "cpu"
    compute = "f32"  # the compute type of the graph's float32 values
    fixed_rows = False  # its multi-token steps are compiled per row count: speculation verifies k drafts every time
    HONOURS: dict[str, tuple | None] = GENERATION

    def __init__(self, source: Path, path: Path, options: Options, why: str | None = None):
        self.source, self.path, self.options, self.why = Path(source), Path(path), options, why
        self.meta: dict = {}
        if (self.path / contract.META_NAME).is_file():
            from fuselm.modeldir import read_meta

            self.meta = read_meta(self.path)
        self.drafters: dict = {}  # speculative decoding's drafters, kept across generations (a draft model loads once)
        self.speculation = None  # what speculation did in the last generation (speculative.Stats)
        self.step_seconds: dict[int, float] = {}  # speculation's measured step times by row count, kept across
        # generations: what a verification costs is the engine's on its device, not the prompt's

    # --- what it is ----------------------------------------------------------------------------
    def describe(self) -> str:
        """The engine, its device and how it runs, for the run's header and validate's title."""
        return self.name

    @property
    def vocab(self) -> int | None:
        return (self.meta.get("dims") or {}).get("vocab")

    # --- the steps -----------------------------------------------------------------------------
    def reset(self, max_len: int) -> None:
        """Empty the cache, with room for `max_len` tokens."""
        raise NotImplementedError

    def forward(self, ids: list[int], rows: int = 1) -> np.ndarray:
        """Append `ids` to the cache; the logits [rows, vocab] of the last `rows` of them (float32)."""
        raise NotImplementedError

    def verify(self, ids: list[int], greedy: bool) -> np.ndarray:
        """A speculative verification step: `ids` appended, and each one's next token as the target picks it
        greedily [len(ids)] (`greedy`: ids only, what the greedy rule reads), else its logits [len(ids), vocab]."""
        rows = self.forward(ids, rows=len(ids))
        return rows.argmax(axis=-1) if greedy else rows

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens of the cache (they are written over by the next forward)."""
        raise NotImplementedError(f"the {self.name} engine cannot roll its cache back")

    trimmable = True  # rollback works; else (a recurrent state) checkpoint / restore and run the kept tokens again

    def inexact(self, rows: int) -> str | None:
        """Why a step of `rows` tokens may give a row other logits than a one-token step would (greedy speculation
        may then part from plain decode at a near-tie); None where it gives each row the same numbers."""
        return None

    def checkpoint(self):
        """Where the cache stands, for `restore`."""
        raise NotImplementedError(f"the {self.name} engine cannot checkpoint its cache")

    def restore(self, saved) -> None:
        raise NotImplementedError(f"the {self.name} engine cannot restore its cache")

    # --- runs over them ------------------------------------------------------------------------
    def profiling(self, tokens: Iterator[int]) -> Iterator[int]:
        """A generation's `tokens` on this engine, timed by --profile after the first few where the engine has a
        profiler (its plain loop and speculative decoding's steps alike); here, as they are."""
        return tokens

    def generate(self, ids: list[int], max_new: int, sampler) -> Iterator[int]:
        """Prefill `ids`, then yield up to `max_new` tokens picked by `sampler` (the caller stops at eos)."""
        self.reset(len(ids) + max_new)
        yield from self.start(ids, max_new, sampler)

    def start(self, ids: list[int], n: int, sampler) -> Iterator[int]:
        """`generate` on a cache already reset: the token the prompt `ids` gives, then the n - 1 after it; closed
        early, as `continue_from`."""
        token = sampler.pick(self.forward(ids)[-1])
        if (yield token) == FINISH:
            return
        yield from self.continue_from(token, n - 1, sampler)

    def continue_from(self, token: int, n: int, sampler) -> Iterator[int]:
        """The n tokens after `token` (emitted, not yet fed): plain decode from where the cache stands. Closed
        early, a `trimmable` engine stands after the last token yielded (a speculative loop stops a plain run when
        drafting should resume). FINISH sent in: the token whose step is already running, then no more; here none
        runs ahead, so the run ends (NativeEngine's pipelined loop has one)."""
        for _ in range(n):
            token = sampler.pick(self.forward([token])[-1])
            if (yield token) == FINISH:
                return

    def score(self, ids: list[int]) -> np.ndarray:
        """Teacher-forced logits [len(ids), vocab]: row i predicts ids[i + 1]."""
        self.reset(len(ids))
        return np.concatenate([self.forward(ids[i:i + SCORE_CHUNK], rows=len(ids[i:i + SCORE_CHUNK]))
                               for i in range(0, len(ids), SCORE_CHUNK)])

    def trace(self, ids: list[int], n: int, force: list[int] | None = None) -> Trace:
        """Greedy tokens and the logits each came from; with `force`, step i is fed force[i] instead (two runs
        then see the same context, and their logits can be compared at every step)."""
        self.reset(len(ids) + n)
        trace = Trace()
        token = trace.add(self.forward(ids)[-1])
        for i in range(n - 1):
            token = trace.add(self.forward([force[i] if force is not None else token])[-1])
        return trace

    def close(self) -> None:
        """Let go of the model's memory now (one engine's weights at a time, in validate)."""
