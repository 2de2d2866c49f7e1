"""Speculative decoding (runtime_metal/speculative.py) on every engine: greedy tokens identical to plain decode with
n-gram and draft-model drafts, f32 and q4; the rejection rule keeps the target's distribution; drafting turns itself
off when its drafts are rejected; the CLI's flags and summary."""

from __future__ import annotations

import io
import itertools
import time

import numpy as np
import pytest
from fuselm.runtime_metal import speculative
from fuselm.runtime_metal.sampling import Sampler, probabilities

import fuselm
from fuselm.cli import main

PROMPT = [5, 9, 2, 7, 11, 3, 5, 9, 2, 7]  # recurring n-grams: prompt lookup has something to find
TOKENS = 24


def _run(model, quiet=True, **kw):
    return fuselm.run(model, PROMPT, max_tokens=TOKENS, ignore_eos=True, quiet=quiet, stream=io.StringIO(), **kw)


@pytest.mark.parametrize("backend,quant", [("torch", "f32"), ("torch", "q4"), ("numpy", "q4"), ("mlx", "f32"),
                                           ("onnxruntime", "f32"), ("onnxruntime", "q4")])
def test_greedy_ngram_equals_plain_decode(drafting, optimized, backend, quant):
    model = optimized("qwen3", quant)
    plain = _run(model, backend=backend)
    spec = _run(model, backend=backend, speculative="ngram", num_draft=3)
    assert spec["tokens"] == plain["tokens"]
    s = spec["speculative"]
    assert s["verification_steps"] > 0 and s["target_steps"] < TOKENS, s  # it drafted, and saved target steps


def test_greedy_on_the_prepared_lowered_copy(drafting, optimized, tmp_path, monkeypatch):
    """auto's onnxruntime copy keeps only the last logits_to_keep rows: a verification step asks for k + 1."""
    import shutil

    monkeypatch.setenv("FUSELM_PREPARED", "1")
    monkeypatch.setattr("fuselm.runtime_metal.engines.auto.gpu", lambda: None)
    model = tmp_path / "m"
    shutil.copytree(optimized("qwen3", "q4"), model)
    plain = _run(model)
    spec = _run(model, speculative="ngram")
    assert "lowered for it" in spec["why"] and spec["tokens"] == plain["tokens"]
    assert spec["speculative"]["verification_steps"] > 0


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_a_plain_run_closed_early_stands_after_its_last_token(optimized, backend):
    """The pipelined loop queues steps ahead of the token it yields: a run the speculative loop stops early leaves
    the cache after the last token yielded, so decoding on from there gives plain decode's tokens."""
    engine = fuselm.load(optimized("qwen3", "f32"), backend=backend)
    plain = list(engine.generate(PROMPT, 12, Sampler()))
    engine.reset(len(PROMPT) + 12)
    first = int(engine.forward(PROMPT)[-1].argmax())
    run = engine.continue_from(first, 10, Sampler())
    got = [first, next(run), next(run), next(run)]
    run.close()
    assert engine.session.pos == len(PROMPT) + 3  # fed: the prompt, first and the two tokens after it
    got += list(engine.continue_from(got[-1], 8, Sampler()))
    assert got == plain
    for stop in (1, 3):  # a run that starts with the prompt (its first decode step queued), stopped the same way
        engine.reset(len(PROMPT) + 12)
        run = engine.start(PROMPT, 12, Sampler())
        got = [next(run) for _ in range(stop)]
        run.close()
        assert engine.session.pos == len(PROMPT) + stop - 1
        got += list(engine.continue_from(got[-1], 12 - stop, Sampler()))
        assert got == plain


