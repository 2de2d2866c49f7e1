"""A model ready to generate: graph + backend + preallocated KV cache, prefill and decode steps.

    sess = Session("qwen3-opt", backend="auto")
    sess.reset(max_len=256)
    logits = sess.prefill([1, 2, 3])      # chunked; logits of the last prompt token
    logits = sess.decode(next_token)      # one token; static shapes, one plan reused every step
    for token in sess.generate([1, 2, 3], 32, Sampler()):   # picked on the device, pipelined
        ...

The graph contract (fuselm/contract.py) is checked at load (loader.check_contract). The cache lives in
preallocated buffers (kvcache.py) where the graph only appends to it. Each decode step runs the strategy
(dynamic, checked, static, compiled) decoding.py chooses; `describe()` says what the last one ran.
Where the backend reads only the filled rows of the cache (`causal_reads`: MLX) and every Attention's
mask is a causal band (rewrites/causal_masks.py), the static plan's attentions read rows 0..pos (the window's last
rows) with no array mask, prefill chunks use mask="causal", and the compiled step compiles the pieces
between the attentions (compiled.py PiecewiseDecode): the attention shapes grow with the cache.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
from onnx import TensorProto

from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.options import Options

from . import kvcache, loader, rewrites
from . import state as state_mod
from .backends import make_backend
from .decoding import Decode, Decoding
from .executor import Executor, InFlight, Profiler
from .rewrites.causal_masks import causal_reads
from .step_runs import relay

CACHE_STEP = 256  # (as mlx-lm's KVCache grows)
_LONG_RUN = 64  # rows from which a lazy backend's run is queued a few layers at a time (executor.InFlight)

__all__ = ["Decode", "Session"]


class Session:
    """Loads a model directory or .onnx file onto a backend and runs prefill / decode steps."""

    def __init__(self, path: str | os.PathLike, options: Options | None = None, static_decode: bool = True,
                 **keywords):
        """`options` (fuselm.Options; `keywords` replace its fields): backend, device, dtype, threads, compile,
        fused_kernels and the KV cache's format."""
        options = Options.of(options, **keywords)
        self.kv_formats = kvcache.formats(options.kv)  # (key, value)
        self.lm = loader.load(path)
        self.meta = self.lm.meta or {}
        self.backend = make_backend(options.backend, options.device, dtype=options.dtype, threads=options.threads)
        self.prefill_chunk = options.prefill_chunk or self.backend.prefill_chunk  # prompt tokens per prefill step
        self.fused = fused = options.fused_kernels
        io = loader.check_contract(self.lm)
        self.first_input, self.output, self.caches = io.first, io.output, io.caches
        self.state = state_mod.RecurrentState(self.backend, io.states)
        try:
            self.graph = rewrites.prepare(self.lm, self.backend, fused, options.skip)
        except FuselmError:
            raise
        except Exception as e:  # load-time rewrites on attributes the checker lets through (a negative block size)
            raise FuselmError(f"{self.lm.path} cannot be prepared for the runtime ({type(e).__name__}: {str(e)[:300]}); "
                              "the graph is invalid, or uses an op in a form the runtime does not support") from e
        self.executor = Executor(self.graph, self.backend)
        self.in_place = kvcache.in_place(self.graph.nodes, {c.name for c in self.caches})
        kvcache.check_formats(self.backend, self.kv_formats, [c.head_dim for c in self.caches], self.in_place,
                              self.lm.path)
        self.window = int(self.meta["sliding_window"]) if self.meta.get("sliding_window") else None
        chunk = (self.meta.get("attention") or {}).get("chunk_size")  # Llama 4's chunked layers
        self.chunk = int(chunk) if chunk else None
        self.causal_reads = causal_reads(self.backend, self.graph, self.in_place, fused)
        self.executor.ctx["causal_reads"] = self.causal_reads  # the session's feeds are plain (rewrites/causal_masks.py)
        self.packed = kvcache.packed_pairs(self.caches, self.graph.nodes, self.causal_reads, self.kv_formats)
        self.profiler = self.executor.profiler = Profiler()
        self.max_len = self.pos = 0
        self.decoding = Decoding(self, static_decode, options.compile)
        self.threads = getattr(self.backend, "threads", None)

    # --- what ran (validate, bench, describe) ---------------------------------------------------
    @property
    def mode(self) -> Decode:
        """The mode of the last decode step (before any: of the next one)."""
        return (self.decoding.last or self.decoding.choose()).mode

    # the last step's strategy, as validate and the benches read it
    static_decode = property(lambda self: self.mode is not Decode.DYNAMIC)
    static_checked = property(lambda self: self.mode in (Decode.STATIC, Decode.COMPILED))
    compiled = property(lambda self: self.decoding.kept())  # the compiled step this cache length runs
    compile_failed = property(lambda self: self.decoding.failed)  # why compiling the step failed, if it did

    def _view(self, c: contract.CacheSpec, pos, seq: int, static: bool = False) -> kvcache.CacheView:
        return kvcache.view(self.buffers, c, self.packed, pos, seq, static)

    # --- state -----------------------------------------------------------------------------
    def reset(self, max_len: int) -> None:
        """Empty the cache and preallocate room for `max_len` tokens: where attention reads only the filled rows,
        rounded up to a multiple of CACHE_STEP, so that generations of about the same length reuse one compiled
        step (compiled steps are per cache length; the rows beyond are never read)."""
        max_len = int(max_len)
        if self.causal_reads:
            max_len = -(-max_len // CACHE_STEP) * CACHE_STEP
        self.max_len, self.pos = max_len, 0
        self.buffers = kvcache.allocate(self.backend, self.caches, self.kv_formats, self.packed,
                                        self.max_len if self.in_place else 0)
        self.state.reset()
        self.decoding.pos_dev = None  # (the last generation's compiled position)

    def _ids(self, ids):
        """Token ids as the graph's [1, n] int64 input: a list, or a device array (a picked token)."""
        if self.first_input == contract.HIDDEN:  # a stage's hidden state [1, n, hidden], as it came
            return ids
        if isinstance(ids, (list, tuple, np.ndarray)):
            return self.backend.asarray(np.asarray(ids, np.int64).reshape(1, -1))
        return self.backend.reshape(self.backend.cast(ids, TensorProto.INT64), (1, -1))

    def _run(self, ids, pos, mask, positions, views: dict, rows: int | None = 1) -> object:
        feeds = {self.first_input: self._ids(ids), contract.ATTENTION_MASK: mask, contract.POSITION_IDS: positions,
                 **views, **self.state.feeds()}
        self.executor.ctx.update(rope_offset=pos, logit_rows=rows)
        out = self.executor.run(feeds)
        self.buffers.update({n: v.buffer for n, v in views.items()} if self.in_place
                            else {c.name: out[c.present] for c in self.caches})
        self.state.update(out)
        return out[self.output]

    def prefill(self, ids: list[int], chunk: int | None = None, rows: int | None = 1):
        """Run the prompt in chunks; returns the logits of its last token (backend array [vocab]), or of its last
        `rows` tokens ([rows, vocab]; None: all of the last chunk's).

        Only those positions of each chunk go through the lm_head (graph.py's LastRows)."""
        chunk = chunk or self.prefill_chunk
        if not ids:
            raise FuselmError("the prompt is empty; pass --prompt text or --prompt-ids")
        self._room(len(ids), decode=False)
        logits = None
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            logits = self._step_dynamic(part, rows if rows is None or rows == 1 else min(rows, len(part)))
            if self.backend.lazy and start + chunk < len(ids):  # compute the cache, never these logits
                self.backend.sync([*self.buffers.values(), *self.state.arrays.values()])
        return logits

    def _room(self, n: int, decode: bool = True) -> None:
        """Refuse `n` more tokens where the cache has no room for them; size the threads for the step."""
        if self.pos + n > self.max_len:
            raise FuselmError(f"{self.pos + n} tokens exceed the cache ({self.max_len}); reset with a larger max_len")
        self.backend.set_threads(decode=decode)

    def _step_dynamic(self, part, rows: int | None = 1):
        b, pos = self.backend, self.pos
        hidden = self.first_input == contract.HIDDEN  # a stage's [1, s, hidden]; else ids or one picked token
        s = len(part) if isinstance(part, (list, tuple)) else (b.shape(part)[1] if hidden else 1)
        mask = b.asarray(np.ones((1, pos + s), np.int64))
        positions = b.asarray(np.arange(pos, pos + s, dtype=np.int64).reshape(1, -1))
        views = {c.name: self._view(c, pos, s) for c in self.caches} if self.in_place else dict(self.buffers)
        depth = b.inflight_layers if b.lazy and s >= _LONG_RUN else None
        self.executor.ctx["inflight"] = InFlight(b, depth) if depth else None
        try:
            logits = self._run(part, pos, mask, positions, views, rows)
        finally:
            self.executor.ctx["inflight"] = None
        self.pos += s
        if self.output == contract.NEXT_HIDDEN:  # every row goes on to the next stage
            return logits
        n = b.shape(logits)[1]
        if rows == 1:
            return b.slice(logits, (0, n - 1))  # [vocab]
        return b.slice(logits, (0, slice(n - min(rows or n, n), None)))  # [rows, vocab]

    def verify(self, ids: list[int]):
        """A few tokens at once after the cache (a speculative verification step): every row's logits [S, vocab],
        compiled where decoding.py can (Decoding.rows)."""
        self._room(len(ids))
        return self.decoding.rows(list(ids))

    def checkpoint(self):
        """Where the cache and the recurrent state stand now, for `restore` (a speculative step of a model with
        recurrent state: its state cannot roll back, it is put back and the kept tokens run again). Arrays are
        never written in place but the preallocated KV buffers, whose rows after the position nothing reads."""
        return self.pos, dict(self.buffers), self.state.snapshot()

    def restore(self, saved) -> None:
        self.pos, buffers, states = saved
        self.buffers = dict(buffers) if not self.in_place else self.buffers
        self.state.restore(states)

    def rollback(self, n: int) -> None:
        """Forget the last `n` tokens: in-place buffers are written over from the new position on (every read
        stops at the position, or is masked there); a cache kept as the graph's presents is cut."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot roll back {n} of {self.pos} cached tokens")
        if n and self.state:
            raise FuselmError(state_mod.NO_ROLLBACK)
        self.pos -= n
        if n and not self.in_place:
            b = self.backend
            self.buffers = {k: b.slice(v, (slice(None), slice(None), slice(0, self.pos))) for k, v in self.buffers.items()}

    def decode(self, token):
        """One decode step for `token` (an int, or a device array from `pick`); returns the logits of the
        new token (backend array [vocab]). The step runs the strategy decoding.py chooses."""
        self._room(1)
        return self.decoding.step([int(token)] if isinstance(token, (int, np.integer)) else token)

    # --- generation -------------------------------------------------------------------------------
    def generate(self, ids: list[int], max_new: int, sampler) -> Iterator[int]:
        """Prefill `ids`, then yield up to `max_new` tokens (the caller stops early at eos).

        Tokens are picked on the device and, on a lazy backend (MLX), the next step is queued before
        this token is read (mx.async_eval), so the host builds step n+1 while the device runs step n.
        The cache must have room: reset(len(ids) + max_new) first."""
        yield from self.decode_from(self.backend.pick_token(self.prefill(ids), sampler), max_new, sampler)

    def decode_from(self, first, n: int, sampler) -> Iterator[int]:
        """Yield `first` (a picked token on the device, not yet fed) and the n - 1 tokens decoded after it (FINISH
        sent in: the one already queued, then no more: StepQueue)."""
        b = self.backend
        steady = lambda: self.decoding.choose().mode is Decode.COMPILED  # noqa: E731 - (no host reads)
        steps = b.step_queue().run(first, lambda y: b.pick_token(self.decode(y), sampler), steady, n)
        count = itertools.count()

        def finite(token: int) -> None:
            i = next(count)
            if token < 0:
                raise FuselmError(f"the model produced NaN or infinite logits at step {i}; its weights or graph are "
                                  "broken (`fuselm validate` compares it with the checkpoint)")

        yield from relay(steps, finite)

    def logits_to_numpy(self, logits) -> np.ndarray:
        return np.asarray(self.backend.to_numpy(logits), dtype=np.float32).reshape(-1)

    def describe(self) -> str:
        """Backend, kernels and the decode strategy that ran last (before any step: the one that runs next)."""
        b = self.backend
        kind = {w.kind for n in self.graph.nodes if n.op_type == "QMatMul" for w in [n.attrs["weight"]]}
        extra = f", quantized matmul: {'/'.join(sorted(kind))}{b.matmul_note()}" if kind else ""
        ran = self.decoding.last or self.decoding.choose()
        mode = ran.describe()
        if self.causal_reads and ran.mode is not Decode.COMPILED:  # (the compiled pieces say so themselves)
            mode += ", attention over the filled rows (no mask at decode, causal at prefill)"
        dtype = f", {b.compute} compute" if b.compute != "f32" else ""
        mode += ", K and V in one buffer per layer" if self.packed else ""
        mode += f", {queued}" if (queued := b.step_queue().what) else ""
        kv = kvcache.describe(self.kv_formats, self.caches[0].dtype, self.caches[0].head_dim) if self.caches else "-"
        kv += f", {self.state.describe()}" if self.state else ""
        state = self.graph.prepared.split(" ")[0]
        prepared = f", prepared weights {state}" if state in ("read", "written") else ""
        return (f"{b.name} on {b.device} ({'fused kernels' if self.fused else 'no fused kernels'}, {mode}{dtype}{extra}, "
                f"KV cache {kv}{prepared})")
