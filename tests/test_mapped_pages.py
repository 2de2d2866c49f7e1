"""runtime_metal/engines/mapped_pages.py (a model file's resident pages given back) and the IO-binding loop's prompt in pieces."""

from __future__ import annotations

import mmap
import re
import sys

import numpy as np
import pytest
from fuselm.runtime_metal.engines import mapped_pages, ort

import fuselm
from fuselm.options import Options

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _resident_kb(path) -> list[int]:
    """Rss of each of this process's mappings of `path`, in kB."""
    out, cur = [], False
    for line in open("/proc/self/smaps"):
        if m := re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line):
            cur = m.group(1) == str(path.resolve())
        elif cur and line.startswith("Rss:"):
            out.append(int(line.split()[1]))
    return out


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "model.onnx.data"
    path.write_bytes(np.random.default_rng(0).integers(0, 255, 4 << 20, dtype=np.uint8).tobytes())
    return path


def test_release_drops_clean_pages_and_keeps_the_bytes(data_file):
    """A read mapping's pages leave the process and read back the same; a mapping with a written (copied)
    page is left alone, its write kept."""
    want = data_file.read_bytes()
    with open(data_file, "rb") as f:
        clean = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    assert bytes(clean[:]) == want and _resident_kb(data_file)[0] > 1024  # its pages touched
    assert mapped_pages.release(data_file) == 1
    assert _resident_kb(data_file) == [0]
    assert bytes(clean[:]) == want
    clean.close()
    with open(data_file, "rb") as f:
        written = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    written[5] = (want[5] + 1) % 256
    before = _resident_kb(data_file)
    assert mapped_pages.release(data_file) == 0
    assert _resident_kb(data_file) == before and written[5] == (want[5] + 1) % 256
    written.close()


def test_while_loading_leaves_nothing_resident(data_file):
    """The pages a load read (a mapping made and read inside the body) are gone when it ends; its thread too."""
    import threading

    with mapped_pages.while_loading(data_file):
        with open(data_file, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert len(bytes(m[:])) == 4 << 20
    assert _resident_kb(data_file) == [0]
    assert not any(t.name == "fuselm-page-out" for t in threading.enumerate())
    m.close()


@pytest.mark.parametrize("target", [None, "onnxruntime"])
def test_a_prompt_in_pieces_gives_the_same_tokens_and_logits(exported, tmp_path, monkeypatch, target):
    """The IO-binding loop runs a long prompt PREFILL_CHUNK tokens at a time (with its own cache or GQA's
    shared buffer): the same greedy tokens and logits as the prompt in one run."""
    model = fuselm.optimize(exported("qwen3", "q4"), tmp_path / "m", target=target, quiet=True)
    prompt = [5, 9, 2, 7, 11, 3, 8, 4, 6]
    got = []
    for chunk in (len(prompt), 2):
        monkeypatch.setattr(ort, "PREFILL_CHUNK", chunk)
        trace = ort.OrtEngine(model, model, Options(threads=1), loop="ort").trace(prompt, 5)
        got.append((trace.tokens, np.stack(trace.logits)))
    assert got[0][0] == got[1][0]
    np.testing.assert_allclose(got[1][1], got[0][1], rtol=0, atol=1e-4)
