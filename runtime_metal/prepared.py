"""Backend-ready weights kept in fuselm's cache folder: prepared once, read directly on every later load.

Preparing quantized weights for a backend (MLX: unpack uint4, transpose to [N, K], repack into uint32,
scales and biases in the compute dtype) is most of a load. The first load writes what it prepared to
`<store>/<backend format>-<key>.safetensors`, the store being ~/.cache/fuselm/prepared/<hash of the model
directory's path>/ (`folder`; $FUSELM_PREPARED_DIR moves it; nothing is written into the model directory);
a later load with the same key reads that file (memory-mapped by the backend's loader) instead of the
graph's weights.

- The key: sha256 of model.onnx (which holds every weight's offset and length), the data file's size
  and modification time, fuselm's version and the backend's format tag (MLX's version and the compute
  dtype). It is stored in the file's metadata and checked on read, with every entry's shape and dtype.
- A stale, truncated or damaged file is never used: the weights are prepared again and the file
  rewritten. Older keys' files of the same backend format are removed. A file that holds only some of
  the weights (one an older fuselm wrote before it kept the MoE experts) is used for those, and
  rewritten with the others once they are prepared.
- Written atomically (a temporary file renamed into place) under an exclusive lock, so four processes
  that load the same model at once for the first time prepare it once; the others wait and read it.
- FUSELM_PREPARED=0 turns the store off.

`prepared_dir` keeps a whole prepared directory the same way (`<format>-<key>/`, e.g. the graph lowered for
onnxruntime: runtime_metal/engines/ort_prepared.py): built into a temporary directory and renamed into place under the
lock, stamped with its key and every file's size (and the sha256 of the files under 64 MB), checked on
every read; a build that finds the model cannot be prepared is remembered under the key (`<format>-<key>.failed`).
The stamp also records the source's fingerprint (size, mtime, ctime and inode of model.onnx and its data
file, fuselm's version and the tag): `find_prepared_dir` finds the copy by it without reading the graph, so
a fresh process that runs the copy never parses the source; any change to those files misses it, and
`prepared_dir` then checks the key (rebuilding when it changed, re-stamping when only the stat did).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fuselm import __version__, contract, switches

if TYPE_CHECKING:  # base.py imports onnx, which a run of the prepared copy does without
    from .backends.base import QuantizedWeight

_ENTRY = "::"  # weight name :: part index
STAMP = ".fuselm-prepared.json"  # in a prepared directory: its key and its files
_HASHED = 64 << 20  # a prepared directory's files up to this size are hashed on read; larger ones checked by size


def enabled() -> bool:
    """False when FUSELM_PREPARED=0 (or false/no) turns the store off."""
    return switches.on("FUSELM_PREPARED", default=True)


class PreparedStore:
    """The prepared weights of one model for one backend: `get` what a file holds, `put` what was made."""

    def __init__(self, backend, model_path: Path):
        self.backend, self.tag = backend, backend.prepared_format()
        self.loaded: dict[str, QuantizedWeight] = {}
        self.new: dict[str, QuantizedWeight] = {}
        self.path = self.key = self._held = None
        self.state = "off"
        if self.tag is None or not enabled():
            return
        model = Path(model_path)
        model = model / contract.MODEL_NAME if model.is_dir() else model
        self.key = _key(model, self.tag)
        self.path = folder(model.parent) / f"{self.tag}-{self.key[:24]}.safetensors"
        self.state = "missing"
        self._read()
        if self.state != "read":  # prepare under the lock: a process already preparing it is waited for
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._held = _lock(self.path.parent / ".lock")
            except OSError:
                return
            self._read()
            if self.state == "read":
                self.close()

    # --- reading -------------------------------------------------------------------------------
    def _read(self) -> None:
        if not self.path.is_file():
            return
        try:
            arrays, meta = self.backend.load_prepared(self.path)
            if meta.get("key") != self.key:
                self.state = "stale"
                return
            self.loaded = _weights(arrays, json.loads(meta["weights"]))
            self.state = "read"
        except Exception as e:  # noqa: BLE001 - a damaged file is rebuilt, never used
            self.loaded, self.state = {}, f"damaged ({type(e).__name__})"

    def get(self, name: str) -> QuantizedWeight | None:
        return self.loaded.get(name)

    def put(self, name: str, weight: QuantizedWeight) -> None:
        if self.state != "off" and name not in self.loaded:
            self.new[name] = weight

    # --- writing -------------------------------------------------------------------------------
    def commit(self) -> None:
        """Write every weight (read or new) when anything was new, atomically, then release the lock."""
        try:
            if self.state == "off" or not self.new:
                return
            if self._held is None:  # a file that lacks some weights (an older fuselm kept no experts): add them
                try:
                    self._held = _lock(self.path.parent / ".lock")
                except OSError:
                    return
            arrays, table = {}, {}
            for name, w in {**self.loaded, **self.new}.items():
                parts = w.data if isinstance(w.data, tuple) else (w.data,)
                for i, a in enumerate(parts):
                    arrays[f"{name}{_ENTRY}{i}"] = a
                table[name] = [w.in_features, w.out_features, w.bits, w.block, w.kind, len(parts),
                               isinstance(w.data, tuple)]
            tmp = self.path.with_name(f".{self.path.stem}.{os.getpid()}.tmp.safetensors")
            try:
                self.backend.save_prepared(tmp, arrays, {"key": self.key, "weights": json.dumps(table)})
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
            for old in self.path.parent.glob(f"{self.tag}-*.safetensors"):
                if old != self.path:
                    old.unlink(missing_ok=True)
            self.state = "written"
        except OSError as e:  # a full disk must not stop the run: the weights are prepared in memory
            print(f"fuselm: could not keep prepared weights at {self.path.parent} ({e.strerror or e}); "
                  "the next load prepares them again", file=sys.stderr)
        finally:
            self.close()

    def close(self) -> None:
        """Release the preparation lock (also when preparing failed)."""
        if self._held is not None:
            fcntl.flock(self._held, fcntl.LOCK_UN)
            self._held.close()
            self._held = None

    def describe(self) -> str:
        return {"read": "read from", "written": "written to"}.get(self.state, self.state) + \
            (f" {self.path}" if self.state in ("read", "written") else "")


def _weights(arrays: dict, table: dict) -> dict[str, QuantizedWeight]:
    from .backends.base import QuantizedWeight

    out = {}
    for name, (k, n, bits, block, kind, count, is_tuple) in table.items():
        parts = tuple(arrays[f"{name}{_ENTRY}{i}"] for i in range(count))
        out[name] = QuantizedWeight(parts if is_tuple else parts[0], k, n, bits, block, kind)
    return out


def _key(model: Path, tag: str) -> str:
    h = hashlib.sha256()
    h.update(model.read_bytes())
    data = model.with_name(contract.DATA_NAME)
    if data.exists():
        st = data.stat()
        h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(f"{__version__}:{tag}".encode())
    return h.hexdigest()


def folder(model_dir: Path) -> Path:
    """The store of one model directory: fuselm's cache folder, by the directory's resolved path."""
    base = switches.cache_folder("prepared", "FUSELM_PREPARED_DIR")
    return base / hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]


def _lock(path: Path):
    """An exclusive lock on `path` (held until closed; the OS drops it if the process dies)."""
    f = open(path, "a")  # noqa: SIM115 - held across the preparation, closed by PreparedStore.close
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


class CannotPrepare(Exception):
    """`prepared_dir`'s build found that this model cannot be prepared in this format (remembered under the key)."""


