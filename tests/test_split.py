"""`fuselm split`: stage graphs chained in onnxruntime give the unsplit graph's logits exactly."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from fuselm.passes.split import split

import fuselm
from fuselm import contract
from fuselm.errors import FuselmError
from fuselm.reference import OrtRunner, ort_session

LAYERS = 4  # 3 stages need 3 layers at least; the fixtures' default has 2


@pytest.fixture(scope="module")
def model(exported, optimized):
    def get(kind: str, quant: str):
        return (optimized if kind == "optimized" else exported)("qwen3", quant, num_hidden_layers=LAYERS)

    return get


def chained(stage_dirs, ids, past: dict | None):
    """Run the stages one after another (each stage's hidden output is the next one's input) -> logits, presents."""
    hidden, presents, logits = None, {}, None
    done = next(iter(past.values())).shape[2] if past else 0
    for d in stage_dirs:
        sess = ort_session(d)
        names = [i.name for i in sess.get_inputs()]
        feeds = {contract.ATTENTION_MASK: np.ones((1, done + ids.shape[1]), np.int64),
                 contract.POSITION_IDS: np.arange(done, done + ids.shape[1], dtype=np.int64)[None]}
        feeds[contract.INPUT_IDS if contract.INPUT_IDS in names else contract.HIDDEN] = \
            ids if contract.INPUT_IDS in names else hidden
        for i in sess.get_inputs():
            if contract.is_past(i.name):
                feeds[i.name] = past[i.name] if past else np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
        outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        hidden = outs.pop(contract.NEXT_HIDDEN, None)
        logits = outs.pop(contract.LOGITS, logits)
        presents.update(outs)
    return logits, presents


@pytest.fixture(scope="module")
def traced(make_ckpt, tmp_path_factory):
    """torch.onnx's export (the traced exporter) of the same checkpoint, and it optimized: its names put
    the mask's nodes inside layer 0's scope, which free-node detection must see through."""
    out = tmp_path_factory.mktemp("traced")
    fuselm.convert(make_ckpt("qwen3", num_hidden_layers=LAYERS), out / "exp", exporter="torch", quiet=True)
    fuselm.optimize(out / "exp", out / "opt", quiet=True)
    return out


@pytest.mark.parametrize(("kind", "quant"), [("optimized", "f32"), ("optimized", "q4"), ("exported", "f32"),
                                            ("exported", "q4"), ("traced", "f32"), ("traced-optimized", "f32")])
@pytest.mark.parametrize("n", [2, 3])
def test_chained_stages_equal_the_unsplit_graph(model, traced, tmp_path, kind, quant, n):
    if kind.startswith("traced"):
        src = traced / ("opt" if kind.endswith("optimized") else "exp")
    else:
        src = model(kind, quant)
    report = split(src, tmp_path / "s", stages=n, quiet=True)
    dirs = [tmp_path / "s" / f"stage{k}" for k in range(n)]
    assert json.loads((tmp_path / "s" / "split.json").read_text()) == report
    covered = [i for s in report["stages"] for i in range(s["layers"][0], s["layers"][1] + 1)]
    assert covered == list(range(LAYERS))
    for d in dirs:
        onnx.checker.check_model(str(d / contract.MODEL_NAME), full_check=True)
        assert fuselm.modeldir.read_meta(d)["pipeline"]["of"] == n
    # every weight is written once per stage: the stages hold no more than the source plus shared small tensors
    assert sum(s["bytes"] for s in report["stages"]) >= report["source_bytes"]

    ref = OrtRunner(src)
    ids = np.array([[5, 17, 3, 42, 8, 1]], np.int64)
    want_logits, want_present = ref.forward(ids)
    got_logits, got = chained(dirs, ids, None)
    np.testing.assert_array_equal(got_logits, want_logits)
    past = {contract.past_name(i, k): want_present[2 * i + (k == "value")] for i in range(LAYERS) for k in contract.KINDS}
    for name, value in past.items():
        np.testing.assert_array_equal(got[contract.present_of(name)], value)
    nxt = np.array([[int(np.argmax(want_logits[0, -1]))]], np.int64)
    want_step, _ = ref.forward(nxt, past=[past[k] for k in contract.cache_names(LAYERS)])
    got_step, _ = chained(dirs, nxt, past)
    np.testing.assert_array_equal(got_step, want_step)


def test_explicit_layers_and_bad_lists(model, tmp_path):
    src = model("optimized", "f32")
    report = split(src, tmp_path / "a", layers="0-2,3", quiet=True)
    assert [s["layers"] for s in report["stages"]] == [[0, 2], [3, 3]]
    assert report["stages"][0]["input"] == contract.INPUT_IDS and report["stages"][1]["output"] == contract.LOGITS
    for bad in ("0-1,3", "0-3,3", "1-3", "0-1", "a-b"):
        with pytest.raises(FuselmError, match="--layers"):
            split(src, tmp_path / "b", layers=bad, quiet=True)
    with pytest.raises(FuselmError, match="--stages 5"):
        split(src, tmp_path / "c", stages=5, quiet=True)


def test_balanced_by_bytes(model, tmp_path):
    """Stage 0 carries the embedding, so with a tied head the balance gives it fewer layers than an even split
    would only when the bytes say so: the chosen cut minimizes the largest stage over every contiguous cut."""
    from fuselm.passes import graphio
    from fuselm.passes.split import Graph

    src = model("optimized", "q4")
    g = Graph(graphio.load(src / contract.MODEL_NAME))
    chosen = g.balanced(2)
    worst = max(s.bytes for s in g.plan(chosen))
    for cut in range(1, LAYERS):
        assert worst <= max(s.bytes for s in g.plan([range(0, cut), range(cut, LAYERS)]))


def test_cli_split_exit_codes(model, tmp_path, capsys):
    from fuselm.cli import main

    src = model("optimized", "f32")
    assert main(["split", str(src), "-o", str(tmp_path / "s"), "--stages", "2"]) == 0
    assert "stage1: layers" in capsys.readouterr().out
    assert main(["split", str(src), "-o", str(tmp_path / "s"), "--stages", "2"]) == 2  # exists, no --force
    assert main(["split", str(src), "-o", str(tmp_path / "s"), "--stages", "2", "--force"]) == 0
    assert main(["split", str(src), "-o", str(tmp_path / "t"), "--layers", "0-9"]) == 2
    assert "covers layers" in capsys.readouterr().err
