"""Fixtures for the reliability tests: a fork server that runs fuselm commands in isolated child
processes, and a tally of every generated case and injected fault, printed at the end of the run
and written to `<pytest basetemp>/reliability-summary.json` (or $FUSELM_RELIABILITY_SUMMARY).

Budgets (CI runs the small defaults; raise them for long runs):
  FUSELM_HYPOTHESIS_EXAMPLES=N   generated valid configs in the property test (default 8, plus 2 fixed)
  FUSELM_FUZZ_CASES=N            seeded mutations per malformed-input family (default 50)
  FUSELM_FAULT_CASES=N           random kill / disk-full points per command (default 6)
  FUSELM_FUZZ_SEED=S             the seed of the mutations and fault points (default 0)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability_helpers import FAULT_CASES, FUZZ_CASES, FUZZ_SEED, HYPOTHESIS_EXAMPLES, Sandbox, Tally

TALLY = Tally()


@pytest.fixture(scope="session")
def tally() -> Tally:
    return TALLY


@pytest.fixture(scope="session")
def sandbox():
    box = Sandbox()
    yield box
    box.close()


def pytest_sessionfinish(session):
    if not any(TALLY.tried[k] for k in TALLY.tried):
        return
    data = {"seed": FUZZ_SEED, "budgets": {"hypothesis_examples": HYPOTHESIS_EXAMPLES, "fuzz_cases": FUZZ_CASES,
                                           "fault_cases": FAULT_CASES}, **TALLY.summary()}
    target = os.environ.get("FUSELM_RELIABILITY_SUMMARY")
    path = Path(target) if target else session.config._tmp_path_factory.getbasetemp() / "reliability-summary.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    session.config._reliability_summary = (data, path)


def pytest_terminal_summary(terminalreporter, config):
    found = getattr(config, "_reliability_summary", None)
    if found is None:
        return
    data, path = found
    w = terminalreporter
    w.section("fuselm reliability")
    names = {"valid": "valid random configs (convert f32+q4, optimize, validate)",
             "malformed": "malformed inputs (must exit 2: message, no traceback, nothing written)",
             "fault": "injected faults (kills, disk full, concurrent writers: nothing lost or half written)",
             "rerun": "reruns in fresh processes (every output file byte-identical)"}
    for kind, label in names.items():
        d = data[kind]
        w.write_line(f"{d['tried']:6d} {label}: {d['broken']} broke a promise")
        for category, c in d["by_category"].items():
            w.write_line(f"         {c['tried']:5d}  {category}" + (f"  ({c['broken']} broken)" if c["broken"] else ""))
    w.write_line(f"summary: {path}")