@pytest.mark.parametrize("backend,thread", [("torch", "0"), ("mlx", "0"), ("mlx", "1"), ("onnxruntime", "0")])
def test_a_finished_run_gives_its_queued_token(optimized, backend, thread, monkeypatch):
    """FINISH sent into a plain run: a pipelined loop (fuselm's engines; MLX with and without its build thread)
    gives the token whose step it had queued, plain decode's, and ends with the cache after it; onnxruntime's steps
    run one at a time, so its run ends at once. Decoding on from there gives plain decode's tokens."""
    from fuselm.runtime_metal.step_runs import FINISH

    monkeypatch.setenv("FUSELM_BUILD_THREAD", thread)
    engine = fuselm.load(optimized("qwen3", "f32"), backend=backend, speculative="ngram")  # (onnxruntime: its
    plain = list(engine.generate(PROMPT, 12, Sampler()))  # loop that steps)
    engine.reset(len(PROMPT) + 12)
    run = engine.start(PROMPT, 12, Sampler())
    got = [next(run), next(run)]
    if backend == "onnxruntime":
        with pytest.raises(StopIteration):
            run.send(FINISH)
    else:
        got.append(run.send(FINISH))
        with pytest.raises(StopIteration):
            next(run)
    run.close()
    assert got == plain[:len(got)] and len(got) == 2 + (backend != "onnxruntime")
    got += list(engine.continue_from(got[-1], 12 - len(got), Sampler()))
    assert got == plain


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_greedy_draft_model_equals_plain_decode(drafting, optimized, backend):
    """The q4 graph drafting for the f32 one (same tokenizer, same checkpoint)."""
    target, draft = optimized("qwen3", "f32"), optimized("qwen3", "q4")
    plain = _run(target, backend=backend)
    spec = _run(target, backend=backend, speculative="draft", draft_model=str(draft), num_draft=4)
    assert spec["tokens"] == plain["tokens"]
    assert spec["speculative"]["acceptance"] > 0.5  # the q4 graph mostly agrees with the f32 one


def test_a_draft_model_of_another_tokenizer_is_refused(optimized, tmp_path, capsys):
    """A draft model whose ids mean other tokens (here: two tokens of its tokenizer.json swapped) would draft another
    text: refused with exit 2, naming the id, before any token; the same tokenizer is taken."""
    import json
    import shutil

    target, draft = optimized("qwen3", "f32"), tmp_path / "draft"
    shutil.copytree(optimized("qwen3", "q4"), draft)
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (3, 4))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    args = ["run", str(target), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "4", "--speculative",
            "draft", "--backend", "torch"]
    assert main([*args, "--draft-model", str(draft)]) == 2
    err = capsys.readouterr().err
    assert "its tokenizer is not the model's (id 3" in err and "same tokenizer" in err
    assert main([*args, "--draft-model", str(optimized("qwen3", "q4"))]) == 0


def test_rejection_rule_keeps_the_target_distribution():
    """Over many trials, the token a verification step emits first is distributed as the target's p, for a
    point-mass draft (n-gram) and for a draft distribution q (a draft model), also where the draft's vocabulary is
    padded to more ids than the model's or has fewer (drafts past the model's ids are never its tokens)."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(2, 6)) * 2
    sampler = Sampler(temperature=1.0, seed=1)
    p = probabilities(rows[0], 1.0, 0, 1.0)
    q = probabilities(rng.normal(size=6), 1.0, 0, 1.0)
    wider = np.concatenate([q * 0.8, [0.15, 0.05]])  # a draft vocabulary padded past the model's 6 ids
    for draft_q in (None, [q], [wider], [q[:5] / q[:5].sum()]):  # (and one with an id fewer)
        counts = np.zeros(6)
        n = 20000
        for _ in range(n):
            d = 2 if draft_q is None else int(sampler.rng.choice(draft_q[0].size, p=draft_q[0]))
            kept, nxt = speculative._verify(rows, [d], draft_q, sampler)
            counts[d if kept else nxt] += 1
        np.testing.assert_allclose(counts / n, p, atol=0.015)


def test_drafting_pauses_when_rejected(optimized):
    """A drafter whose drafts are always wrong: within a few steps the policy stops verifying them (plain steps, its
    shadow drafts compared with them: these may stop it before any verification), and the tokens are plain
    decode's."""

    class Wrong(speculative.NgramDrafter):
        def propose(self, history, k):
            return [(history[-1] + 1) % 50] * k, None

    engine = fuselm.load(optimized("qwen3", "f32"), backend="torch")
    want = list(engine.generate(PROMPT, TOKENS, Sampler()))
    stats = speculative.Stats("wrong", 3)
    got = list(speculative.generate(engine, PROMPT, TOKENS, Sampler(), Wrong(), 3, stats))
    assert got == want and stats.steps <= 6 and stats.paused > TOKENS // 2 and stats.accepted == 0



def test_ngram_drafts_follow_the_latest_earlier_occurrence():
    """The drafter's index, grown a token at a time, proposes what a search of the whole history finds: the tokens
    after the latest earlier occurrence of the last 3, else 2, else 1 tokens."""
    def search(h, k):
        for n in speculative.NGRAM:
            starts = [i for i in range(len(h) - n) if h[i:i + n] == h[-n:]]
            if len(h) > n and starts:
                return h[starts[-1] + n:starts[-1] + n + k]
        return []

    rng = np.random.default_rng(0)
    d = speculative.NgramDrafter()
    for _ in range(3):
        history = [int(t) for t in rng.integers(0, 6, 5)]
        d.start(history)
        for _ in range(60):
            assert d.propose(history, 4)[0] == search(history, 4)
            history.append(int(rng.integers(0, 6)))

