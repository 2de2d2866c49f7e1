"""How one decode step runs (a strategy), and the one place that picks it (`Decoding.choose`).

  Dynamic   every step traced at its own shapes;
  Checked   the first static step, run dynamic and static and compared: graphs from other exporters may
            derive positions from shapes in ways static shapes break;
  Static    one plan over the whole preallocated cache, the same shapes every token, run op by op;
  Compiled  that plan as one compiled function, per cache length (its shapes are fixed): compiled.py's
            `CompiledDecode`, or `PiecewiseDecode` where attention reads only the filled rows (one for every
            cache length where its pieces take the buffers as they are: a new length builds nothing).

`choose` runs before every step, from what the session knows now:
  - dynamic where the cache cannot live in place, static decode is off, the check disagreed, or a
    sliding window or an attention chunk is shorter than the cache on a backend that reads the whole buffer
    (the band's mask is computed from the cache index, and static shapes would move the query to the end of
    the buffer; causal reads cut the band's rows themselves);
  - checked until a static step has agreed with dynamic decode;
  - static while the profiler times ops (a compiled step runs no ops to time), and on the step a
    compiled one is built from (kept only if it reproduces that step's logits);
  - compiled once a compiled step for this cache length exists.
Choosing before every step (a few comparisons) means a profiler switched on between two steps, a reset
to another cache length and a check's outcome all take effect at the next step, and nothing else picks
a path. What is learnt moves forward only (unchecked -> static or dynamic; a compile that failed is not
tried again). `describe()` tells what the last step ran.
"""

from __future__ import annotations

import enum

import numpy as np

from fuselm import contract, switches

from . import kvcache
from .compiled import CompiledDecode, PiecewiseDecode, agrees, static_feeds


class Decode(enum.Enum):
    DYNAMIC = "dynamic decode"
    CHECKING = "static-shape decode, checked on the first step"
    STATIC = "static-shape decode"
    COMPILED = "static-shape decode, compiled"


class Strategy:
    """One way to run a decode step of `decoding.sess`: `step(token)` -> logits [vocab], `describe()`."""

    mode: Decode

    def __init__(self, decoding: Decoding):
        self.decoding, self.sess = decoding, decoding.sess
        self.ran: Strategy = self  # what a step of this strategy turned out to run (Checked: its outcome)

    def describe(self) -> str:
        return self.mode.value


class Dynamic(Strategy):
    mode = Decode.DYNAMIC

    def __init__(self, decoding: Decoding, why: str):
        super().__init__(decoding)
        self.why = why

    def step(self, token):
        return self.sess._step_dynamic(token)

    def describe(self) -> str:
        return f"{self.mode.value} ({self.why})"


class Static(Strategy):
    """The static plan run eagerly; `build`: then compile it for this cache length from this step."""

    mode = Decode.STATIC

    def __init__(self, decoding: Decoding, build: bool = False, note: str = ""):
        super().__init__(decoding)
        self.build, self.note = build, note

    def step(self, token):
        before = self.sess.state.snapshot() if self.build else None  # (a compiled step starts from this step's state)
        ids, pos_dev, logits = self.eager(token)
        if self.build:
            self.decoding.build(ids, pos_dev, logits, before)
        self.sess.pos += 1
        return self.sess.backend.slice(logits, (0, 0))

    def eager(self, token, n: int = 1) -> tuple:
        """(ids, device position, logits [1, n, vocab]) of the step of `n` tokens at the session's position; the
        position is not moved on."""
        s = self.sess
        ids, pos_dev = s._ids(token), self.decoding.position()
        feeds = static_feeds(s.backend, ids, pos_dev, s.max_len, s.first_input, n)
        at = s.pos if s.causal_reads else pos_dev  # causal reads cut the filled rows at a host position
        views = {c.name: s._view(c, at, n, static=True) for c in s.caches}
        return ids, pos_dev, s._run(ids, pos_dev, feeds[contract.ATTENTION_MASK], feeds[contract.POSITION_IDS], views,
                                    n)

    def describe(self) -> str:
        return self.mode.value + self.note + self.decoding.compile_state()