def fingerprint(model: Path, tag: str) -> str:
    """The source as the file system sees it: size, mtime, ctime and inode of model.onnx and its data file,
    fuselm's version and `tag` (no byte is read; ctime changes on every write, and cannot be set back)."""
    parts = [f"{__version__}", tag]
    for p in (model, model.with_name(contract.DATA_NAME)):
        try:
            st = p.stat()
            parts.append(f"{p.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}")
        except OSError:
            parts.append(f"{p.name}:-")
    return "|".join(parts)


def find_prepared_dir(model_path, fmt: str, tag: str) -> tuple[Path, dict] | None:
    """(path, facts) of the `<fmt>-*` copy whose stamp records the source's current `fingerprint` and whose
    files are intact, else None (then `prepared_dir` decides). `facts`: what `prepared_dir`'s caller recorded."""
    if not enabled():
        return None
    model = Path(model_path)
    model = model / contract.MODEL_NAME if model.is_dir() else model
    store = folder(model.parent)
    if not store.is_dir():
        return None
    want = fingerprint(model, tag)
    for path in sorted(store.glob(f"{fmt}-*")):
        try:
            stamp = json.loads((path / STAMP).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(stamp, dict) and stamp.get("source") == want and _check_dir(path, stamp.get("key")) == "read":
            return path, stamp.get("facts") or {}
    return None


def prepared_dir(model_path, fmt: str, tag: str, build, facts: dict | None = None) -> tuple[Path, str]:
    """(path, how) of `<store>/<fmt>-<key>/`, the key covering the graph, its data file's size and mtime,
    fuselm's version and `tag`; how: "read", "written" or "written; the copy there was damaged (...)". `build(tmp)` writes the directory's files into
    the new directory `tmp`; CannotPrepare from it is remembered (later calls raise it at once), any other
    exception leaves nothing behind. Four processes at once build it once: the others wait and read it.
    `facts` (JSON) are kept in the stamp for `find_prepared_dir`."""
    model = Path(model_path)
    model = model / contract.MODEL_NAME if model.is_dir() else model
    source = fingerprint(model, tag)
    key = _key(model, tag)
    store = folder(model.parent)
    path, failed = store / f"{fmt}-{key[:24]}", store / f"{fmt}-{key[:24]}.failed"
    state = _check_dir(path, key)
    if state == "read":
        _restamp(path, source)
        return path, "read"
    _raise_failed(failed)
    store.mkdir(parents=True, exist_ok=True)
    held = _lock(store / f".{fmt}.lock")
    try:
        state = _check_dir(path, key)  # again under the lock: a process that built it meanwhile was waited for
        if state == "read":
            _restamp(path, source)
            return path, "read"
        _raise_failed(failed)
        tmp = store / f".{path.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            build(tmp)
            _stamp(tmp, key, source, facts or {})
            shutil.rmtree(path, ignore_errors=True)  # a damaged copy of this key
            os.replace(tmp, path)
        except CannotPrepare as e:
            part = failed.with_name(f".{failed.name}.{os.getpid()}.tmp")
            part.write_text(f"{e}\n")
            os.replace(part, failed)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for old in store.glob(f"{fmt}-*"):  # older keys' copies
            if old != path:
                shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
        return path, "written" + ("" if state == "missing" else f"; the copy there was {state}")
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        held.close()


def _raise_failed(failed: Path) -> None:
    if failed.is_file():
        raise CannotPrepare(failed.read_text().strip())


def _stamp(folder: Path, key: str, source: str, facts: dict) -> None:
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    table = {name: [p.stat().st_size, _sha(p) if p.stat().st_size <= _HASHED else None] for name, p in files.items()}
    (folder / STAMP).write_text(json.dumps({"key": key, "source": source, "facts": facts, "files": table}, indent=1))


def _restamp(folder: Path, source: str) -> None:
    """Record `source` as the fingerprint of a copy whose key still matches (the source was touched, not
    changed), atomically; a store that cannot be written keeps the old stamp (the key is checked again)."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
        if stamp.get("source") == source:
            return
        stamp["source"] = source
        tmp = folder / f".{STAMP}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(stamp, indent=1))
        os.replace(tmp, folder / STAMP)
    except (OSError, ValueError, AttributeError):
        pass


def _check_dir(folder: Path, key: str) -> str:
    """"read" when `folder` holds what its stamp lists, else why not ("missing", "stale", "damaged (...)")."""
    if not folder.is_dir():
        return "missing"
    try:
        stamp = json.loads((folder / STAMP).read_text())
        if stamp["key"] != key:
            return "stale"
        for name, (size, sha) in stamp["files"].items():
            p = folder / name
            if p.stat().st_size != size or (sha is not None and _sha(p) != sha):
                return f"damaged ({name} changed)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"damaged ({type(e).__name__})"
    return "read"


def _sha(path: Path) -> str:
    from fuselm.modeldir import file_sha256

    return file_sha256(path)
