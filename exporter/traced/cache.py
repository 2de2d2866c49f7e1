"""What the traced exporter learns about an architecture, kept on disk: a later convert of the same
architecture traces nothing and never imports transformers or torch.onnx.

`Traced` is everything `build` takes from transformers' model: the layer-kind templates and the
outer one (ONNX graphs without weights), each layer's kind and mask kind, the checkpoint tensors
the model expects, its tensor names and fuselm.json's model fields. Tracing costs seconds per
architecture and stamping milliseconds, so a second convert (another precision, a fine-tune of the
same architecture) costs only its weights.

- Key: sha256 of config.json's content (less `_name_or_path`, `transformers_version`), fuselm's version, the source of exporter/traced/ and
  fuselm/contract.py, and the versions of torch, transformers, onnxscript, onnx-ir and onnx
  (everything the trace depends on; the weights and the precisions do not enter it).
- One directory per key under $FUSELM_TRACE_CACHE_DIR, else ~/.cache/fuselm/traced
  (XDG_CACHE_HOME); FUSELM_TRACE_CACHE=0 turns it off. JSON and ONNX protobufs only, no pickles.
- Written atomically (a temporary directory renamed into place): a crashed or concurrent writer
  leaves no partial entry, and a writer that finds the entry stored meanwhile (another process
  traced the same architecture at once) leaves it in place. A damaged or mismatched entry is never
  used (traced again, rewritten); a cache that cannot be written (read-only home) only costs the
  trace next time.
- The checkpoint's tensor names are part of what is stored (transformers renames some at load):
  a checkpoint of the same config with a name the entry has not seen is traced again.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from fuselm import __version__, contract, switches

from .trace import Template

FORMAT = 2
_PACKAGES = ("torch", "transformers", "onnxscript", "onnx-ir", "onnx")
_MANIFEST = "traced.json"
# config.json fields no modeling code reads (a fine-tune saved elsewhere, by another transformers)
_BOOKKEEPING = ("_name_or_path", "transformers_version")


@dataclass
class Traced:
    """One architecture as the traced exporter sees it (no torch objects: cached as data)."""

    templates: list[Template]  # by layer kind
    outer: Template
    kinds: list[int]  # per decoder layer: its kind
    masks: list[str]  # per decoder layer: its mask kind (skeleton.MASKS)
    window: int | None  # the sliding layers' window
    chunk: int | None  # the chunked layers' chunk size
    model_type: str
    layers_name: str
    embed_name: str
    head_name: str
    expected: dict[str, tuple[int, ...]]  # checkpoint tensor -> shape
    tied: list[str]  # state-dict names aliasing another parameter
    aliases: dict[str, str]
    names: dict[str, str]  # stored checkpoint name -> the model's name for it
    meta: dict  # fuselm.json's model fields
    stacks: dict = field(default_factory=dict)  # stacked MoE expert parameter -> [shape, per expert its stored parts]
    sources: list = field(default_factory=list)  # per decoder layer: the layer whose keys/values it reads, or None
    views: dict = field(default_factory=dict)  # tensors transformers converts as it loads them (Checkpoint.convert)
    concats: dict = field(default_factory=dict)  # parameter -> the stored tensors concatenated into it (converters.py)
    carried: list = field(default_factory=list)  # per decoder layer: the layer whose other output it is handed, or None


def kv_shape(t: Template) -> tuple[int, int, int]:
    """(kv heads, key width, value width) of a layer template's cache inputs; zeros for a layer without (a
    recurrent-state or feed-forward block)."""
    inp = {v.name: v.type.tensor_type.shape.dim for v in t.graph.input}
    if "past_key" not in inp:
        return 0, 0, 0
    return inp["past_key"][1].dim_value, inp["past_key"][3].dim_value, inp["past_value"][3].dim_value


def key(config: dict) -> str:
    from importlib.metadata import PackageNotFoundError, version

    kept = {k: v for k, v in config.items() if k not in _BOOKKEEPING}
    h = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode())
    h.update(f"format {FORMAT} fuselm {__version__}".encode())
    for package in _PACKAGES:
        try:
            h.update(f" {package} {version(package)}".encode())
        except PackageNotFoundError:
            h.update(f" {package} -".encode())
    for src in [*sorted(Path(__file__).parent.glob("*.py")), Path(contract.__file__)]:
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:32]


def folder() -> Path | None:
    """The cache's directory, None when FUSELM_TRACE_CACHE=0."""
    if not switches.on("FUSELM_TRACE_CACHE", default=True):
        return None
    return switches.cache_folder("traced", "FUSELM_TRACE_CACHE_DIR")


def load(k: str) -> Traced | None:
    """The entry for key `k`, or None (absent, off, damaged, another format)."""
    base = folder()
    if base is None or not (base / k / _MANIFEST).is_file():
        return None
    try:
        m = json.loads((base / k / _MANIFEST).read_text())
        if m.get("format") != FORMAT or m.get("key") != k:
            return None
        templates = [_read(base / k / f"layer_kind_{i}.pb", p) for i, p in enumerate(m.pop("params"))]
        outer = _read(base / k / "outer.pb", m.pop("outer_params"))
        del m["format"], m["key"]
        m["expected"] = {n: tuple(s) for n, s in m["expected"].items()}
        return Traced(templates, outer, **m)
    except Exception:  # damaged in any way (truncated protobuf, edited JSON): traced again and rewritten
        return None


def store(k: str, t: Traced) -> None:
    """Write the entry for key `k` (atomically; failures ignored: the cache only saves time)."""
    base = folder()
    if base is None:
        return
    current = load(k)
    if current is not None and set(t.names) <= set(current.names):
        return  # another process traced it too and stored it first: its entry stays (a reader may be in it)
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{k}-", dir=base))
        try:
            for i, template in enumerate(t.templates):
                _write(tmp / f"layer_kind_{i}.pb", template)
            _write(tmp / "outer.pb", t.outer)
            fields = {f: getattr(t, f) for f in Traced.__dataclass_fields__ if f not in ("templates", "outer")}
            manifest = {"format": FORMAT, "key": k, **fields, "params": [x.params for x in t.templates],
                        "outer_params": t.outer.params}
            (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: its presence marks a whole entry
            target = base / k
            if target.exists():  # damaged, or without one of these tensor names: moved aside whole, replaced
                aside = tmp.with_name(tmp.name + "-old")
                os.rename(target, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # read-only or full cache directory; another process renamed its entry first


def _write(path: Path, t: Template) -> None:
    """The template's graph with its constants as initializers (parameters are never stored)."""
    g = onnx.GraphProto()
    g.CopyFrom(t.graph)
    del g.initializer[:]
    for name, proto in t.constants.items():
        c = g.initializer.add()
        c.CopyFrom(proto)
        c.name = name
    path.write_bytes(g.SerializeToString())


def _read(path: Path, params: dict[str, str]) -> Template:
    g = onnx.GraphProto()
    g.ParseFromString(path.read_bytes())
    constants = {c.name: copy.deepcopy(c) for c in g.initializer}
    del g.initializer[:]
    return Template(g, dict(params), constants)
