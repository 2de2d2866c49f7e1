"""Speculative decoding on any engine: draft k tokens cheaply, check them in one step of the target model.

Each step feeds the target its last token y and the drafts d1..dk as one run (Engine.verify: k + 1 rows of logits,
greedy their argmax alone; row i predicts what follows y, d1..di). Greedy: d_i is kept while it is the target's own
argmax after d1..d_{i-1}; the first row that disagrees (or the row after dk) gives the target's next token, so a
step emits the kept drafts plus one token, and the output is plain greedy decode's. Sampling: d_i is kept with
probability min(1, p(d_i) / q(d_i)) (q: the draft's distribution, a point mass for n-gram drafts), else the token is
drawn from max(0, p - q) renormalised: the standard rejection rule, so the output's distribution is the target's
(Leviathan et al. 2023). The target's cache then forgets the rejected drafts (Engine.rollback).

Drafters: `NgramDrafter` (prompt lookup: the tokens that followed the latest earlier occurrence of the text's last
n-gram, n = 3, 2, 1: rewriting, summarising or editing a passage given in the prompt repeats it), `ModelDrafter` (a
smaller fuselm model with the same tokenizer, run greedily or sampled, its cache kept in step with the target's).
How many tokens to draft is decided before every step (`Policy`): from the drafts' measured acceptance α (each draft
token kept with probability α, so k drafts yield (1 - α^(k+1)) / (1 - α) tokens) and the measured time of a step of
k + 1 tokens plus drafting k against a one-token step, the k that gives the most tokens per unit of time, or none
when no k beats a plain step by PAYS: drafting pauses while its drafts keep being rejected or cost too much (plain
tokens then run on the engine's own pipelined loop until drafting should resume, PLAIN_RUN at a time where the cache
cannot roll back what the loop queued ahead; n-gram drafts are still compared with them, so drafting resumes when
they start to match; after PROBE_EVERY plain tokens a paused drafter is tried again unless even drafts always kept
would not pay for the measured step, an n-gram drafter only if its shadow drafts would pay for a step measured twice
too dear, and each probe that does not resume drafting doubles the wait for the next). A plain token's time is a
run's steady one: its first token is timed apart, since a pipelined loop's first step waits for itself; what it
costs beyond a steady token is a restart, paid once for every stretch of drafting steps that stops a plain run, and
charged to the step that would start one in shares over the measured length of such stretches. Step times are the
engine's (Engine.step_seconds; key 0: the restart), kept across its generations. A model with recurrent state (its
state holds every token fed, and cannot roll back) is checkpointed before each verification; when a draft is
rejected it is restored and the kept tokens run again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fuselm import contract
from fuselm.errors import FuselmError

from .step_runs import FINISH

NGRAM = (3, 2, 1)  # n-gram lengths tried, longest first
DECAY = 0.9  # the weight of what was seen before a step, in the acceptance and timing estimates
PROBE_EVERY = 16  # plain tokens after which a paused drafter is tried again (doubled by each probe that fails)
PLAIN_RUN = 8  # plain tokens run at a time while drafting pauses, where the engine cannot stop a run anywhere
VOCAB_SLACK = 128  # ids a draft model's vocabulary may have more or fewer of than the model's (padding, added tokens)
PAYS = 1.25  # a drafting step must promise 25 % more tokens per second than a plain one (estimates are noisy)
STRETCH = 4.0  # verification steps expected of a stretch of drafting before any is measured (one pseudo-count)


@dataclass
class Stats:
    """What speculation did in one run."""

    method: str
    num_draft: int
    steps: int = 0  # verification steps of the target
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verification steps (kept drafts + the target's own)
    plain: int = 0  # tokens decoded without drafts (no draft found, or drafting paused)
    paused: int = 0  # steps the policy took without drafting (drafts not worth their cost)
    inexact: str | None = None  # why the engine's verification steps may not give a row a one-token step's logits
    greedy: bool = True  # (else sampling: what inexact rows move is the distribution a token is drawn from)
    step_s: dict | None = None  # the policy's step times by row count (seconds; 1: a plain token, 0: a restart)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float | None:
        steps = self.steps + self.plain
        return (self.emitted + self.plain) / steps if steps else None

    def as_dict(self) -> dict:
        return {"method": self.method, "num_draft": self.num_draft, "target_steps": self.steps + self.plain,
                "verification_steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "tokens_per_target_step": self.tokens_per_step,
                "paused_steps": self.paused, "exact": self.inexact is None,
                "step_ms": {rows: round(t * 1e3, 3) for rows, t in sorted((self.step_s or {}).items()) if rows},
                "restart_ms": round((self.step_s or {}).get(0, 0.0) * 1e3, 3)}

    def describe(self) -> str:
        acc = f"{self.acceptance:.0%} of {self.drafted} drafted tokens accepted" if self.drafted else "nothing drafted"
        tps = f"{self.tokens_per_step:.2f}" if self.tokens_per_step else "-"
        off = (f"; drafting paused for {self.paused} steps (no draft count paid for its verification at the measured "
               "acceptance and step times)") if self.paused else ""
        moves = ("greedy tokens may leave plain decode's where its top two logits are close" if self.greedy else
                 "the distributions tokens are drawn from may move by that much from plain decode's")
        near = "" if self.inexact is None else f"; {self.inexact}, so {moves}"
        return f"speculative {self.method} (k={self.num_draft}): {acc}, {tps} tokens per target step{off}{near}"


class NgramDrafter:
    """Prompt lookup: the text's last n tokens found earlier in the prompt or the output; the k tokens that
    followed their latest earlier occurrence are the draft (no draft where no n-gram recurs)."""

    name = "ngram"

    def __init__(self):
        self.after: dict[tuple, int] = {}  # an n-gram -> where the tokens after its latest occurrence start
        self.indexed = 0  # the history's length when last indexed

    def start(self, prompt: list[int]) -> None:
        self.after, self.indexed = {}, 0

    def propose(self, history: list[int], k: int) -> tuple[list[int], list | None]:
        # index the n-grams that end before the last token (a token follows each), in O(new tokens) per call
        for end in range(max(self.indexed, 1), len(history)):
            for n in NGRAM:
                if end >= n:
                    self.after[tuple(history[end - n:end])] = end
        self.indexed = len(history)
        for n in NGRAM:
            at = self.after.get(tuple(history[-n:])) if len(history) > n else None
            if at is not None:
                return list(history[at:at + k]), None
        return [], None

    def verified(self, kept: int, drafted: int, emitted: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafter:
    """A draft model (an Engine of its own, the same tokenizer): k tokens picked one by one from its logits (its
    distributions kept for the rejection rule when sampling); its cache follows the target's accepted text."""

    name = "draft"

    def __init__(self, engine, sampler, max_len: int):
        self.engine, self.sampler, self.max_len = engine, sampler, max_len
        self.fed = 0  # tokens of the history in the draft's cache
        self.saved = None  # (checkpoint, the tokens fed since) of a draft model with recurrent state (no rollback)

    def start(self, prompt: list[int]) -> None:
        self.engine.reset(self.max_len)
        self.engine.forward(prompt)  # beside the target's prefill, not inside the first draft's time
        self.fed = len(prompt)

    def propose(self, history: list[int], k: int) -> tuple[list[int], list | None]:
        if len(history) - 1 > self.fed:  # catch up with the text the target accepted, all but its last token
            self.engine.forward(history[self.fed:-1])
        self.fed = len(history) - 1
        s = self.sampler
        if s.greedy and self.engine.trimmable:  # on the engine's own loop (MLX: the steps queued ahead, one read
            tokens = list(self.engine.continue_from(history[-1], k, s))  # per token)
            self.fed += k  # the last token and the first k - 1 drafts
            return tokens, None
        # step by step: the distributions (sampling), or a recurrent state checkpointed before the drafts, which
        # it cannot roll back (`verified` restores it and feeds the kept ones again)
        state = None if self.engine.trimmable else self.engine.checkpoint()
        tokens, dists = [], []
        logits = self.engine.forward([history[-1]])[-1]
        self.fed += 1
        for i in range(k):
            if not s.greedy:
                dists.append(s.distribution(logits))
            tokens.append(s.pick(logits))
            if i + 1 < k:
                logits = self.engine.forward([tokens[-1]])[-1]
                self.fed += 1
        # the last draft was never fed: the draft's cache holds history + tokens[:-1]
        self.saved = None if state is None else (state, [history[-1], *tokens[:-1]])
        return tokens, dists or None

    def verified(self, kept: int, drafted: int, emitted: list[int]) -> None:
        """Forget the rejected drafts the draft model fed itself (it fed drafted - 1 of them)."""
        fed_drafts = drafted - 1
        back = fed_drafts - min(kept, fed_drafts)
        if back and self.saved is not None:
            state, fed = self.saved
            self.engine.restore(state)
            self.engine.forward(fed[:len(fed) - back])
        elif back:
            self.engine.rollback(back)
        self.fed -= back
        self.saved = None

    def close(self) -> None:
        self.engine.close()


