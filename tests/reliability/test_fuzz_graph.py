"""Malformed model directories for `fuselm optimize`, `run` and `validate`: generated graph damage.

Seeded mutations of exported and optimized tiny models (f32 and q4): cycles, dangling inputs and
outputs, values produced twice, wrong element types, absurd and negative shapes, external data
outside the directory (absolute, `..`, a symlink), missing / truncated data files, bad offsets,
damaged protobuf bytes and damaged fuselm.json fields. Each case runs the real command in a child
process capped at its size plus 2 GiB.

Oracles: a mutation that makes the graph invalid by construction must be refused (exit 2, a message,
no traceback, nothing written). Where validity is not obvious (a changed element type, a flipped
byte), an independent judge decides: onnx.checker for `optimize` (a graph transform), and
onnxruntime running the prefill for `run`; what the judge rejects fuselm must refuse, what it
accepts fuselm may run or refuse, and no case may end in a traceback.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto
from reliability_helpers import FUZZ_CASES, FUZZ_SEED, refused

MEMORY_GIB = 2
SOURCES = [("qwen3", "f32", "exported"), ("llama", "q4", "exported"), ("qwen2", "f32", "optimized"),
           ("mistral", "q4", "optimized")]
_case = itertools.count()


def _load(d: Path) -> onnx.ModelProto:
    return onnx.load(str(d / "model.onnx"), load_external_data=False)


def _save(m: onnx.ModelProto, d: Path) -> None:
    onnx.save(m, str(d / "model.onnx"))


def _external(m: onnx.ModelProto) -> list[TensorProto]:
    return [t for t in m.graph.initializer if t.data_location == TensorProto.EXTERNAL]


def _set_info(t: TensorProto, key: str, value: str | None) -> None:
    for i, e in enumerate(t.external_data):
        if e.key == key:
            if value is None:
                del t.external_data[i]
            else:
                e.value = value
            return
    if value is not None:
        entry = t.external_data.add()
        entry.key, entry.value = key, value


# --- invalid by construction ------------------------------------------------------------------
def cycle(m, d, rng):
    """A node reads the output of one of its descendants."""
    g = m.graph
    while True:
        i = rng.randrange(len(g.node) - 1)
        frontier, descendants = set(g.node[i].output), []
        for n in g.node[i + 1:]:
            if frontier & set(n.input):
                frontier |= set(n.output)
                descendants.append(n.output[0])
        if descendants and g.node[i].input:
            g.node[i].input[0] = rng.choice(descendants)
            return


def dangling_input(m, d, rng):
    n = rng.choice([n for n in m.graph.node if n.input])
    n.input[rng.randrange(len(n.input))] = f"nobody_writes_{rng.randrange(10**6)}"


def dangling_output(m, d, rng):
    m.graph.output[rng.randrange(len(m.graph.output))].name = "nobody_writes_this"


def produced_twice(m, d, rng):
    a, b = rng.sample(range(len(m.graph.node)), 2)
    m.graph.node[b].output[0] = m.graph.node[a].output[0]


def absurd_dims(m, d, rng):
    t = rng.choice(list(m.graph.initializer))
    t.dims[:] = rng.choice([[2**40, 2**40], [2**62], [int(x) * 1000 + 1 for x in t.dims] or [2**33]])


def negative_dim(m, d, rng):
    t = rng.choice([t for t in m.graph.initializer if t.dims])
    t.dims[rng.randrange(len(t.dims))] = -rng.choice([1, 7, 2**40])


def location_absolute(m, d, rng):
    shutil.copyfile(d / "model.onnx.data", d.parent / "elsewhere.data")
    _set_info(rng.choice(_external(m)), "location", str(d.parent / "elsewhere.data"))


def location_dotdot(m, d, rng):
    shutil.copyfile(d / "model.onnx.data", d.parent / "elsewhere.data")
    _set_info(rng.choice(_external(m)), "location", "../elsewhere.data")


def location_system_file(m, d, rng):
    t = rng.choice(_external(m))
    _set_info(t, "location", rng.choice(["/etc/passwd", "/proc/self/environ", "../../../../etc/hostname"]))
    _set_info(t, "offset", "0")


def data_symlink_outside(m, d, rng):
    outside = d.parent / "outside" / "model.onnx.data"
    outside.parent.mkdir()
    shutil.move(d / "model.onnx.data", outside)
    os.symlink(outside, d / "model.onnx.data")


def directory_symlink_outside(m, d, rng):
    (d.parent / "outside").mkdir()
    shutil.move(d / "model.onnx.data", d.parent / "outside" / "model.onnx.data")
    os.symlink(d.parent / "outside", d / "weights")
    for t in _external(m):
        _set_info(t, "location", "weights/model.onnx.data")


def data_missing(m, d, rng):
    (d / "model.onnx.data").unlink()


def data_truncated(m, d, rng):
    size = (d / "model.onnx.data").stat().st_size
    needed = max(int(dict((e.key, e.value) for e in t.external_data).get("offset", 0)) for t in _external(m))
    os.truncate(d / "model.onnx.data", rng.randrange(min(needed, size)))


def offset_garbage(m, d, rng):
    _set_info(rng.choice(_external(m)), rng.choice(["offset", "length"]),
              rng.choice(["-64", "abc", "1e3", "0x10", " 12", str(2**64), ""]))


def offset_beyond(m, d, rng):
    size = (d / "model.onnx.data").stat().st_size
    _set_info(rng.choice(_external(m)), "offset", str(size + rng.randrange(1, 2**40)))


def length_short(m, d, rng):
    t = rng.choice([t for t in _external(m) if int(dict((e.key, e.value) for e in t.external_data)["length"]) > 1])
    _set_info(t, "length", str(rng.randrange(int(dict((e.key, e.value) for e in t.external_data)["length"]))))


def no_location(m, d, rng):
    _set_info(rng.choice(_external(m)), "location", None)


INVALID = [cycle, dangling_input, dangling_output, produced_twice, absurd_dims, negative_dim, location_absolute,
           location_dotdot, location_system_file, data_symlink_outside, directory_symlink_outside, data_missing,
           data_truncated, offset_garbage, offset_beyond, length_short, no_location]


# --- judged: validity is not obvious --------------------------------------------------------------
def input_dtype(m, d, rng):
    vi = rng.choice(list(m.graph.input))
    vi.type.tensor_type.elem_type = rng.choice([t for t in (TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32,
                                                            TensorProto.FLOAT16, TensorProto.BOOL, TensorProto.DOUBLE,
                                                            TensorProto.UINT8, TensorProto.STRING)
                                                if t != vi.type.tensor_type.elem_type])


def initializer_dtype(m, d, rng):
    t = rng.choice(list(m.graph.initializer))
    t.data_type = rng.choice([x for x in (TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32, TensorProto.FLOAT16,
                                          TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT4, TensorProto.STRING,
                                          TensorProto.BFLOAT16, 999) if x != t.data_type])


def input_dims(m, d, rng):
    vi = rng.choice(list(m.graph.input))
    dims = vi.type.tensor_type.shape.dim
    if dims:
        dims[rng.randrange(len(dims))].dim_value = rng.choice([0, 3, 2**40])


def attribute_value(m, d, rng):
    n = rng.choice([n for n in m.graph.node if any(a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)
                                                   for a in n.attribute)])
    a = rng.choice([a for a in n.attribute if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)])
    if a.type == onnx.AttributeProto.INT:
        a.i = rng.choice([-(2**40), -5, 0, 1, 3, 7, 99, 2**40])
    else:
        a.ints[:] = rng.sample(list(a.ints), len(a.ints)) if rng.random() < 0.5 else [rng.choice([-9, 0, 99])] * len(a.ints)


def proto_bytes(m, d, rng):
    """Bit flips in the serialized graph (applied after saving)."""


JUDGED = [input_dtype, initializer_dtype, input_dims, attribute_value, proto_bytes]


def _judge(sandbox, model: Path, command: str) -> bool:
    """Run the judge in a capped child too: a broken graph must not take the test process down."""
    fn = "ort_runs" if command != "optimize" else "checker_accepts"
    answer = sandbox.run(python=f"import sys; from reliability_helpers import {fn}; sys.exit(0 if {fn}({str(model)!r}) else 3)",
                         memory_gib=MEMORY_GIB, timeout=120)
    return answer["rc"] == 0


def _command(command: str, model: Path, out: Path, ckpt: Path) -> list:
    if command == "optimize":
        return ["optimize", model, "-o", out, "--quiet"]
    if command == "run":
        return ["run", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--backend", "torch"]
    if command == "diff":
        return ["diff", model, "--json", out.parent / "diff.json"]
    return ["validate", model, "--reference", ckpt, "--tokens", "2", "--backend", "torch"]


@pytest.fixture(scope="module")
def sources(exported, optimized):
    return {key: (exported if key[2] == "exported" else optimized)(key[0], key[1]) for key in SOURCES}


def _mutated(sources, tmp_path, rng, mutation) -> tuple[Path, tuple]:
    key = rng.choice(SOURCES)
    d = shutil.copytree(sources[key], tmp_path / f"case{next(_case)}" / "model")
    m = _load(d)
    mutation(m, d, rng)
    _save(m, d)
    if mutation is proto_bytes:
        data = bytearray((d / "model.onnx").read_bytes())
        for _ in range(rng.choice([1, 1, 2, 8])):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        (d / "model.onnx").write_bytes(bytes(data))
    return d, key


@pytest.mark.parametrize("command", ["optimize", "run", "validate", "diff"])
def test_invalid_graphs_are_refused(command, sources, sandbox, tally, make_ckpt, tmp_path):
    rng = random.Random(f"{FUZZ_SEED}-{command}")
    n = {"optimize": FUZZ_CASES, "run": FUZZ_CASES, "validate": FUZZ_CASES // 4, "diff": FUZZ_CASES // 4}[command]
    mutations = [INVALID[i % len(INVALID)] for i in range(n)]  # every kind, then round again
    failures = []
    for mutation in mutations:
        d, key = _mutated(sources, tmp_path, rng, mutation)
        out = d.parent / "out"
        answer = sandbox.run(_command(command, d, out, make_ckpt(key[0])), memory_gib=MEMORY_GIB, timeout=120)
        why = refused(answer, out) + (["diff wrote its report"] if (d.parent / "diff.json").exists() else [])
        if not tally.record("malformed", f"graph {command}: invalid", not why):
            failures.append((mutation.__name__, key, why, answer["stderr"][-400:]))
    assert not failures, failures


@pytest.mark.parametrize("command", ["optimize", "run"])
def test_judged_graph_damage(command, sources, sandbox, tally, make_ckpt, tmp_path):
    rng = random.Random(f"{FUZZ_SEED}-judged-{command}")
    failures = []
    for i in range(FUZZ_CASES):
        mutation = JUDGED[i % len(JUDGED)]
        d, key = _mutated(sources, tmp_path, rng, mutation)
        out = d.parent / "out"
        answer = sandbox.run(_command(command, d, out, make_ckpt(key[0])), memory_gib=MEMORY_GIB, timeout=120)
        if answer["rc"] == 2:
            ok = not refused(answer, out)
        elif answer["rc"] == 0 and not answer.get("exception"):
            ok = _judge(sandbox, d, command)  # fuselm accepted it: so must the independent judge
        else:
            ok = False
        if not tally.record("malformed", f"graph {command}: judged", ok):
            failures.append((mutation.__name__, key, answer["rc"], answer.get("exception"), answer["stderr"][-400:]))
    assert not failures, failures


FUSELM_JSON = [("dims", "x"), ("dims", None), ("dims", {"vocab": "x"}), ("dims", {"vocab": -1}), ("dims", []),
               ("quantization", "q4"), ("quantization", {"mode": 5}), ("special_tokens", "x"),
               ("special_tokens", {"eos_token_id": "x"}), ("special_tokens", {"eos_token_id": [None, {}]}),
               ("sliding_window", "x"), ("sliding_window", -5), ("rope", 5), ("stage", 5), ("passes", "x"),
               ("schema_version", 2), ("schema_version", "1"), ("family", []), (None, [1, 2]), (None, "x")]


@pytest.mark.parametrize("command", ["optimize", "run"])
def test_damaged_fuselm_json(command, sources, sandbox, tally, make_ckpt, tmp_path):
    """fuselm.json comes with the model: a damaged field is refused or ignored, never a traceback."""
    failures = []
    for field, value in FUSELM_JSON:
        d = shutil.copytree(sources[("qwen3", "f32", "exported")], tmp_path / f"case{next(_case)}" / "model")
        meta = json.loads((d / "fuselm.json").read_text())
        meta = value if field is None else {**meta, field: value}
        (d / "fuselm.json").write_text(json.dumps(meta))
        out = d.parent / "out"
        answer = sandbox.run(_command(command, d, out, make_ckpt("qwen3")), memory_gib=MEMORY_GIB, timeout=120)
        ok = (answer["rc"] == 0 and not answer.get("exception")) or not refused(answer, out)
        if not tally.record("malformed", f"fuselm.json for {command}", ok):
            failures.append((field, value, answer["rc"], answer.get("exception"), answer["stderr"][-300:]))
    assert not failures, failures


TOKENIZER_DAMAGE = [b"", b"{", b"[]", b"null", b"[" * 100_000, b"\xff\xfe garbage", b'{"model": {"type": "BPE", "vocab": 5}}']


def test_damaged_tokenizer(sources, sandbox, tally, tmp_path):
    """tokenizer.json comes with the model too: `run --prompt` refuses a damaged one with exit 2."""
    failures = []
    for content in TOKENIZER_DAMAGE:
        d = shutil.copytree(sources[("qwen3", "f32", "exported")], tmp_path / f"case{next(_case)}" / "model")
        (d / "tokenizer.json").write_bytes(content)
        answer = sandbox.run(["run", d, "--prompt", "hello", "--max-tokens", "2"], memory_gib=MEMORY_GIB, timeout=120)
        if not tally.record("malformed", "tokenizer.json for run", not refused(answer)):
            failures.append((content[:20], refused(answer), answer["stderr"][-300:]))
    assert not failures, failures