def test_policy_drafts_what_pays():
    """The policy's choice: a plain step first (timed twice: the first compiles), no drafts when every one is
    rejected, many when all are kept and a step of many tokens costs about one token's; few when long steps cost
    their length (a CPU) or drafting costs a plain step per token (a draft model as large as the target)."""
    def timed(p, rows, seconds):
        p.timed(rows, 100.0)  # the first step of a row count (a compile) is not kept
        p.timed(rows, seconds)

    p = speculative.Policy(4, fixed=False)
    assert p.choose(100) == 0
    timed(p, 1, 0.01)
    for _ in range(20):
        p.drafts(0, 4)
    assert p.choose(100) == 0
    p = speculative.Policy(4, fixed=False)
    timed(p, 1, 0.01), timed(p, 5, 0.011)
    for _ in range(8):
        p.drafts(4, 4)
    assert p.choose(100) == 4 and p.choose(3) == 2
    p.drafting(4, 0.04)  # four draft-model steps as slow as the target's: no k pays
    assert p.choose(100) == 0
    p.draft_s = 0.0
    p.timed(5, 0.05)  # rows cost about their number: drafting cannot pay for itself
    p.seconds[5] = 0.05
    assert p.choose(100) < 4
    # a step of fewer rows measured dearer than one of more (an outlier, on a CPU; the engine's times outlive a
    # generation, here one at k = 4 before this one at k = 3) costs what the longer one does
    p = speculative.Policy(3, fixed=False, seconds={1: 0.013, 2: 0.0175, 3: 0.0175, 4: 0.0285, 5: 0.020})
    assert p.cost(4) == pytest.approx(0.020 / 0.013) and p.cost(2) == pytest.approx(0.0175 / 0.013)
    p.kept = 50.0  # drafts always kept: 3 of them pay best unless the outlier stood (then 2 did)
    assert p.choose(100) == 3



def test_ngram_probes_only_where_an_outlier_could_hide_a_gain():
    """A paused n-gram drafter's acceptance is measured by its shadow drafts, so a probe only re-measures the step's
    time: it runs where the drafts would pay for a step half as dear as measured (an outlier), not merely because
    they match half the time. A verification measured at 3.5 plain tokens, a restart at 0.8."""
    p = speculative.Policy(4, fixed=True)
    p.seconds.update({1: 0.002, 5: 0.007, 0: 0.0016})
    p.kept, p.rejected = 9.0, 0.5  # shadow drafts kept 94 % of the time: not worth the measured step, worth half
    assert p.choose(100, stops_run=True) == 0 and speculative._probe(p, speculative.NgramDrafter())
    p.kept, p.rejected = 1.0, 1.0  # 55 %: not even at half the cost
    assert p.could_pay() and not speculative._probe(p, speculative.NgramDrafter())


def test_a_costly_verification_is_not_probed_again(optimized):
    """An engine whose verification step costs many one-token steps (a GPU kernel that does not batch the rows):
    n-gram drafts that always match are verified only until that cost is measured, then never probed; the step
    times stay with the engine, so its next generation runs plain from the start. Tokens stay plain decode's."""
    engine = fuselm.load(optimized("qwen3", "f32"), backend="torch")
    want = list(engine.generate(PROMPT * 4, 48, Sampler()))
    verify = engine.verify

    def slow(ids, greedy):
        time.sleep(0.2)
        return verify(ids, greedy)

    engine.verify = slow
    steps = []
    for _ in range(2):
        stats = speculative.Stats("ngram", 3)
        got = list(speculative.generate(engine, PROMPT * 4, 48, Sampler(), speculative.NgramDrafter(), 3, stats))
        assert got == want
        steps.append(stats.steps)
    assert 0 < steps[0] <= 2 and steps[1] == 0 and max(engine.step_seconds.values()) > 0.1

