"""The runtime's load-time rewrites (runtime_metal/rewrites/): listed by `fuselm diff --target`, each with its
drift, and skippable at load (`--skip`) without changing the tokens."""

from __future__ import annotations

import io

import pytest
from fuselm.runtime_metal.rewrites import REWRITES

import fuselm
from fuselm.cli import main


@pytest.fixture(scope="module")
def q4(optimized):
    return optimized("qwen3", "q4")


def test_diff_target_walks_the_rewrites_with_their_drift(exported, tmp_path):
    data = fuselm.diff(exported("qwen3", "q4"), target="numpy", quiet=True, json_path=tmp_path / "d.json")
    runtime = [r for r in data["passes"] if r.get("runtime")]
    assert [r["pass"] for r in runtime] == ["Runtime(numpy)", *(r.name for r in REWRITES)]
    fired = {r["pass"]: r for r in runtime if r["changed"]}
    assert {"FoldQuantizedWeights", "LastRows", "CausalMasks"} <= set(fired)
    assert "QMatMul" in fired["FoldQuantizedWeights"]["ops_after"]
    for r in fired.values():  # the numpy backend computes in f32: every stage within rounding of the one before
        assert r["drift"]["decode"]["logits_rel"] < 1e-5, (r["pass"], r["drift"])
    qkv = next(r for r in runtime if r["pass"] == "QKVHeads")
    assert not qkv["changed"] and "does not read the cache causally" in qkv["skipped"][0]["reason"]
    assert (tmp_path / "d.json").is_file()


@pytest.mark.parametrize("skip", [r.aliases[0] for r in REWRITES])
def test_each_rewrite_can_be_skipped_at_load(q4, skip):
    kw = dict(prompt=[5, 6, 7, 8], max_tokens=4, ignore_eos=True, quiet=True, stream=io.StringIO(), backend="numpy")
    assert fuselm.run(q4, skip=[skip], **kw)["tokens"] == fuselm.run(q4, **kw)["tokens"]


def test_a_name_that_is_no_rewrite_is_refused(q4, capsys):
    assert main(["run", str(q4), "--prompt-ids", "5", "--backend", "torch", "--skip", "no-such-rewrite"]) == 2
    assert "no such runtime rewrite" in capsys.readouterr().err
