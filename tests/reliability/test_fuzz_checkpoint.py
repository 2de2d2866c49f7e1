"""Malformed checkpoints for `fuselm convert`: generated configs, safetensors and shard indexes.

Every case runs the real command in a child process whose address space is capped at its size
plus 2 GiB, so an allocation sized by a bad value (a hidden size needing terabytes) fails the case
instead of passing slowly. Each case must end in exit 2 with a message, no traceback, and nothing
at OUT or beside it. Valid-looking mutations (a safetensors header flip that only touches
metadata) must instead convert to exactly the files the unmutated checkpoint gives.

The existing hand-written cases (tests/test_convert_inputs.py) name the messages; these tests
generate many cases per family of mistakes and count them (tests/reliability/conftest.py).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from reliability_helpers import FUZZ_CASES, FUZZ_SEED, refused, same_files
from safetensors import safe_open
from safetensors.numpy import save_file

MEMORY_GIB = 2
_case = itertools.count()
# Values that are wrong for a field of each kind; "absurd" ones would need terabytes.
WRONG = {
    "count": ["DELETE", None, "64", 64.5, True, [], {}, -1, 0, 2**40, 10**30, float("nan"), -(2**63)],
    "dim": ["64", 64.5, True, [], -1, 0, 2**40, 10**30, float("inf")],  # optional: None means the default
    "length": ["64", 64.5, True, [], -1, 0, float("inf")],  # a bound, not a size: a huge one is harmless
    "eps": ["1e-6", [], -1e-6, float("nan"), float("inf"), True],
    "bool": ["yes", 1, 0.0, [], {}],
    "name": [5, [], {}, "", "gpt2", None, "DELETE"],
    "act": ["gelu", "relu", 5, [], {}],
    "architectures": [5, "Qwen3ForCausalLM", [5], {}, True],
    "rope": ["default", 5, [], True, {"rope_type": "dynamic", "factor": 2.0}, {"rope_type": 5},
            {"rope_type": "linear", "rope_theta": 1e4}, {"rope_type": "default", "rope_theta": -1.0},
            {"rope_type": "default", "rope_theta": 0}, {"rope_type": "default", "rope_theta": "1e4"},
            {"rope_type": "default", "rope_theta": float("nan")},
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0},
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1e12},
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": -0.5},
            {"rope_type": "linear", "rope_theta": 1e4, "factor": 0},
            {"rope_type": "linear", "rope_theta": 1e4, "factor": "2"},
            {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0},
            {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 0},
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": -16},
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
             "beta_fast": 0},
            {"rope_type": "yarn", "rope_theta": 1.0, "factor": 4.0, "original_max_position_embeddings": 16}],
}
FIELDS = {
    "hidden_size": "count", "intermediate_size": "count", "num_hidden_layers": "count",
    "num_attention_heads": "count", "vocab_size": "count", "num_key_value_heads": "dim",
    "max_position_embeddings": "length", "rms_norm_eps": "eps", "tie_word_embeddings": "bool", "model_type": "name",
    "hidden_act": "act", "architectures": "architectures", "rope_parameters": "rope",
}
# head_dim is optional (deleting it means hidden / heads, which is right for the tiny mistral)
FAMILY_FIELDS = {"qwen3": {"head_dim": "dim", "attention_bias": "bool"}, "qwen2": {"use_sliding_window": "bool"},
                 "llama": {"attention_bias": "bool", "mlp_bias": "bool"},
                 "mistral": {"head_dim": "dim", "sliding_window": "length"}}
# Whole-file damage to config.json.
BROKEN_FILES = [b"", b"{", b"[1, 2]", b"null", b'"qwen3"', b"\xff\xfe\x00garbage", b"[" * 100_000,
                b'{"model_type": "qwen3", "hidden_size": 64' + b', "x": 1' * 50_000]


def _convert(sandbox, hf: Path, out: Path) -> dict:
    return sandbox.run(["convert", hf, "-o", out, "--quiet"], memory_gib=MEMORY_GIB, timeout=120)


@pytest.fixture(scope="module")
def work(make_ckpt, tmp_path_factory):
    """A private copy of each family's tiny checkpoint (cases edit one file and put it back)."""
    root = tmp_path_factory.mktemp("fuzz-ckpt")
    return {f: shutil.copytree(make_ckpt(f), root / f) for f in ("qwen3", "qwen2", "llama", "mistral")}


@st.composite
def config_mutation(draw):
    family = draw(st.sampled_from(sorted(FAMILY_FIELDS)))
    field, kind = draw(st.sampled_from(sorted({**FIELDS, **FAMILY_FIELDS[family]}.items())))
    value = draw(st.sampled_from(WRONG[kind]))
    return family, field, value


