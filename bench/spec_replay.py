"""Replay a speculative-decoding benchmark's n-gram runs on this machine: `speculative.generate` and its policy run
over the plain-decode tokens bench/speculative.py recorded, on an engine that computes nothing and only advances a
clock by the step times the run measured (its files' step_ms: a plain token, a verification of k + 1 rows, the
restart of a plain run). What the policy decides is then the recorded device's, without the device: a change to the
policy, or to one of its constants, can be weighed on a GPU run's prompts from a CPU.

    python bench/spec_replay.py RESULT.json [--num-draft K] [--set PAYS=1.4 --set STRETCH=2 ...]

Prints, per prompt, the measured n-gram/plain ratio beside the replayed one, and the replay's verification steps
and acceptance. The replay leaves out what the step times do not hold (the host's own work between steps, a step
slower than its mean), so it ranks policies; it does not predict a device's figures to the percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime_metal import speculative  # noqa: E402
from runtime_metal.step_runs import FINISH  # noqa: E402


class Clock:
    """The replay's time: what `speculative` reads as time.perf_counter."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedEngine:
    """The Engine steps speculation uses, over a recorded greedy answer `target`: picks are the recorded tokens
    wherever what was fed matches them; each step advances `clock` by its recorded time (`cost`: rows -> seconds,
    0: the restart a plain run's first token pays)."""

    trimmable = True

    def __init__(self, clock: Clock, cost: dict, fixed_rows: bool):
        self.clock, self.cost, self.fixed_rows = clock, cost, fixed_rows
        self.step_seconds: dict[int, float] = {}  # the policy's measurements, kept across prompts as an engine keeps them
        self.target: list[int] = []
        self.pos = 0  # answer tokens in the cache

    def inexact(self, rows: int) -> None:
        return None

    def reset(self, max_len: int) -> None:
        self.pos = 0

    def _token(self, i: int) -> int:
        return self.target[i] if i < len(self.target) else -1

    def start(self, ids: list[int], n: int, sampler):
        self.pos = -1  # (the prompt's token is fed by the first step after it)
        yield from self.continue_from(None, n, sampler)

    def continue_from(self, token: int | None, n: int, sampler):
        """A pipelined loop's run: a token a step (the first also pays the restart, unless the prompt's), each step
        queued before the token before it is read; FINISH sent in: the queued one comes, then no more."""
        yielded, at = 0, self.pos
        try:
            for i in range(n):
                self.clock.now += self.cost[1] + (self.cost[0] if i == 0 and token is not None else 0.0)
                yielded += 1
                if (yield self._token(at + i + 1)) == FINISH:
                    if i + 1 < n:
                        self.clock.now += self.cost[1]
                        yielded += 1
                        yield self._token(at + i + 2)
                    return
        finally:
            self.pos = at + yielded  # the token before each one yielded has been fed (`token` first)

    def verify(self, ids: list[int], greedy: bool) -> np.ndarray:
        self.clock.now += self.cost[len(ids)]
        picks, matches = [], True
        for i, t in enumerate(ids):
            matches = matches and (i == 0 or t == self._token(self.pos + i))
            picks.append(self._token(self.pos + i + 1) if matches else -1)
        self.pos += len(ids)
        return np.array(picks)

    def rollback(self, n: int) -> None:
        self.pos -= n


class Greedy:
    greedy = True


def step_costs(result: dict, k: int) -> dict:
    """Seconds by rows (0: the restart) from the n-gram runs' own measurements, medians over prompts and rounds;
    rows the runs never timed are read off the line through a plain token and the verification."""
    rows = [r["speculative"] for run in result["runs"]["fuselm:ngram"] for r in run["rows"] if r.get("speculative")]
    one = statistics.median(s["step_ms"]["1"] for s in rows) / 1e3
    verify = [s["step_ms"][str(k + 1)] for s in rows if str(k + 1) in s["step_ms"]]
    if not verify:
        raise SystemExit(f"no {k + 1}-row verification was timed in these runs; pass the --num-draft they used")
    full = statistics.median(verify) / 1e3
    cost = {r: one + (full - one) * (r - 1) / k for r in range(1, k + 2)}
    cost[0] = statistics.median(s["restart_ms"] for s in rows) / 1e3
    return cost


def replay(result: dict, k: int) -> list[dict]:
    cost = step_costs(result, k)
    clock = Clock()
    fixed = result["runs"]["fuselm:ngram"][0]["what"].startswith("mlx")  # MLX pads a verification to k drafts
    engine = ClockedEngine(clock, cost, fixed)
    out = []
    with mock.patch.object(speculative, "time", types.SimpleNamespace(perf_counter=clock)):
        for row, plain in zip(result["table"], result["runs"]["fuselm:plain"][0]["rows"], strict=True):
            engine.target = plain["tokens"]
            for n in (min(16, len(engine.target)), len(engine.target)):  # the benchmark's warm-up, then the run
                stats = speculative.Stats("ngram", k)
                times, tokens = [], []
                for t in speculative.generate(engine, plain["prompt_ids"], n, Greedy(), speculative.NgramDrafter(),
                                              k, stats):
                    times.append(clock.now)
                    tokens.append(t)
            assert tokens == engine.target, "the replay must give the recorded tokens"
            tok_s = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else None
            out.append({"prompt": row["prompt"], "measured": row.get("fuselm:ngram/plain"),
                        "replayed": round(tok_s * cost[1], 3) if tok_s else None,
                        "verifications": stats.steps, "acceptance": stats.acceptance})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", help="a bench/speculative.py result file (its fuselm plain and n-gram runs)")
    ap.add_argument("--num-draft", type=int, default=None, help="k (default: the runs')")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a runtime_metal/speculative.py constant for the replay (PAYS, STRETCH, PROBE_EVERY, ...)")
    args = ap.parse_args()
    result = json.loads(Path(args.result).read_text())
    k = args.num_draft or next(r["speculative"]["num_draft"] for run in result["runs"]["fuselm:ngram"]
                               for r in run["rows"] if r.get("speculative"))
    for setting in args.set:
        name, _, value = setting.partition("=")
        if not hasattr(speculative, name):
            raise SystemExit(f"--set {setting}: runtime_metal/speculative.py has no {name}")
        setattr(speculative, name, type(getattr(speculative, name))(json.loads(value)))
    rows = replay(result, k)
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"{r['prompt'][:40]:40}  measured {r['measured']}  replayed {r['replayed']}  "
              f"verifications {r['verifications']}  acceptance {acc}")


if __name__ == "__main__":
    main()
