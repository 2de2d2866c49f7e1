"""Interrupted and concurrent runs of `fuselm convert` and `fuselm optimize`.

A run is stopped (SIGINT, SIGKILL) at chosen points: at the file-system events where it matters
(each rename of the output into place, the first and last weight writes), at seeded random
events, and at seeded random times; disk-full errors are injected at random writes. After each:
- OUT is absent or complete (byte-identical to an undisturbed run); with --force over an older
  OUT, the older or the newer one is complete, never neither;
- after SIGINT nothing is left behind (no temporary directory, no lock file); after SIGKILL the
  leftovers are removed by the next run, which succeeds and writes the same bytes.
Two runs writing the same OUT at once: one wins, the other stops with a clear error, OUT is whole.
Most runs are children of the fork server; two go through `python -m fuselm.cli` with real signals.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reliability_helpers import FAULT_CASES, FUZZ_SEED, leftovers, same_files

SIGNALS = ["SIGINT", "SIGKILL"]
MEDIUM = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def _commands(make_ckpt, exported, optimized) -> dict:
    """name -> (argv without OUT, reference output, older OUT that --force replaces or None)."""
    hf = make_ckpt("qwen3")
    return {
        "convert": (["convert", hf, "--quiet", "--quant", "q4"], exported("qwen3", "q4"), None),
        "convert --force": (["convert", hf, "--quiet", "--quant", "q4", "--force"], exported("qwen3", "q4"),
                            exported("qwen3", "f32")),
        "optimize": (["optimize", exported("qwen3", "f32"), "--quiet"], optimized("qwen3", "f32"), None),
    }


@pytest.fixture(scope="module")
def commands(make_ckpt, exported, optimized):
    return _commands(make_ckpt, exported, optimized)


def _fault_points(names: list[str], rng: random.Random, n: int) -> list[int]:
    """1-based event numbers: every rename, the first and last data write, and n random ones."""
    chosen = {i + 1 for i, e in enumerate(names) if e in ("os.rename", "os.replace")}
    writes = [i + 1 for i, e in enumerate(names) if e == "pwrite"]
    chosen |= {writes[0], writes[-1]} if writes else set()
    chosen |= set(rng.sample(range(1, len(names) + 1), min(n, len(names))))
    return sorted(chosen)


def _whole(out: Path, new: Path, old: Path | None) -> bool:
    return same_files(out, new) or (old is not None and same_files(out, old))


def _after_interrupt(answer: dict, out: Path, new: Path, old: Path | None, sig: str) -> list[str]:
    """What is wrong with the state an interrupted run left (empty: nothing)."""
    why = []
    if "Traceback" in answer["stderr"] or answer.get("exception"):
        why.append(f"traceback: {answer.get('exception')}")
    finished = answer["rc"] == 0
    if sig == "SIGINT" and not finished and (answer["rc"] != 130 or "interrupted" not in answer["stderr"]):
        why.append(f"SIGINT: exit {answer['rc']}, stderr {answer['stderr'][-200:]!r}")
    if sig == "SIGKILL" and not finished and answer["signal"] != signal.SIGKILL:
        why.append(f"SIGKILL: exit {answer['rc']} signal {answer['signal']}")
    if out.exists() and not _whole(out, new, old):
        why.append("OUT exists but is not a complete output")
    if old is not None and not out.exists():
        kept = [p for p in out.parent.glob(f".fuselm-tmp-{out.name}.old.*") if same_files(p, old)]
        if sig == "SIGINT" or not kept:
            why.append("the older OUT is gone")
    if finished and not same_files(out, new):
        why.append("exit 0 but OUT is not the complete output")
    if sig == "SIGINT" and leftovers(out.parent):
        why.append(f"SIGINT left {leftovers(out.parent)}")
    return why


def _next_run(sandbox, argv: list, out: Path, new: Path, old: Path | None) -> list[str]:
    """The next run starts cleanly, cleans up the killed run's leftovers and writes the same bytes."""
    why = []
    if old is not None:  # a plain run first: it must find the older (or newer) OUT whole and stop
        plain = sandbox.run([a for a in argv if a != "--force"] + ["-o", out], timeout=120)
        if plain["rc"] != 2 or "exists" not in plain["stderr"] or not _whole(out, new, old):
            why.append(f"after the kill a plain run saw exit {plain['rc']}: {plain['stderr'][-200:]!r}")
    forced = [*argv, "--force"] if "--force" not in argv else argv
    again = sandbox.run([*forced, "-o", out], timeout=120)
    if again["rc"] != 0:
        why.append(f"the next run failed: {again['stderr'][-300:]!r}")
    elif not same_files(out, new):
        why.append("the next run wrote different bytes")
    if leftovers(out.parent):
        why.append(f"the next run left {leftovers(out.parent)}")
    return why


