"""fuselm's own executor over a backend (MLX, torch, numpy): the graph's op table run by runtime_metal.Session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fuselm.options import GENERATION, Options

from ..step_runs import relay
from .base import Engine

PROFILE_SKIP_TOKENS = 3  # compilation and warm-up happen in the first decode steps
VERIFY_ROWS = 16  # a step of at most this many tokens after the prompt is a speculative verification


class NativeEngine(Engine):
    """The model directory (or .onnx file) on runtime_metal's Session: every option is honoured."""

    HONOURS = {**GENERATION, **{name: None for name in ("device", "dtype", "threads", "compile", "fused_kernels", "kv",
                                                        "prefill_chunk", "profile", "skip")}}

    def __init__(self, source: Path, options: Options, why: str | None = None):
        from ..session import Session

        super().__init__(source, source, options, why)
        self.session = Session(source, options)
        self.meta = self.session.meta
        b = self.session.backend
        self.name, self.device, self.compute = b.name, b.device, b.compute
        self.profiled = 0  # decode tokens the profiler timed

    def describe(self) -> str:
        return self.session.describe()

    def inexact(self, rows: int) -> str | None:
        return self.session.backend.inexact(rows)

    @property
    def fixed_rows(self) -> bool:
        return self.session.causal_reads  # Decoding.rows compiles a verification step per cache length and rows

    def reset(self, max_len: int) -> None:
        self.session.reset(max_len)

    def forward(self, ids: list[int], rows: int = 1) -> np.ndarray:
        s = self.session
        if len(ids) == 1 and rows == 1 and s.pos > 0:  # a decode step: the static / compiled strategies
            return s.logits_to_numpy(s.decode(int(ids[0])))[None]
        if self._verifies(ids, rows):  # a verification step: compiled where it can be
            return np.asarray(s.backend.to_numpy(s.verify(ids)), np.float32).reshape(rows, -1)
        chunk, out = s.prefill_chunk, []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            want = min(len(part), rows - (len(ids) - start - len(part)))  # of the last `rows`, those in this part
            logits = s.prefill(part, chunk=chunk, rows=max(want, 1))
            if want > 0:
                out.append(np.asarray(s.backend.to_numpy(logits), np.float32).reshape(want, -1))
        return np.concatenate(out)

    def _verifies(self, ids: list[int], rows: int) -> bool:
        """Whether a step of `ids` giving `rows` rows is a speculative verification (Session.verify)."""
        return 1 < len(ids) == rows <= VERIFY_ROWS and self.session.pos > 0

    def verify(self, ids: list[int], greedy: bool) -> np.ndarray:
        """Greedy: the rows' argmax taken on the device, so that only the ids come back to the host."""
        s = self.session
        if not greedy or not self._verifies(ids, len(ids)):
            return super().verify(ids, greedy)
        b = s.backend
        picks = b.arg_reduce("max", b.reshape(s.verify(ids), (len(ids), -1)), 1, False)
        return np.asarray(b.to_numpy(picks)).reshape(-1)

    def rollback(self, n: int) -> None:
        self.session.rollback(n)

    @property
    def trimmable(self) -> bool:
        return not self.session.state  # a recurrent state cannot roll back: speculation restores and replays

    def checkpoint(self):
        return self.session.checkpoint()

    def restore(self, saved) -> None:
        self.session.restore(saved)

    def generate(self, ids: list[int], max_new: int, sampler) -> Iterator[int]:
        """Tokens picked on the device, the next step queued while this one is read (Session.generate); with
        --profile the profiler times the decode steps after the first few."""
        self.session.reset(len(ids) + max_new)
        yield from self.profiling(self.session.generate(ids, max_new, sampler))

    def profiling(self, tokens: Iterator[int]) -> Iterator[int]:
        self.profiled = 0
        if not self.options.profile:
            return tokens
        return self._profiled(tokens)

    def _profiled(self, tokens: Iterator[int]) -> Iterator[int]:
        for n, token in enumerate(tokens):
            if n == PROFILE_SKIP_TOKENS - 1:  # (on the pipelined loop the step after this token is queued already)
                self.session.profiler.enabled = True
            self.profiled = max(0, n - PROFILE_SKIP_TOKENS)
            yield token

    def continue_from(self, token: int, n: int, sampler) -> Iterator[int]:
        """The n tokens after `token` (emitted, not yet fed) on the session's pipelined decode loop; FINISH sent in:
        the token whose step is queued already, then no more; closed early, the steps it queued beyond the last
        token yielded are rolled back (where the cache can)."""
        s = self.session
        steps = self._trimmed(s.decode_from(s.backend.asarray(np.array([token], np.int64)), n + 1, sampler), s.pos)
        next(steps)  # `token` itself
        yield from steps

    def start(self, ids: list[int], n: int, sampler) -> Iterator[int]:
        """The prompt's token and the n - 1 after it on the pipelined loop (its first decode step queued while the
        prompt's token is read), closed early as `continue_from`."""
        yield from self._trimmed(self.session.generate(ids, n, sampler), self.session.pos + len(ids))

    def _trimmed(self, steps: Iterator[int], at: int) -> Iterator[int]:
        """`steps`' tokens, each fed before the next is picked, from a cache holding `at` positions when the first
        comes: closed early, what the loop queued beyond the last token yielded is rolled back (where it can)."""
        s, fed = self.session, -1

        def count(t: int) -> None:
            nonlocal fed
            fed += 1  # (the token before `t` has been fed)

        try:
            yield from relay(steps, count)
        finally:
            steps.close()
            if fed >= 0 and s.pos > at + fed and self.trimmable:
                s.rollback(s.pos - at - fed)

    def report(self, console) -> dict | None:
        """The --profile table of the last generation, printed; None without --profile."""
        if not self.options.profile:
            return None
        from ..profile import report

        spec = self.speculation
        what = None if spec is None else f"speculative {spec.method}: plain and verification steps"
        return report(self.session, self.profiled, console, what)

    def close(self) -> None:
        self.session = None
