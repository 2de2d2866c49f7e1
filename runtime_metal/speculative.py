"""Speculative decoding on any engine: draft k tokens cheaply, check them in one step of the target model.

Each step feeds the target its last token y and the drafts d1..dk as one run (Engine.forward with k + 1 rows of
logits: row i predicts what follows y, d1..di). Greedy: d_i is kept while it is the target's own argmax after
d1..d_{i-1}; the first row that disagrees (or the row after dk) gives the target's next token, so a step emits
the kept drafts plus one token, and the output is plain greedy decode's. Sampling: d_i is kept with probability
min(1, p(d_i) / q(d_i)) (q: the draft's distribution, a point mass for n-gram drafts), else the token is drawn from
max(0, p - q) renormalised: the standard rejection rule, so the output's distribution is the target's (Leviathan
et al. 2023). The target's cache then forgets the rejected drafts (Engine.rollback).

Drafters: `NgramDrafter` (prompt lookup: the tokens that followed the latest earlier occurrence of the text's last
n-gram, n = 3, 2, 1: rewriting, summarising or editing a passage given in the prompt repeats it), `ModelDrafter` (a
smaller fuselm model with the same tokenizer, run greedily or sampled, its cache kept in step with the target's).
Drafting turns itself off when it stays unprofitable: after WINDOW verification steps whose drafts were mostly
rejected, the rest of the run is plain decode (on the engine's own pipelined loop where it has one). A model with
recurrent state (its state holds every token fed, and cannot roll back) is checkpointed before each verification;
when a draft is rejected it is restored and the kept tokens run again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .sampling import probabilities

WINDOW = 8  # verification steps judged together
MIN_ACCEPTED = 0.5  # drafts kept per step over the window below which drafting stops
NGRAM = (3, 2, 1)  # n-gram lengths tried, longest first


@dataclass
class Stats:
    """What speculation did in one run."""

    method: str
    num_draft: int
    steps: int = 0  # verification steps of the target
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens produced by verification steps (kept drafts + the target's own)
    plain: int = 0  # tokens decoded without drafts (no draft found, or drafting off)
    off_at: int | None = None  # the token index where drafting turned itself off
    exact: bool = True  # the engine's multi-token steps give each row a one-token step's logits
    recent: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)

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
                "drafting_off_at": self.off_at, "exact": self.exact}

    def describe(self) -> str:
        acc = f"{self.acceptance:.0%} of {self.drafted} drafted tokens accepted" if self.drafted else "nothing drafted"
        tps = f"{self.tokens_per_step:.2f}" if self.tokens_per_step else "-"
        off = f"; drafting turned off at token {self.off_at} (drafts kept too rarely)" if self.off_at is not None else ""
        near = "" if self.exact else ("; this engine rounds a multi-token step otherwise than a one-token step (int8 "
                                      "activations), so greedy tokens may leave plain decode's at a near-tie")
        return f"speculative {self.method} (k={self.num_draft}): {acc}, {tps} tokens per target step{off}{near}"


class NgramDrafter:
    """Prompt lookup: the text's last n tokens found earlier in the prompt or the output; the k tokens that
    followed their latest earlier occurrence are the draft (no draft where no n-gram recurs)."""

    name = "ngram"

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, history: list[int], k: int) -> tuple[list[int], list | None]:
        h = np.asarray(history)
        for n in NGRAM:
            if len(h) <= n:
                continue
            tail = h[-n:]
            # windows of n tokens ending before the last one: starts 0 .. len - n - 1
            windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                draft = h[start:start + k].tolist()
                if draft:
                    return draft, None
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

    def start(self, prompt: list[int]) -> None:
        self.engine.reset(self.max_len)
        self.fed = 0  # the first proposal feeds the whole prompt

    def propose(self, history: list[int], k: int) -> tuple[list[int], list | None]:
        from .sampling import sample

        if len(history) - 1 > self.fed:  # catch up with the text the target accepted, all but its last token
            self.engine.forward(history[self.fed:-1])
        self.fed = len(history) - 1
        s = self.sampler
        if s.greedy:  # on the engine's own loop (MLX: the steps queued ahead, one read per token)
            tokens = list(self.engine.continue_from(history[-1], k, s))
            self.fed += k  # the last token and the first k - 1 drafts
            return tokens, None
        tokens, dists = [], []
        logits = self.engine.forward([history[-1]])[-1]
        self.fed += 1
        for i in range(k):
            dists.append(probabilities(logits, s.temperature, s.top_k, s.top_p))
            tokens.append(sample(logits, s.temperature, s.top_k, s.top_p, s.rng))
            if i + 1 < k:
                logits = self.engine.forward([tokens[-1]])[-1]
                self.fed += 1
        # the last draft was never fed: the draft's cache holds history + tokens[:-1]
        return tokens, dists

    def verified(self, kept: int, drafted: int, emitted: list[int]) -> None:
        """Forget the rejected drafts the draft model fed itself (it fed drafted - 1 of them)."""
        fed_drafts = drafted - 1
        back = fed_drafts - min(kept, fed_drafts)
        if back:
            self.engine.rollback(back)
        self.fed -= back

    def close(self) -> None:
        self.engine.close()


def drafter_for(options, sampler, max_len: int):
    """The drafter `options.speculative` names (a draft model loaded with the target's engine options)."""
    if options.speculative == "ngram":
        return NgramDrafter()
    from .engines import load

    engine = load(options.draft_model, options.replace(profile=False))  # (speculative: a loop that steps)
    return ModelDrafter(engine, sampler, max_len)


def generate(engine, ids: list[int], max_new: int, sampler, drafter, k: int, stats: Stats) -> Iterator[int]:
    """Prefill `ids` on `engine`, then yield up to `max_new` tokens, drafting `k` at a time (module docstring)."""
    engine.reset(len(ids) + max_new + k + 1)
    stats.exact = engine.batch_invariant
    drafter.start(ids)
    history = list(ids)
    rows = engine.forward(ids)
    y = _pick(rows[-1], sampler)
    history.append(y)
    yield y
    produced = 1
    while produced < max_new:
        left = max_new - produced
        if stats.off_at is not None:
            for token in engine.continue_from(y, left, sampler):
                stats.plain += 1
                yield token
            return
        draft, q = drafter.propose(history, min(k, left - 1)) if left > 1 else ([], None)
        if not draft:
            y = _pick(engine.forward([y])[-1], sampler)
            stats.plain += 1
            history.append(y)
            produced += 1
            yield y
            continue
        # an engine that compiles its verification step per row count gets k drafts every time (padded: the pad's
        # rows are read by no one, later rows never change earlier ones)
        pad = [draft[-1]] * (k - len(draft)) if engine.fixed_rows else []
        saved = None if engine.trimmable else engine.checkpoint()
        rows = engine.forward([y, *draft, *pad], rows=len(draft) + len(pad) + 1)
        kept, nxt = _verify(rows[:len(draft) + 1], draft, q, sampler)
        if saved is None:
            engine.rollback(len(draft) + len(pad) - kept)
        elif kept < len(draft) + len(pad):  # a recurrent state holds every draft: put it back, run the kept ones
            engine.restore(saved)
            engine.forward([y, *draft[:kept]])
        drafter.verified(kept, len(draft), draft[:kept] + [nxt])
        stats.steps += 1
        stats.drafted += len(draft)
        stats.accepted += kept
        stats.recent.append(kept)
        emitted = draft[:kept] + [nxt]
        stats.emitted += len(emitted)
        for token in emitted[:left]:
            history.append(token)
            produced += 1
            yield token
        y = emitted[-1]
        if len(stats.recent) == WINDOW and sum(stats.recent) / WINDOW < MIN_ACCEPTED:
            stats.off_at = produced


def _pick(logits: np.ndarray, sampler) -> int:
    from .sampling import sample

    return sample(logits, sampler.temperature, sampler.top_k, sampler.top_p, sampler.rng)


def _verify(rows: np.ndarray, draft: list[int], q: list | None, sampler) -> tuple[int, int]:
    """(drafts kept, the token after them) from the target's rows [k + 1, vocab]."""
    if sampler.greedy:
        target = rows.argmax(axis=-1)
        kept = 0
        while kept < len(draft) and int(target[kept]) == draft[kept]:
            kept += 1
        return kept, int(target[kept])
    rng = sampler.rng
    for i, d in enumerate(draft):
        p = probabilities(rows[i], sampler.temperature, sampler.top_k, sampler.top_p)
        qi = q[i] if q is not None else None
        q_d = 1.0 if qi is None else float(qi[d])
        if q_d > 0 and rng.random() < min(1.0, float(p[d]) / q_d):
            continue
        if qi is None:  # a point mass at d: the residual is p without d
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - qi, 0.0)
        total = residual.sum()
        if total <= 0:  # p == q: any draw from p is right
            residual, total = p, p.sum()
        return i, int(rng.choice(residual.size, p=residual / total))
    p = probabilities(rows[len(draft)], sampler.temperature, sampler.top_k, sampler.top_p)
    return len(draft), int(rng.choice(p.size, p=p))
