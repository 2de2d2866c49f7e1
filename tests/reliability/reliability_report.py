"""The tally of every generated case and injected fault, printed at the end of the run and written to
`<pytest basetemp>/reliability-summary.json` (or $FUSELM_RELIABILITY_SUMMARY).

A plugin of tests/conftest.py rather than hooks of this folder's conftest: an xdist controller never
imports that conftest, yet it is the process that prints; each worker sends it its counts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from reliability_helpers import FAULT_CASES, FUZZ_CASES, FUZZ_SEED, HYPOTHESIS_EXAMPLES, Tally

TALLY = Tally()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):  # xdist controller: a worker finished
    TALLY.merge(getattr(node, "workeroutput", {}).get("fuselm_reliability"))


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller reports
        workeroutput["fuselm_reliability"] = TALLY.dump()
        return
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