class Policy:
    """How many drafts the next step verifies (module docstring): acceptance as decayed counts of kept and rejected
    draft tokens, step times as decayed means by row count, the length of a stretch of drafting steps as a decayed
    mean."""

    def __init__(self, k_max: int, fixed: bool, seconds: dict[int, float] | None = None):
        self.k_max, self.fixed = k_max, fixed  # fixed: the engine verifies k_max drafts every time (padded)
        self.kept = self.rejected = 0.0
        self.seconds = {} if seconds is None else seconds  # (an engine's, measured in its earlier generations)
        self.samples: dict[int, int] = {}
        self.draft_s = 0.0  # seconds per drafted token (a draft model's steps; n-gram lookups cost about none)
        self.stretch, self.stretches = STRETCH, 1.0  # decayed sum of verification steps per stretch, and count
        self.in_stretch = 0  # verification steps since the last plain run
        self.missed = 0  # probes in a row that did not resume drafting

    @property
    def alpha(self) -> float:
        return (self.kept + 0.375) / (self.kept + self.rejected + 0.5)  # a light prior of 0.75 while nothing is known

    def timed(self, rows: int, seconds: float) -> None:
        """A step of `rows` tokens took `seconds`; the first of each row count is not kept (it compiles, allocates)."""
        self.samples[rows] = self.samples.get(rows, 0) + 1
        if self.samples[rows] > 1:
            self._mean(rows, seconds)

    def plain(self, done: int, first: float, seconds: float, restarted: bool = True) -> None:
        """A plain run of `done` tokens took `seconds`, `first` of them to its first token: the steady time of a
        token from the others, the restart from the first (module docstring; `restarted` False: the run began
        with the prompt, whose token says nothing of a restart). A run of one token says neither, unless no plain
        time is known yet."""
        if done < 2:
            if 1 not in self.seconds and restarted:
                self.timed(1, seconds)
            return
        steady = (seconds - first) / (done - 1)
        self._mean(1, steady)
        if restarted:
            self.timed(0, max(0.0, first - steady))  # (the first run's first token may compile: not kept)
        if self.in_stretch:
            self.stretch = DECAY * self.stretch + self.in_stretch
            self.stretches = DECAY * self.stretches + 1
            self.in_stretch = 0

    def verified(self) -> None:
        self.in_stretch += 1

    def _mean(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None or seconds < old / 2 else DECAY * old + (1 - DECAY) * seconds

    def drafting(self, k: int, seconds: float) -> None:
        self.draft_s = DECAY * self.draft_s + (1 - DECAY) * seconds / k if self.draft_s else seconds / k

    def drafts(self, kept: int, drafted: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.rejected = DECAY * self.rejected + (kept < drafted)

    def cost(self, rows: int) -> float:
        """A step of `rows` tokens in one-token steps: measured, else read off the line through the measured ones
        (unmeasured: 1 + 0.1 per extra row, optimistic so that it gets measured); never more than a step of more
        rows measured (fewer rows could be padded to it: a time above it was an outlier, and a row count that is
        never chosen is never measured again)."""
        one = self.seconds.get(1)
        known = {r: t / one for r, t in self.seconds.items() if r > 1} if one else {}
        if rows == 1 or not known:
            return 1.0 + 0.1 * (rows - 1)
        if rows in known:
            cost = known[rows]
        else:
            r = max(known)
            cost = 1.0 + (known[r] - 1.0) * (rows - 1) / (r - 1)
        return min([cost, *(c for r, c in known.items() if r > rows)])

    def choose(self, left: int, stops_run: bool = False, scale: float = 1.0) -> int:
        """Drafts for the next step (0: a plain step), at most `left` - 1 (the step emits one more); `stops_run`:
        the step would stop a plain run (its share of the restart is charged); `scale`: the verification's measured
        time taken as this much of it."""
        if 1 not in self.seconds:
            return 0  # a plain step first: what drafting is weighed against
        best, k_best = PAYS, 0
        for k in self.ks:
            gain = self.gain(k, self.alpha, stops_run, scale)
            if gain > best:
                best, k_best = gain, k
        return min(k_best, left - 1)

    @property
    def ks(self) -> list[int]:
        """The draft counts a step may verify."""
        return [self.k_max] if self.fixed else list(range(1, self.k_max + 1))

    def gain(self, k: int, alpha: float, stops_run: bool = False, scale: float = 1.0) -> float:
        """Tokens per plain step's time of a step verifying k drafts each kept with probability `alpha`."""
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        return tokens / self.step_cost(k, stops_run, scale)

    def step_cost(self, k: int, stops_run: bool = False, scale: float = 1.0) -> float:
        """Drafting k tokens and verifying them, in plain steps (with `stops_run`, the restart's share)."""
        one = self.seconds.get(1)
        if not one:
            return self.cost(k + 1)
        restart = self.seconds.get(0, 0.0) * self.stretches / self.stretch if stops_run else 0.0
        return scale * self.cost(k + 1) + (k * self.draft_s + restart) / one

    def could_pay(self) -> bool:
        """Whether drafts that are always kept would pay for their cost (else a paused draft model is not probed),
        at a draft count a step may verify (an engine that pads to k_max pays k_max's step for any)."""
        return any(self.gain(k, 1.0, True) > PAYS for k in self.ks)

    @property
    def probe_every(self) -> int:
        """Plain tokens after which a paused drafter is tried again."""
        return PROBE_EVERY << min(self.missed, 6)

    def probed(self, resumed: bool) -> None:
        """A probe's verification ran; `resumed`: the policy now drafts again (else the next probe waits twice as
        long)."""
        self.missed = 0 if resumed else self.missed + 1


def drafter_for(options, sampler, max_len: int, target):
    """The drafter `options.speculative` names (a draft model loaded with the target's engine options, its tokens
    checked to be the `target` engine's before it loads)."""
    if options.speculative == "ngram":
        return NgramDrafter()
    from .engines import load

    if Path(options.draft_model).is_dir():  # (else `load` names what is missing)
        check_vocabulary(target, Path(options.draft_model))
    try:
        engine = load(options.draft_model, options.replace(profile=False))  # (speculative: a loop that steps)
    except FuselmError as e:
        raise FuselmError(f"--draft-model: {e}") from None
    return ModelDrafter(engine, sampler, max_len)


def check_vocabulary(target, draft: Path) -> None:
    """Refuse a draft model (its directory) whose token ids mean other tokens than the target's (its drafts would
    be another text's, rejected): the same token at every id both tokenizers have, and at most VOCAB_SLACK ids more
    or fewer (llama.cpp's rule); with a tokenizer missing, the graphs' vocabulary sizes alone."""
    from fuselm.modeldir import read_meta
    from fuselm.tokenizer import vocabulary

    fix = ("draft with a model of the same tokenizer: one converted from the same family's checkpoint (a smaller "
           "size, or the same checkpoint at a coarser quantization)")
    ours, theirs = vocabulary(target.source), vocabulary(draft)
    if ours is not None and theirs is not None:
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:
                raise FuselmError(f"--draft-model {draft}: its tokenizer is not the model's (id {i} is {b!r} "
                                  f"there, {a!r} in {target.source}); {fix}")
        sizes = len(ours), len(theirs)
    else:
        meta = read_meta(draft) if (draft / contract.META_NAME).is_file() else {}
        sizes = target.vocab, (meta.get("dims") or {}).get("vocab")
    if None not in sizes and abs(sizes[0] - sizes[1]) > VOCAB_SLACK:
        raise FuselmError(f"--draft-model {draft}: its vocabulary has {sizes[1]} tokens, the model's "
                          f"{sizes[0]}; {fix}")


def generate(engine, ids: list[int], max_new: int, sampler, drafter, k: int, stats: Stats) -> Iterator[int]:
    """Prefill `ids` on `engine`, then yield up to `max_new` tokens, drafting `k` at a time (module docstring)."""
    engine.reset(len(ids) + max_new + k + 1)
    stats.inexact, stats.greedy = engine.inexact(k + 1), sampler.greedy
    drafter.start(ids)
    history = list(ids)
    y: int | None = None  # the last token emitted, not yet fed (None: the prompt is not run yet)
    produced = 0
    policy = Policy(k, engine.fixed_rows, engine.step_seconds)
    stats.step_s = policy.seconds
    shadow: list[int] = []  # an n-gram draft not verified (paused): compared with the tokens plain decode gives
    since_probe = 0
    ran_plain = False  # the last step was a plain run (a drafting step now stops it: a restart to pay)
    probing = False
    while produced < max_new:
        left = max_new - produced
        want = policy.choose(left, ran_plain) if y is not None else 0  # (the first run prefills the prompt)
        if y is not None and not want and since_probe >= policy.probe_every and left > 1 and _probe(policy, drafter):
            want = min(k, left - 1)  # a paused drafter is tried again (an n-gram one whose shadow drafts match: a
            # verification step's time measured early may have been an outlier)
            probing = True
        elif probing:
            policy.probed(want > 0)
            probing = False
        t0 = time.perf_counter()
        draft, q = drafter.propose(history, want) if want else ([], None)
        if draft:
            policy.drafting(len(draft), time.perf_counter() - t0)
        if not draft:  # plain steps on the engine's own decode loop (on a GPU: the next step queued)
            ngram = isinstance(drafter, NgramDrafter)
            if 1 not in policy.seconds:
                n = PLAIN_RUN  # plain tokens timed first: what drafting is weighed against
            elif engine.trimmable:
                n = left  # a run the loop stops where drafting should resume (the engine rolls back what it queued)
            else:
                n = 1 if want else PLAIN_RUN if ngram else policy.probe_every - since_probe
            n, done, first = max(1, min(left, n)), 0, 0.0
            watch = policy.could_pay()  # else no draft is looked for until the run ends (none could pay)
            # the first run prefills the prompt on the engine's own loop too (on a GPU its first decode step is
            # queued while the prompt's token is read): a token sooner than a prefill step, then a run
            prefill = y is None
            run = engine.start(ids, n, sampler) if prefill else engine.continue_from(y, n, sampler)
            t0 = time.perf_counter()
            sent = None  # FINISH once drafting should resume: the run ends with the token its loop has queued
            try:
                while True:
                    try:
                        token = run.send(sent)
                    except StopIteration:
                        break
                    y = token
                    done += 1
                    first = first or time.perf_counter() - t0
                    if done > prefill:  # (the prompt's token is no decode step)
                        stats.plain += 1
                        stats.paused += not want and left > 1
                    since_probe += 1
                    if ngram:
                        if shadow and shadow[0] == y:
                            shadow.pop(0)
                            policy.drafts(1, 1)
                        elif shadow:
                            policy.drafts(0, 1)
                            shadow = []
                    history.append(y)
                    produced += 1
                    yield y
                    if ngram and not shadow and watch:
                        shadow = drafter.propose(history, k)[0]
                    if sent is None and watch and done < n and engine.trimmable and \
                            _resume(policy, drafter, shadow, since_probe, max_new - produced):
                        sent = FINISH  # (a pipelined loop's next step is on the device already: its token is
                        # plain decode's, and checks the shadow's first draft for free; an engine with none ends)
            finally:
                run.close()
            policy.plain(done, first, time.perf_counter() - t0, restarted=not prefill)
            ran_plain = True
            continue
        shadow, since_probe, ran_plain = [], 0, False
        # an engine that compiles its verification step per row count gets k drafts every time (padded: the pad's
        # rows are read by no one, later rows never change earlier ones)
        pad = [draft[-1]] * (k - len(draft)) if engine.fixed_rows else []
        saved = None if engine.trimmable else engine.checkpoint()
        fed = [y, *draft, *pad]
        t0 = time.perf_counter()
        rows = engine.verify(fed, sampler.greedy)
        policy.timed(len(fed), time.perf_counter() - t0)
        kept, nxt = _verify(rows[:len(draft) + 1], draft, q, sampler)
        if saved is None:
            engine.rollback(len(fed) - 1 - kept)
        elif kept < len(fed) - 1:  # a recurrent state holds every draft: put it back, run the kept ones
            engine.restore(saved)
            engine.forward([y, *draft[:kept]])
        drafter.verified(kept, len(draft), draft[:kept] + [nxt])
        policy.drafts(kept, len(draft))
        policy.verified()
        stats.steps += 1
        stats.drafted += len(draft)
        stats.accepted += kept
        emitted = draft[:kept] + [nxt]
        stats.emitted += len(emitted)
        for token in emitted[:left]:
            history.append(token)
            produced += 1
            yield token
        y = emitted[-1]


def _resume(policy: Policy, drafter, shadow: list[int], since_probe: int, left: int) -> bool:
    """Whether a plain run stops here for a drafting step: an n-gram draft is at hand that the policy would verify
    (or that a paused n-gram drafter probes, its shadow drafts matching); a paused draft model's probe is due."""
    if left < 2:
        return False
    if isinstance(drafter, NgramDrafter) and not shadow:
        return False
    return policy.choose(left, True) > 0 or since_probe >= policy.probe_every and _probe(policy, drafter)


def _probe(policy: Policy, drafter) -> bool:
    """Whether a paused drafter is tried again: only where drafts always kept would pay for the measured step
    (a device whose multi-token step costs many one-token steps never drafts). An n-gram drafter's shadow drafts
    measure its acceptance, so only the step's time can be wrong: it is probed where its drafts, matching as its
    shadow drafts do, would pay for a step that costs half the time measured (one measured high, an outlier)."""
    if isinstance(drafter, ModelDrafter):
        return policy.could_pay()
    return policy.alpha >= 0.5 and any(policy.gain(k, policy.alpha, True, 0.5) > PAYS for k in policy.ks)


def _verify(rows: np.ndarray, draft: list[int], q: list | None, sampler) -> tuple[int, int]:
    """(drafts kept, the token after them) from the target's rows (Engine.verify): its greedy picks [k + 1], or
    when sampling its logits [k + 1, vocab]."""
    if sampler.greedy:
        kept = 0
        while kept < len(draft) and int(rows[kept]) == draft[kept]:
            kept += 1
        return kept, int(rows[kept])
    rng = sampler.rng
    for i, d in enumerate(draft):
        p = sampler.distribution(rows[i])
        qi = None if q is None else _over(q[i], p.size)
        p_d = float(p[d]) if d < p.size else 0.0  # (a draft's id past the model's vocabulary: never its token)
        q_d = 1.0 if qi is None or d >= p.size else float(qi[d])
        if q_d > 0 and rng.random() < min(1.0, p_d / q_d):
            continue
        if qi is None:  # a point mass at d: the residual is p without d
            residual = p.copy()
            if d < p.size:
                residual[d] = 0.0
        else:
            residual = np.maximum(p - qi, 0.0)
        total = residual.sum()
        if total <= 0:  # p == q: any draw from p is right
            residual, total = p, p.sum()
        return i, int(rng.choice(residual.size, p=residual / total))
    p = sampler.distribution(rows[len(draft)])
    return len(draft), int(rng.choice(p.size, p=p))


def _over(q: np.ndarray, size: int) -> np.ndarray:
    """A draft's distribution over the model's `size` ids (vocabularies padded to other sizes: the ids one has and
    the other lacks hold no probability there)."""
    if q.size == size:
        return q
    return q[:size] if q.size > size else np.pad(q, (0, size - q.size))