@given(mutation=config_mutation())
@seed(FUZZ_SEED)
@settings(max_examples=FUZZ_CASES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_wrong_config_fields_are_refused(mutation, work, sandbox, tally, tmp_path):
    family, field, value = mutation
    hf = work[family]
    original = (hf / "config.json").read_bytes()
    config = json.loads(original)
    if value == "DELETE":
        config.pop(field, None)
    else:
        config[field] = value
    out = tmp_path / f"out-{next(_case)}"  # tmp_path is shared by the examples
    try:
        (hf / "config.json").write_text(json.dumps(config))
        answer = _convert(sandbox, hf, out)
    finally:
        (hf / "config.json").write_bytes(original)
    why = refused(answer, out)
    assert tally.record("malformed", "config.json field", not why), (family, field, value, why, answer["stderr"][-600:])


@pytest.mark.parametrize("content", BROKEN_FILES, ids=lambda b: repr(b[:12]))
def test_broken_config_files_are_refused(content, work, sandbox, tally, tmp_path):
    hf = work["qwen3"]
    original = (hf / "config.json").read_bytes()
    try:
        (hf / "config.json").write_bytes(content)
        answer = _convert(sandbox, hf, tmp_path / "out")
    finally:
        (hf / "config.json").write_bytes(original)
    why = refused(answer, tmp_path / "out")
    assert tally.record("malformed", "config.json file", not why), (why, answer["stderr"][-600:])


def _header(data: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", data[:8])[0]
    return n, json.loads(data[8:8 + n])


def _with_header(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _safetensors_mutations(original: bytes, rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """Seeded damage to a safetensors file: header bit flips, header lengths, truncations, and
    structured edits of the header (shapes, dtypes, offsets, dropped or renamed tensors)."""
    size, header = _header(original)
    body = original[8 + size:]
    names = [k for k in header if k != "__metadata__"]
    cases = []
    for _ in range(n):
        kind = rng.choice(["flip", "flip", "length", "truncate", "shape", "dtype", "offsets", "drop", "rename"])
        if kind == "flip":
            data = bytearray(original)
            data[rng.randrange(8 + size)] ^= 1 << rng.randrange(8)
            cases.append(("header bit flip", bytes(data)))
        elif kind == "length":
            value = rng.choice([0, 1, 7, size - 8, size + 8, len(original), 2**32, 2**63, 2**64 - 1])
            cases.append(("header length", struct.pack("<Q", value) + original[8:]))
        elif kind == "truncate":
            cases.append(("truncated file", original[:rng.randrange(len(original))]))
        else:
            h = json.loads(json.dumps(header))
            name = rng.choice(names)
            if kind == "shape":
                h[name]["shape"] = rng.choice([[2**40, 2**40], [2**62], [-1, 64], [0], [], [1] * 40, ["a"], None,
                                               [d + 1 for d in h[name]["shape"]]])
            elif kind == "dtype":
                h[name]["dtype"] = rng.choice(["I64", "BOOL", "F64", "U8", "X", None, 5, "F8_E4M3"])
            elif kind == "offsets":
                start, stop = h[name]["data_offsets"]
                h[name]["data_offsets"] = rng.choice([[0, 2**63], [-1, stop], [stop, start], [start, start],
                                                      [start, len(body) + 64], ["a", "b"], [start], None])
            elif kind == "drop":
                del h[name]
            else:
                h[name + ".extra"] = h.pop(name)
            cases.append((f"header {kind}", _with_header(h, body)))
    return cases


def _reads_as_original(path: Path, reference: dict) -> bool:
    """The independent reader (safetensors itself) sees the same tensors as in the unmutated file."""
    try:
        with safe_open(path, framework="numpy") as f:
            got = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # noqa: BLE001 - any failure: the file is not valid
        return False
    return got.keys() == reference.keys() and all(
        got[k].dtype == reference[k].dtype and got[k].shape == reference[k].shape and (got[k] == reference[k]).all()
        for k in got)


def test_damaged_safetensors_are_refused(work, sandbox, tally, tmp_path, exported):
    hf = work["qwen3"]
    path = hf / "model.safetensors"
    original = path.read_bytes()
    with safe_open(path, framework="numpy") as f:
        reference = {k: f.get_tensor(k) for k in f.keys()}
    rng = random.Random(FUZZ_SEED)
    failures = []
    try:
        for i, (kind, data) in enumerate(_safetensors_mutations(original, rng, 2 * FUZZ_CASES)):
            path.write_bytes(data)
            out = tmp_path / f"out{i}"
            answer = _convert(sandbox, hf, out)
            if answer["rc"] == 0 and _reads_as_original(path, reference):
                ok = same_files(out, exported("qwen3"))  # a harmless flip: the same model, the same files
            else:
                ok = not refused(answer, out)
            if not tally.record("malformed", f"safetensors {kind}", ok):
                failures.append((kind, answer["rc"], answer["stderr"][-300:]))
    finally:
        path.write_bytes(original)
    assert not failures, failures


def _index_cases(hf: Path) -> list[tuple[str, object]]:
    """(what, edit(hf)) pairs that make a sharded checkpoint inconsistent or unsafe."""
    index_path = hf / "model.safetensors.index.json"
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))

    def edit_map(change):
        def apply(d: Path):
            index = json.loads((d / index_path.name).read_text())
            change(index["weight_map"], index)
            (d / index_path.name).write_text(json.dumps(index))
        return apply

    def first_other(wm, name):
        return next(s for s in shards if s != wm[name])

    some = "model.layers.0.mlp.up_proj.weight"
    return [
        ("tensor moved to another shard in the index", edit_map(lambda wm, i: wm.__setitem__(some, first_other(wm, some)))),
        ("tensor missing from the index", edit_map(lambda wm, i: wm.pop(some))),
        ("index lists a tensor no shard holds", edit_map(lambda wm, i: wm.__setitem__("model.extra.weight", shards[0]))),
        ("index lists a missing shard", edit_map(lambda wm, i: wm.__setitem__(some, "model-99999-of-99999.safetensors"))),
        ("shard path with ..", edit_map(lambda wm, i: wm.__setitem__(some, f"../{hf.name}/{wm[some]}"))),
        ("absolute shard path", edit_map(lambda wm, i: wm.__setitem__(some, str(hf / wm[some])))),
        ("shard name not a string", edit_map(lambda wm, i: wm.__setitem__(some, 5))),
        ("weight_map is a list", edit_map(lambda wm, i: i.__setitem__("weight_map", list(wm.items())))),
        ("no weight_map", edit_map(lambda wm, i: i.pop("weight_map"))),
        ("index is not JSON", lambda d: (d / index_path.name).write_text('{"weight_map": {')),
        ("index is a list", lambda d: (d / index_path.name).write_text("[]")),
        ("a shard deleted", lambda d: (d / shards[-1]).unlink()),
        ("a shard truncated", lambda d: (d / shards[0]).write_bytes((d / shards[0]).read_bytes()[:1000])),
        ("a shard is a link outside the checkpoint", _link_shard_outside(shards[0])),
        ("a tensor stored in two shards", _duplicate_tensor(shards)),
    ]


def _link_shard_outside(shard: str):
    def apply(d: Path):
        outside = d.parent / f"outside-{shard}"
        shutil.move(d / shard, outside)
        (d / shard).symlink_to(outside)
    return apply


def _duplicate_tensor(shards: list[str]):
    def apply(d: Path):
        with safe_open(d / shards[0], framework="numpy") as f:
            name = next(iter(f.keys()))
            tensor = f.get_tensor(name)
        with safe_open(d / shards[1], framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        save_file({**tensors, name: tensor}, d / shards[1], metadata={"format": "pt"})
    return apply


def test_inconsistent_sharded_checkpoints_are_refused(make_ckpt, sandbox, tally, tmp_path):
    source = make_ckpt("qwen3", shard_size="100KB")
    assert len(list(source.glob("model-*.safetensors"))) >= 3
    failures = []
    for i, (what, edit) in enumerate(_index_cases(source)):
        hf = shutil.copytree(source, tmp_path / f"case{i}" / "hf")
        edit(hf)
        out = tmp_path / f"case{i}" / "out"
        answer = _convert(sandbox, hf, out)
        if not tally.record("malformed", "sharded index", not refused(answer, out)):
            failures.append((what, refused(answer, out), answer["stderr"][-300:]))
    assert not failures, failures


def test_the_memory_cap_catches_an_allocation(sandbox, tmp_path):
    """The harness's own check: a child that allocates terabytes fails under the cap (not the machine)."""
    answer = sandbox.run(python=f"import numpy; numpy.ones({2**40 // 8}, numpy.float64)", memory_gib=MEMORY_GIB)
    assert answer["rc"] == 1 and "MemoryError" in (answer["exception"] or "") and math.isfinite(answer["seconds"])