class Compiled(Strategy):
    mode = Decode.COMPILED

    def __init__(self, decoding: Decoding, fn: CompiledDecode | PiecewiseDecode):
        super().__init__(decoding)
        self.fn = fn

    def step(self, token):
        s, pos = self.sess, self.sess.pos
        logits, nxt = _run_compiled(s, self.fn, token, self.decoding.position(), 1)
        self.decoding.pos_dev = (pos + 1, nxt) if nxt is not None else None
        return s.backend.slice(logits, (0, 0))

    def describe(self) -> str:
        return f"{self.mode.value}: {self.fn.what}"


class Checked(Strategy):
    """Runs the step dynamic, puts the cache rows back, runs it static and compares the logits: static
    decode is kept only if both agree; else the dynamic step's rows and logits stand."""

    mode = Decode.CHECKING

    def step(self, token):
        s, d, b, pos = self.sess, self.decoding, self.sess.backend, self.sess.pos
        dyn, state_before, _, keep_dynamic = _dynamic_then_rewind(s, token, 1)
        ids, pos_dev, logits = Static(d).eager(token)
        out = b.slice(logits, (0, 0))
        x, y = (np.asarray(b.to_numpy(v), np.float64) for v in (dyn, out))
        diff = float(np.abs(x - y).max())
        if not diff <= d.tolerance() * max(1.0, float(np.abs(x).max())):  # (NaN: not kept)
            d.static, d.why = False, f"static-shape decode differed from it by {diff:.3g} on the first step"
            self.ran = d.choose()
            return keep_dynamic()
        d.static = True
        self.ran = d.choose()  # the static strategy this cache length runs from now on
        if isinstance(self.ran, Static):
            self.ran.note += ", checked against dynamic decode on its first step"
            if self.ran.build:
                d.build(ids, pos_dev, logits, state_before)
        s.pos = pos + 1
        return out