def test_a_costly_restart_stops_sporadic_drafts(optimized):
    """A pipelined loop whose first token after a stop costs many steady ones (a GPU's: the queued step thrown
    away, the next one not overlapped): drafts found now and then (two right, one wrong), each of which would stop
    a plain run for a step that gains one token, are verified only until the restart is measured. The plain
    token's time is the run's steady one, not the restart averaged in (that made drafting look cheap). The
    tokens stay plain decode's."""
    engine = fuselm.load(optimized("qwen3", "f32"), backend="torch")
    plain = list(engine.generate(PROMPT, 64, Sampler()))
    start = engine.continue_from

    def restarting(token, n, sampler):
        time.sleep(0.2)  # (against a steady token's 1-15 ms, on a loaded 2-core machine too)
        yield from start(token, n, sampler)

    engine.continue_from = restarting

    class Sporadic(speculative.NgramDrafter):
        def propose(self, history, k):
            done = len(history) - len(PROMPT)
            if done % 8 or done + k > len(plain):
                return [], None
            return plain[done:done + 2] + [(plain[done + 2] + 1) % 50], None

    stats = speculative.Stats("sporadic", 3)
    got = list(speculative.generate(engine, PROMPT, 64, Sampler(), Sporadic(), 3, stats))
    assert got == plain and stats.steps <= 2, stats.as_dict()
    assert engine.step_seconds[0] > 0.15 > 10 * engine.step_seconds[1], engine.step_seconds


def test_a_step_past_the_exact_rows_says_so(optimized):
    """A backend whose kernels give a row one-token numbers only up to some row count (MLX's quantized matmul on a
    GPU: its vector kernel up to 7 rows on CUDA, 5 on Metal): speculation with more drafts than that reports its
    tokens as not exact, and why; within it, as exact."""
    engine = fuselm.load(optimized("qwen3", "q4"), backend="mlx")
    backend = engine.session.backend
    backend.exact_rows = 3
    for k, exact in ((2, True), (3, False)):
        stats = speculative.Stats("ngram", k)
        list(speculative.generate(engine, PROMPT, 8, Sampler(), speculative.NgramDrafter(), k, stats))
        assert stats.as_dict()["exact"] is exact and ("matrix kernel" in stats.describe()) is not exact
        assert exact or "greedy tokens may leave plain decode's" in stats.describe()
    stats = speculative.Stats("ngram", 3)  # sampling: what moves is the distribution a token is drawn from
    list(speculative.generate(engine, PROMPT, 8, Sampler(temperature=0.8, seed=1), speculative.NgramDrafter(), 3, stats))
    assert "distributions tokens are drawn from may move" in stats.describe() and "greedy" not in stats.describe()


def test_cli_flags(optimized, capsys, tmp_path):
    model = str(optimized("qwen3", "f32"))
    assert main(["run", model, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8", "--ignore-eos",
                 "--speculative", "ngram", "--num-draft", "2", "--backend", "torch"]) == 0
    assert "speculative ngram (k=2)" in capsys.readouterr().err
    assert main(["run", model, "--prompt-ids", "5", "--speculative", "draft"]) == 2
    assert "--draft-model" in capsys.readouterr().err
    assert main(["run", model, "--prompt-ids", "5", "--speculative", "ngram", "--num-draft", "0"]) == 2
    capsys.readouterr()
    draft = str(optimized("qwen3", "q4"))  # --draft-model alone asks for its drafts (as mlx-lm's flag does)
    assert main(["run", model, "--prompt-ids", "5,9", "--max-tokens", "4", "--draft-model", draft]) == 0
    assert "speculative draft (k=4)" in capsys.readouterr().err
    assert main(["run", model, "--prompt-ids", "5", "--draft-model", str(tmp_path / "none")]) == 2
    assert "--draft-model: " in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_profile_times_the_speculative_steps(drafting, optimized, capsys, backend):
    """--profile with --speculative: the table times the run's plain and verification steps after the first few
    tokens (before, it timed none and asked for more tokens), and the tokens stay plain decode's."""
    model = optimized("qwen3", "q4")
    plain = _run(model, backend=backend)
    r = _run(model, backend=backend, speculative="ngram", num_draft=3, profile=True, quiet=False)
    assert r["tokens"] == plain["tokens"] and r["speculative"]["verification_steps"] > 0
    assert r["profile"]["tokens"] > TOKENS // 2 and r["profile"]["what"] == "speculative ngram: plain and verification steps"
    assert "decode profile" in capsys.readouterr().err
    assert {o["op"] for o in r["profile"]["ops"]} >= {"Attention"}


