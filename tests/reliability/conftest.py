"""Fixtures for the reliability tests: a fork server that runs fuselm commands in isolated child
processes, and the tally of every generated case and injected fault (reliability_report.py prints it).

Budgets (CI runs the small defaults; raise them for long runs):
  FUSELM_HYPOTHESIS_EXAMPLES=N   generated valid configs in the property test (default 8, plus 2 fixed)
  FUSELM_FUZZ_CASES=N            seeded mutations per malformed-input family (default 50)
  FUSELM_FAULT_CASES=N           random kill / disk-full points per command (default 6)
  FUSELM_FUZZ_SEED=S             the seed of the mutations and fault points (default 0)
"""

from __future__ import annotations

import pytest
from reliability_helpers import Sandbox, Tally
from reliability_report import TALLY


@pytest.fixture(scope="session")
def tally() -> Tally:
    return TALLY


@pytest.fixture(scope="session")
def sandbox():
    box = Sandbox()
    yield box
    box.close()