class Decoding:
    """What the session has learnt about decoding its graph, and the strategy each step runs."""

    def __init__(self, sess, static: bool, compile: bool | None):
        self.sess = sess
        env = switches.setting("FUSELM_COMPILE")
        self.compile = (sess.backend.compile_default if env is None else env) if compile is None else bool(compile)
        self.static: bool | None = None if static and sess.in_place else False  # None: not checked yet
        self.why = "static-shape decode is off" if not static else \
            "the graph reads its cache with other ops than Attention/KVAppend, so the cache cannot live in place"
        # by cache length (None: a step whose shapes do not depend on it, PiecewiseDecode.any_length)
        self.compiled: dict[int | None, CompiledDecode | PiecewiseDecode] = {}
        self.failed: str | None = None  # why the compiled step was not kept
        self.last: Strategy | None = None  # what the last step ran
        self.pos_dev = None  # (position, the same as a device array) the compiled step handed back
        self.verifiers: dict[tuple[int | None, int], PiecewiseDecode | None] = {}  # (cache length, rows): None = not kept

    def choose(self) -> Strategy:
        s = self.sess
        if self.static is False:
            return Dynamic(self, self.why)
        if s.window is not None and s.max_len > s.window and not s.causal_reads:
            return Dynamic(self, f"the sliding window of {s.window} tokens is shorter than the cache ({s.max_len}): "
                                 "static shapes would shift its mask")
        if s.chunk is not None and s.max_len > s.chunk and not s.causal_reads:
            return Dynamic(self, f"the attention chunk of {s.chunk} tokens is shorter than the cache ({s.max_len}): "
                                 "static shapes would shift its mask")
        if self.static is None:
            return Checked(self)
        if s.profiler.enabled:
            return Static(self, note=", eager while the profiler times its ops")
        fn = self.kept()
        if fn is not None:
            return Compiled(self, fn)
        return Static(self, build=self.compile and self.failed is None)

    def step(self, token):
        strategy = self.choose()
        out = strategy.step(token)
        self.last = strategy.ran
        return out

    def rows(self, ids: list[int]):
        """A step of several tokens at the session's position (a speculative verification), every row's logits
        [S, vocab]: where attention reads the filled rows (MLX) and static decode holds, as compiled pieces for
        this cache length and row count, built from an eager static step once its rows agree with a dynamic
        step's; elsewhere (and on that first step) the dynamic step."""
        s = self.sess
        key = (s.max_len, len(ids))
        fn = self.verifier(len(ids))
        if fn is not None:
            return s.backend.slice(_run_compiled(s, fn, ids, self.position(), len(ids))[0], (0,))
        # (static decode unchecked yet is fine: the build checks its own rows against a dynamic step's)
        if key in self.verifiers or not (s.causal_reads and self.static is not False and self.compile
                                         and not s.profiler.enabled):
            return s._step_dynamic(ids, len(ids))
        self.verifiers[key] = None  # one try per shape
        return self._build_rows(ids)

    def _build_rows(self, ids: list[int]):
        s, b, n, pos = self.sess, self.sess.backend, len(ids), self.sess.pos
        dyn, state_before, state_after, dynamic = _dynamic_then_rewind(s, ids, n)
        token, pos_dev, eager = Static(self).eager(ids, n)
        plan = s.executor.plan_for({**static_feeds(b, token, pos_dev, s.max_len, s.first_input, n),
                                    **{c.name: s._view(c, pos, n, static=True) for c in s.caches}, **s.state.feeds()})
        tol = self.tolerance()
        if plan is None or not agrees(b, dyn, b.slice(eager, (0,)), tol):
            return dynamic()
        fn = PiecewiseDecode(s, plan, s.max_len, rows=n)
        bufs = [s.buffers[c.name] for c in s.caches]
        try:
            fn.build((token, pos_dev, *bufs))
            logits, _, bufs, states = fn(token, pos_dev, bufs, s.state.ordered(state_before))
        except Exception:  # noqa: BLE001 - a compiler failure leaves verification on the dynamic step
            return dynamic()
        if not (agrees(b, dyn, b.slice(logits, (0,)), tol) and _close(b, s.state.ordered(state_after), states, tol)):
            return dynamic()
        del self.verifiers[(s.max_len, n)]  # (the try's marker; the step is filed for every length where it can be)
        self.verifiers[(None if fn.any_length else s.max_len, n)] = fn
        s.buffers = {c.name: buf for c, buf in zip(s.caches, bufs, strict=True)}
        s.state.put(states)
        s.pos = pos + n
        return dyn

    def kept(self):
        """The compiled decode step for the session's cache length, or one that serves every length."""
        return self.compiled.get(self.sess.max_len) or self.compiled.get(None)

    def verifier(self, rows: int):
        """The compiled verification step of `rows` tokens for the session's cache length, or for every length."""
        return self.verifiers.get((self.sess.max_len, rows)) or self.verifiers.get((None, rows))

    def position(self):
        """The session's position as a 0-d device integer (the one the compiled step handed back, if it is this one)."""
        s = self.sess
        if self.pos_dev is not None and self.pos_dev[0] == s.pos:
            return self.pos_dev[1]
        return s.backend.asarray(np.array(s.pos, np.int64))

    def tolerance(self) -> float:
        return self.sess.backend.drift_tolerance([n.attrs["weight"] for n in self.sess.graph.nodes
                                                  if n.op_type == "QMatMul"])

    def compile_state(self) -> str:
        if not self.compile:
            return ""
        if self.failed is not None:
            return f", compile failed ({self.failed})"
        return ", run eagerly while its compiled step was built" if self.kept() is not None else \
            ", compiles on the next static step"

    def build(self, ids, pos_dev, eager_logits, state_before: dict) -> None:
        """Compile the static step with this step's inputs (`state_before`: the recurrent states it started from;
        the session's are the eager step's presents); keep it only if it reproduces the eager logits and states.

        Re-running the step is harmless: it writes the same keys and values into the same cache rows, and its
        present states are compared, not kept."""
        s, b = self.sess, self.sess.backend
        feeds = static_feeds(b, ids, pos_dev, s.max_len, s.first_input)
        plan = s.executor.plan_for({**feeds, **{c.name: s._view(c, pos_dev, 1, static=True) for c in s.caches},
                                    **s.state.feeds()})
        if plan is None:
            self.failed = "the static step's plan is not kept (FUSELM_DEBUG / FUSELM_LIMIT, or a value-dependent op)"
            return
        fn = (PiecewiseDecode if s.causal_reads else CompiledDecode)(s, plan, s.max_len)
        bufs, states = [s.buffers[c.name] for c in s.caches], s.state.ordered(state_before)
        try:
            fn.build((ids, pos_dev, *states, *bufs))
            logits, _, _, presents = fn(ids, pos_dev, bufs, states)
        except Exception as e:  # noqa: BLE001 - a compiler failure must not stop generation
            self.failed = f"{type(e).__name__}: {e}"[:300]
            return
        tol = self.tolerance()
        if not agrees(b, eager_logits, logits, tol=tol):
            d = np.abs(np.asarray(b.to_numpy(eager_logits), np.float64) - np.asarray(b.to_numpy(logits), np.float64))
            self.failed = f"compiled logits differ from the eager step by {d.max():.3g}"
            return
        if not _close(b, s.state.values(), presents, tol):
            self.failed = "the compiled step's recurrent states differ from the eager step's"
            return
        self.compiled[None if fn.any_length else s.max_len] = fn