def test_mlx_verifies_on_compiled_pieces(drafting, optimized):
    """Where attention reads the filled rows (MLX), a verification step runs as compiled pieces for its row count
    (drafts padded to k), built once its rows agree with the dynamic step's; the tokens stay plain decode's. Its
    pieces take the cache buffers as they are, so a generation at another cache length verifies on them too
    (nothing built again)."""
    engine = fuselm.load(optimized("qwen3", "q4"), backend="mlx")
    plain = list(engine.generate(PROMPT, TOKENS, Sampler()))
    spec = [r.token for r in fuselm.stream_generate(engine, PROMPT, max_tokens=TOKENS, ignore_eos=True,
                                                    speculative="ngram", num_draft=3)]
    assert spec == plain and engine.speculation.steps > 1
    kept = dict(engine.session.decoding.verifiers)
    assert list(kept) == [(None, 4)] and kept[(None, 4)] is not None, kept  # one row count: k + 1, any length
    before = engine.session.max_len
    run = fuselm.stream_generate(engine, PROMPT, max_tokens=600, ignore_eos=True, speculative="ngram", num_draft=3)
    again = [r.token for r in itertools.islice(run, TOKENS)]
    run.close()
    assert engine.session.max_len > before and again == plain and engine.speculation.steps > 1
    assert engine.session.decoding.verifiers == kept


def test_greedy_verification_reads_back_the_picks(optimized):
    """Engine.verify, greedy: the rows' argmax taken on the device (ids come back, not [rows, vocab] logits), the
    same as the logits' argmax, on the compiled verification pieces (MLX) and on torch and onnxruntime."""
    for backend in ("mlx", "torch", "onnxruntime"):
        engine = fuselm.load(optimized("qwen3", "q4"), backend=backend, speculative="ngram")  # (onnxruntime: the
        ids = [4, 8, 15, 16]  # IO-binding loop, which steps)
        engine.reset(64)
        engine.forward(PROMPT)
        rows = engine.verify(ids, False)  # (MLX: builds the compiled pieces, checked against the dynamic step)
        engine.rollback(len(ids))
        picks = engine.verify(ids, True)
        assert rows.shape[0] == len(ids) and picks.shape == (len(ids),)
        assert picks.tolist() == rows.argmax(-1).tolist(), backend


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_recurrent_state_is_restored_and_replayed(drafting, hybrid, backend):
    """A hybrid with recurrent state (Qwen3.5's gated delta rule beside attention): its state cannot roll back, so a
    verification step is checkpointed, and on a rejected draft restored and the kept tokens run again; the greedy
    tokens stay plain decode's. The drafter knows plain decode's text and gets its last draft token wrong: every
    step keeps some drafts and rejects one."""
    engine = fuselm.load(hybrid("qwen3_5_text", "opt"), backend=backend)
    plain = list(engine.generate(PROMPT, TOKENS, Sampler()))
    assert not engine.trimmable

    class Oracle(speculative.NgramDrafter):
        def propose(self, history, k):
            done = len(history) - len(PROMPT)
            draft = plain[done:done + k]
            return draft[:-1] + [(draft[-1] + 1) % 50] if draft else [], None

    stats = speculative.Stats("oracle", 3)
    got = list(speculative.generate(engine, PROMPT, TOKENS, Sampler(), Oracle(), 3, stats))
    assert got == plain and stats.steps > 1 and 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("backend", ["torch", "mlx", "onnxruntime"])
def test_a_draft_model_with_recurrent_state(drafting, hybrid, backend):
    """A hybrid draft model (Qwen3.5's gated delta rule: no rollback) for the hybrid's f32 graph: its state is
    checkpointed before it drafts, and where the model rejects drafts it is restored and the kept ones fed again
    (before: the rollback raised mid-run). Greedy tokens are plain decode's; sampling runs to the end."""
    target, draft = hybrid("qwen3_5_text", "opt"), hybrid("qwen3_5_text", "q4")

    def run(**kw):
        return fuselm.run(target, PROMPT, max_tokens=TOKENS, ignore_eos=True, quiet=True, stream=io.StringIO(),
                          backend=backend, **kw)

    spec = run(speculative="draft", draft_model=str(draft), num_draft=3)
    s = spec["speculative"]
    assert spec["tokens"] == run()["tokens"] and 0 < s["accepted"] < s["drafted"], s
    sampled = run(speculative="draft", draft_model=str(draft), num_draft=3, temperature=0.8, seed=1)
    assert len(sampled["tokens"]) == TOKENS and sampled["speculative"]["verification_steps"] > 0

