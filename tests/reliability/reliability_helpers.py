"""Shared pieces of the reliability tests: budgets, the tally, the fork-server client, oracles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

HERE = Path(__file__).parent
HYPOTHESIS_EXAMPLES = int(os.environ.get("FUSELM_HYPOTHESIS_EXAMPLES", "3"))
FUZZ_CASES = int(os.environ.get("FUSELM_FUZZ_CASES", "40"))
FAULT_CASES = int(os.environ.get("FUSELM_FAULT_CASES", "6"))
FUZZ_SEED = int(os.environ.get("FUSELM_FUZZ_SEED", "0"))


class Tally:
    """Counts per kind ("valid", "malformed", "fault") and category; `bad` counts the cases that
    broke a promise (a bad input let through, a traceback, data lost, something half written)."""

    def __init__(self):
        self.tried: dict[str, Counter] = {"valid": Counter(), "malformed": Counter(), "fault": Counter()}
        self.bad: dict[str, Counter] = {"valid": Counter(), "malformed": Counter(), "fault": Counter()}

    def record(self, kind: str, category: str, ok: bool) -> bool:
        self.tried[kind][category] += 1
        self.bad[kind][category] += not ok
        return ok

    def summary(self) -> dict:
        return {kind: {"tried": sum(self.tried[kind].values()), "broken": sum(self.bad[kind].values()),
                       "by_category": {c: {"tried": n, "broken": self.bad[kind][c]}
                                       for c, n in sorted(self.tried[kind].items())}}
                for kind in self.tried}


class Sandbox:
    """Client of reliability_sandbox.py: `run(argv=[...], **options)` -> answer dict (see that file)."""

    def __init__(self):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
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
        request = dict(options)
        if argv is not None:
            request["argv"] = [str(a) for a in argv]
        return self._ask(request)

    def group(self, requests: list[dict]) -> list[dict]:
        return self._ask({"group": [{**r, "argv": [str(a) for a in r["argv"]]} for r in requests]})

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)


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