def _close(b, want: list, got: list, tol: float) -> bool:
    """Every array within `tol` of its largest magnitude (at least 1): recurrent states, which no argmax checks."""
    for w, g in zip(want, got, strict=True):
        x, y = (np.asarray(b.to_numpy(v), np.float64) for v in (w, g))
        if not np.allclose(x, y, atol=tol * max(1.0, float(np.abs(x).max())), rtol=0):
            return False
    return True


def _run_compiled(s, fn, ids, pos_dev, n: int):
    """A compiled step of `n` tokens at the session's position, its buffers and states kept; (logits, next position)."""
    logits, nxt, bufs, states = fn(s._ids(ids), pos_dev, [s.buffers[c.name] for c in s.caches], s.state.values())
    s.buffers = {c.name: buf for c, buf in zip(s.caches, bufs, strict=True)}
    s.state.put(states)
    s.pos += n
    return logits, nxt


def _dynamic_then_rewind(s, ids, n: int):
    """Run the step of `n` tokens dynamic, then put the cache rows, state and position back; (its logits, the state
    before, the state after, `keep`: puts the dynamic step's rows, state and position back and returns its logits)."""
    pos = s.pos
    before, state_before = _rows(s, pos, n), s.state.snapshot()
    dyn = s._step_dynamic(ids, n)
    after, state_after = _rows(s, pos, n), s.state.snapshot()

    def keep():
        _put(s, after, state_after, pos + n)
        return dyn

    _put(s, before, state_before, pos)
    return dyn, state_before, state_after, keep


def _rows(s, pos: int, n: int) -> dict:
    """A host copy of the cache rows the step of `n` tokens at `pos` writes (kvcache.snapshot), one per buffer."""
    return {k: kvcache.snapshot(s.backend, v, pos, pos + n) for k, v in s.buffers.items() if k not in s.packed}


def _put(s, rows: dict, state, pos: int) -> None:
    """Cache rows (`_rows`), the recurrent state and the position put back."""
    s.buffers = {**s.buffers, **{k: kvcache.restore(s.backend, s.buffers[k], v) for k, v in rows.items()}}
    s.buffers.update({v: s.buffers[k] for v, k in s.packed.items()})  # a packed pair: one buffer again
    s.state.restore(state)
    s.pos = pos
