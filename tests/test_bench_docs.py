"""docs/benchmarks.md and README.md's generated tables are what scripts/bench_docs.py makes of the committed
result files (so a figure cannot drift from its run); a result file the script cannot read is reported; the
README's switch table lists every FUSELM_* variable the product code reads."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("fuselm", "exporter", "passes", "runtime_metal")
SWITCH = re.compile(r"\bFUSELM_[A-Z0-9_]+\b")


@pytest.fixture(scope="module")
def bench_docs():
    spec = importlib.util.spec_from_file_location("bench_docs", ROOT / "scripts" / "bench_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_docs"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered(bench_docs):
    return bench_docs.render(ROOT)


def test_generated_files_are_up_to_date(rendered):
    out, problems = rendered
    assert problems == []
    for path, text in out.items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is out of date: run python scripts/bench_docs.py"


def test_every_result_file_is_listed_and_every_family_section_exists(bench_docs, rendered):
    page = rendered[0][ROOT / "docs" / "benchmarks.md"]
    for path in (ROOT / "bench" / "results").rglob("*"):
        if path.is_file():
            assert f"[`{path.relative_to(ROOT / 'bench' / 'results').as_posix()}`]" in page
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", page, re.M)}
    assert {anchor for _, _, anchor in bench_docs.FAMILIES} <= anchors


def test_a_file_it_cannot_read_is_reported(bench_docs, tmp_path):
    """A damaged result file, one no family claims and a directive naming a missing file are each a problem,
    named in the page, and the table that needs the damaged file says it was not rendered."""
    (tmp_path / "docs").mkdir()
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    shutil.copy(ROOT / "bench" / "results" / "moe-convert.json", results / "moe-convert.json")
    (results / "passes.json").write_text('{"rows": [')
    (results / "mystery.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "docs" / "benchmarks.in.md").write_text(
        "## Convert\n{{table moe_convert moe-convert.json}}\n{{table passes passes.json}}\n"
        "{{table convert convert.json}}\n{{index}}\n")
    (tmp_path / "README.md").write_text("<!-- bench_docs:convert -->\n<!-- /bench_docs -->\n")
    out, problems = bench_docs.render(tmp_path)
    # passes.json unreadable, and its table; mystery.json; convert.json's table; the README block's file
    assert len(problems) == 5, problems
    assert any("passes.json: cannot be read as JSON" in p for p in problems)
    assert any("mystery.json: no family" in p for p in problems)
    assert any("convert.json: no such result file" in p for p in problems)
    page = out[tmp_path / "docs" / "benchmarks.md"]
    assert "| 64 | q4 | 39.3 | 725 | 803 |" in page  # the readable file's table is there, figures from it
    assert page.count("*(not rendered:") == 2 and "## Result files that could not be read" in page


def test_readme_lists_every_switch_the_code_reads():
    read = {m for d in PRODUCT for f in (ROOT / d).rglob("*.py") for m in SWITCH.findall(f.read_text())}
    everywhere = read | {m for d in ("bench", "scripts", "tests") for f in (ROOT / d).rglob("*.py")
                         for m in SWITCH.findall(f.read_text())}
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(FUSELM_[A-Z0-9_]+)` \|", readme, re.M))
    assert read - table == set(), "switches the code reads that README.md's table does not list"
    assert table - everywhere == set(), "switches README.md lists that no code reads"
    assert len(readme.splitlines()) <= 500