def _prepare(case_dir: Path, old: Path | None) -> Path:
    case_dir.mkdir(parents=True)
    out = case_dir / "out"
    if old is not None:
        shutil.copytree(old, out)
    return out


@pytest.mark.parametrize("sig", SIGNALS)
@pytest.mark.parametrize("name", ["convert", "convert --force", "optimize"])
def test_killed_runs_leave_nothing_half_written(name, sig, commands, sandbox, tally, tmp_path):
    argv, new, old = commands[name]
    dry_out = _prepare(tmp_path / "dry", old)
    dry = sandbox.run([*argv, "-o", dry_out], timeout=120)
    assert dry["rc"] == 0 and same_files(dry_out, new), dry["stderr"]
    rng = random.Random(f"{FUZZ_SEED}-{name}-{sig}")
    cases = [{"fault": {"at": at, "action": sig}} for at in _fault_points(dry["events"]["names"], rng, FAULT_CASES)]
    cases += [{"kill_after": [rng.uniform(0, 1.2 * dry["seconds"]), sig]} for _ in range(max(1, FAULT_CASES // 2))]
    failures = []
    for i, options in enumerate(cases):
        out = _prepare(tmp_path / f"case{i}", old)
        answer = sandbox.run([*argv, "-o", out], timeout=120, **options)
        why = _after_interrupt(answer, out, new, old, sig)
        why += _next_run(sandbox, argv, out, new, old)
        if not tally.record("fault", f"{name} killed ({sig})", not why):
            failures.append((options, why))
    assert not failures, failures


@pytest.mark.parametrize("name", ["convert", "optimize"])
def test_disk_full_at_any_write(name, commands, sandbox, tally, tmp_path):
    argv, new, _ = commands[name]
    dry = sandbox.run([*argv, "-o", tmp_path / "dry" / "out"], timeout=120)
    writes = dry["events"]["write"]
    rng = random.Random(f"{FUZZ_SEED}-enospc-{name}")
    failures = []
    for i, at in enumerate(sorted(set(rng.sample(range(1, writes + 1), min(writes, FAULT_CASES))) | {1, writes})):
        out = tmp_path / f"case{i}" / "out"
        out.parent.mkdir()
        answer = sandbox.run([*argv, "-o", out], timeout=120, fault={"at": at, "action": "ENOSPC"})
        why = []
        if answer["rc"] != 2 or "No space left on device" not in answer["stderr"] or "Traceback" in answer["stderr"]:
            why.append(f"exit {answer['rc']}: {answer['stderr'][-300:]!r}")
        if out.exists() or leftovers(out.parent):
            why.append(f"left {sorted(p.name for p in out.parent.iterdir())}")
        why += _next_run(sandbox, argv, out, new, None)
        if not tally.record("fault", f"{name} disk full", not why):
            failures.append((at, why))
    assert not failures, failures


@pytest.mark.parametrize("force", [False, True])
def test_two_writers_one_out(force, commands, sandbox, tally, tmp_path):
    """convert and optimize race for the same OUT: one wins, the other exits 2, OUT is one whole output."""
    flags = ["--force"] if force else []
    convert_argv, convert_ref, _ = commands["convert"]
    optimize_argv, optimize_ref, _ = commands["optimize"]
    failures = []
    for i in range(max(2, FAULT_CASES // 2)):
        out = tmp_path / f"race{i}" / "out"
        pair = [{"argv": [*convert_argv, *flags, "-o", out], "timeout": 120},
                {"argv": [*optimize_argv, *flags, "-o", out], "timeout": 120}]
        answers = sandbox.group(pair if i % 2 else pair[::-1])
        codes = sorted(a["rc"] for a in answers)
        why = []
        if any("Traceback" in a["stderr"] for a in answers):
            why.append("traceback")
        losers = [a for a in answers if a["rc"] != 0]
        if codes not in ([0, 2], [0, 0]) or (codes == [0, 0] and not force):
            why.append(f"exit codes {codes}")
        for a in losers:
            if "another fuselm process is writing it now" not in a["stderr"] and "it exists" not in a["stderr"]:
                why.append(f"unclear error: {a['stderr'][-200:]!r}")
        if not (same_files(out, convert_ref) or same_files(out, optimize_ref)):
            why.append("OUT is not one whole output")
        if leftovers(out.parent):
            why.append(f"left {leftovers(out.parent)}")
        if not tally.record("fault", "two writers, one OUT" + (" (--force)" if force else ""), not why):
            failures.append((i, codes, why))
    assert not failures, failures


def test_real_processes_signalled_while_writing(make_ckpt, exported, sandbox, tally, tmp_path):
    """The console entry point itself, as a user's Ctrl-C or `kill` reaches it: SIGINT and SIGTERM at a
    random moment after the run has started writing (its temporary directory exists)."""
    hf, new = make_ckpt("qwen3", **MEDIUM), exported("qwen3", "q4", **MEDIUM)  # writing takes a moment
    rng = random.Random(f"{FUZZ_SEED}-real")
    argv = ["convert", str(hf), "--quiet", "--quant", "q4"]
    runs = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        out = tmp_path / sig.name / "out"
        out.parent.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "fuselm.cli", *argv, "-o", str(out)], stderr=subprocess.PIPE,
                                text=True)
        runs.append({"sig": sig, "out": out, "proc": proc, "delay": rng.uniform(0.0, 0.15), "at": None})
    deadline = time.monotonic() + 120
    while any(r["proc"].poll() is None and r["at"] != "sent" for r in runs) and time.monotonic() < deadline:
        for r in runs:
            if r["proc"].poll() is not None or r["at"] == "sent":
                continue
            if r["at"] is None and leftovers(r["out"].parent):
                r["at"] = time.monotonic() + r["delay"]
            if isinstance(r["at"], float) and time.monotonic() >= r["at"]:
                r["proc"].send_signal(r["sig"])
                r["at"] = "sent"
        time.sleep(0.002)
    failures = []
    for r in runs:
        err = r["proc"].communicate(timeout=120)[1]
        out, code = r["out"], r["proc"].returncode
        why = []
        if "Traceback" in err:
            why.append("traceback")
        # 130: the run unwound; -signal: it came during interpreter exit, after the run had finished.
        # A signal that lands while OUT is being published is held until the rename is done and then
        # delivered (modeldir.atomic_output_dir): 130 with a complete OUT (checked below), nothing else left.
        published = code == 130 and out.exists() and same_files(out, new)
        if code not in (0, 130, -r["sig"]) or (code == 130 and (leftovers(out.parent) or (out.exists() and not published))):
            why.append(f"exit {code}, left {sorted(p.name for p in out.parent.iterdir())}")
        if out.exists() and not same_files(out, new):
            why.append("OUT exists but is not complete")
        why += _next_run(sandbox, argv, out, new, None)
        if not tally.record("fault", f"python -m fuselm.cli convert, {r['sig'].name} while writing", not why):
            failures.append((r["sig"].name, r["at"], code, why, err[-300:]))
    assert not failures, failures


@pytest.mark.parametrize("name", ["convert", "optimize"])
def test_files_reach_the_disk_before_the_rename(name, commands, sandbox, tmp_path):
    """Power loss: every file of OUT and the temporary directory are fsynced before the rename that
    publishes OUT, and its parent after it (else a crash could leave names without their bytes)."""
    argv, _, _ = commands[name]
    out = tmp_path / "out"
    events = sandbox.run([*argv, "-o", out], timeout=120)["events"]["names"]
    publish = max(i for i, e in enumerate(events) if e == "os.rename")
    assert events[:publish].count("fsync") >= len(list(out.iterdir())) + 1, events
    assert "fsync" in events[publish + 1:], events


def test_force_replaces_only_fuselm_outputs(make_ckpt, exported, sandbox, tally, tmp_path):
    """--force onto a folder of other files (a typo'd home directory), or onto a folder that holds the
    input, is refused: nothing there is touched; a failed run removes the parent folders it created."""
    hf = make_ckpt("qwen3")
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    (home / "notes" / "thesis.txt").write_text("years of work")
    cases = [("folder of other files", ["convert", hf, "-o", home, "--force"], home),
             ("input inside OUT", ["optimize", exported("qwen3"), "-o", exported("qwen3").parent, "--force"],
              exported("qwen3").parent)]
    failures = []
    for what, argv, target in cases:
        before = sorted(p.relative_to(target) for p in target.rglob("*"))
        answer = sandbox.run(argv, timeout=120)
        after = sorted(p.relative_to(target) for p in target.rglob("*"))
        if answer["rc"] != 2 or before != after or "Traceback" in answer["stderr"]:
            failures.append((what, answer["rc"], answer["stderr"][-200:]))
        tally.record("malformed", "--force onto something not a fuselm output", answer["rc"] == 2 and before == after)
    deep = tmp_path / "new" / "deeper" / "out"  # the disk fills up at the third write
    answer = sandbox.run(["convert", hf, "-o", deep], timeout=120, fault={"at": 3, "action": "ENOSPC"})
    if answer["rc"] != 2 or (tmp_path / "new").exists():
        failures.append(("parents of a failed OUT", answer["rc"], sorted(p.name for p in tmp_path.iterdir())))
    assert (home / "notes" / "thesis.txt").read_text() == "years of work"
    assert not failures, failures
