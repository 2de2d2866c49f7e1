"""Shared pieces of the reliability tests: budgets, the tally, the fork-server client, oracles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
HYPOTHESIS_EXAMPLES = int(os.environ.get("FUSELM_HYPOTHESIS_EXAMPLES", "8"))
FUZZ_CASES = int(os.environ.get("FUSELM_FUZZ_CASES", "50"))
FAULT_CASES = int(os.environ.get("FUSELM_FAULT_CASES", "6"))
FUZZ_SEED = int(os.environ.get("FUSELM_FUZZ_SEED", "0"))


class Tally:
    """Counts per kind ("valid", "malformed", "fault", "rerun") and category; `bad` counts the cases
    that broke a promise (a bad input let through, a traceback, data lost, something half written,
    a rerun that wrote other bytes)."""

    def __init__(self):
        kinds = ("valid", "malformed", "fault", "rerun")
        self.tried: dict[str, Counter] = {k: Counter() for k in kinds}
        self.bad: dict[str, Counter] = {k: Counter() for k in kinds}

    def record(self, kind: str, category: str, ok: bool) -> bool:
        self.tried[kind][category] += 1
        self.bad[kind][category] += not ok
        return ok

    def dump(self) -> dict:
        return {"tried": {k: dict(c) for k, c in self.tried.items()}, "bad": {k: dict(c) for k, c in self.bad.items()}}

    def merge(self, dumped: dict | None) -> None:
        """Add another process's counts (an xdist worker's `dump()`)."""
        for field in ("tried", "bad"):
            for kind, counts in (dumped or {}).get(field, {}).items():
                getattr(self, field)[kind].update(counts)

    def summary(self) -> dict:
        return {kind: {"tried": sum(self.tried[kind].values()), "broken": sum(self.bad[kind].values()),
                       "by_category": {c: {"tried": n, "broken": self.bad[kind][c]}
                                       for c, n in sorted(self.tried[kind].items())}}
                for kind in self.tried}


class Sandbox:
    """Client of reliability_sandbox.py: `run(argv=[...], **options)` -> answer dict (see that file)."""

    def __init__(self):
        # Not offline by environment: fuselm's own code must not reach the network (the guard checks).
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "reliability_sandbox.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError("the reliability fork server did not start (see stderr)")

    def _ask(self, request: dict):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the reliability fork server died (see stderr)")
        return json.loads(line)

    def run(self, argv: list[str] | None = None, **options) -> dict:
        """One case; every case runs under the guard, and a network connection, an opened pickle
        file or an unpickled object fails the test that ran it."""
        request = {"guard": True, **options}
        if argv is not None:
            request["argv"] = [str(a) for a in argv]
        return _guarded(self._ask(request))

    def group(self, requests: list[dict]) -> list[dict]:
        return [_guarded(a) for a in self._ask({"group": [{"guard": True, **r, "argv": [str(a) for a in r["argv"]]}
                                                          for r in requests]})]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)


def _guarded(answer: dict) -> dict:
    assert not answer.get("blocked"), f"the guard blocked {answer['blocked']} (stderr: {answer['stderr'][-300:]!r})"
    return answer


def leftovers(directory: Path) -> list[str]:
    """Temporary or lock files fuselm left beside its outputs."""
    return sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(".fuselm-tmp-"))


def refused(answer: dict, out: Path | None = None) -> list[str]:
    """Why `answer` is not a clean refusal (exit 2, one message, no traceback, nothing written); [] if it is."""
    why = []
    if answer["rc"] != 2:
        why.append(f"exit {answer['rc']} (signal {answer['signal']}, timed out {answer['timed_out']})")
    if "Traceback" in answer["stderr"] or answer.get("exception"):
        why.append(f"traceback: {answer.get('exception')}")
    if "error:" not in answer["stderr"]:
        why.append("no error message")
    if out is not None and (Path(out).exists() or leftovers(Path(out).parent)):
        why.append(f"something was written: {sorted(p.name for p in Path(out).parent.iterdir())}")
    return why


def same_files(a: Path, b: Path) -> bool:
    """Two model directories hold the same files, byte for byte."""
    names = sorted(p.name for p in Path(a).iterdir())
    return names == sorted(p.name for p in Path(b).iterdir()) and \
        all((Path(a) / n).read_bytes() == (Path(b) / n).read_bytes() for n in names)


def ort_runs(model_dir: str) -> bool:
    """A judge of graph validity for `run`: onnxruntime (its optimizations off) runs a 3-token prefill."""
    from fuselm.reference import OrtRunner

    try:
        OrtRunner(model_dir).step([1, 2, 3])  # its numbers may be NaN on damaged weights: fuselm run then refuses
        return True
    except Exception:  # noqa: BLE001 - any failure: the judge rejects the graph
        return False


def checker_accepts(model_dir: str) -> bool:
    """A judge of graph validity for `optimize` (a graph transform): the full ONNX checker."""
    import onnx

    try:
        onnx.checker.check_model(str(Path(model_dir) / "model.onnx"), full_check=True)
        return True
    except Exception:  # noqa: BLE001
        return False
