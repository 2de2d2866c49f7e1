"""bench/spec_replay.py: speculation's policy replayed over a recorded GPU run (run 47, an H100) on a clock."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "bench" / "results" / "h200" / "speculative-gpu-run47-smollm2.json"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_spec_replay", ROOT / "bench" / "spec_replay.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_replay_follows_the_recorded_run():
    """The replay gives the recorded tokens (asserted inside) and lands near the measured ratios: the copying
    prompts gain, the prose edit (no n-gram recurs) stays at plain decode's speed with no verification."""
    rows = _bench().replay(json.loads(RUN.read_text()), 4)
    by = {r["prompt"][:20]: r for r in rows}
    copy = by["Copy out every sente"]
    assert copy["verifications"] > 10 and abs(copy["replayed"] - copy["measured"]) < 0.2
    prose = by["Rename the variable "]
    assert prose["verifications"] == 0 and prose["replayed"] == 1.0
    for r in rows:
        assert abs(r["replayed"] - r["measured"]) < 0.25, r


def test_a_policy_constant_moves_the_replay(monkeypatch):
    """A drafting step that must promise 100x plain decode's tokens per second is never taken."""
    bench = _bench()
    monkeypatch.setattr(bench.speculative, "PAYS", 100.0)
    for r in bench.replay(json.loads(RUN.read_text()), 4):
        assert r["verifications"] == 0 and r["replayed"] == 1.0, r
