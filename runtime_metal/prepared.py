"""Backend-ready weights kept beside the model: prepared once, read directly on every later load.

Preparing quantized weights for a backend (MLX: unpack uint4, transpose to [N, K], repack into uint32,
scales and biases in the compute dtype) is most of a load. The first load writes what it prepared to
`<model dir>/.fuselm-prepared/<backend format>-<key>.safetensors`; a later load with the same key reads
that file (memory-mapped by the backend's loader) instead of the graph's weights.

- The key: sha256 of model.onnx (which holds every weight's offset and length), the data file's size
  and modification time, fuselm's version and the backend's format tag (MLX's version and the compute
  dtype). It is stored in the file's metadata and checked on read, with every entry's shape and dtype.
- A stale, truncated or damaged file is never used: the weights are prepared again and the file
  rewritten. Older keys' files of the same backend format are removed.
- Written atomically (a temporary file renamed into place) under an exclusive lock, so four processes
  that load the same model at once for the first time prepare it once; the others wait and read it.
- A model directory that cannot be written (read-only) falls back to $FUSELM_PREPARED_DIR or
  ~/.cache/fuselm/prepared; FUSELM_PREPARED=0 turns the store off.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

from fuselm import __version__, contract

from .backends.base import QuantizedWeight

DIR_NAME = ".fuselm-prepared"
_ENTRY = "::"  # weight name :: part index


class PreparedStore:
    """The prepared weights of one model for one backend: `get` what a file holds, `put` what was made."""

    def __init__(self, backend, model_path: Path):
        self.backend, self.tag = backend, backend.prepared_format()
        self.loaded: dict[str, QuantizedWeight] = {}
        self.new: dict[str, QuantizedWeight] = {}
        self.path = self.key = self._held = None
        self.state = "off"
        if self.tag is None or os.environ.get("FUSELM_PREPARED", "1") in ("0", "false", "no"):
            return
        model = Path(model_path)
        model = model / contract.MODEL_NAME if model.is_dir() else model
        self.key = _key(model, self.tag)
        self.path = _folder(model.parent) / f"{self.tag}-{self.key[:24]}.safetensors"
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
            if self.state == "off" or not self.new or self._held is None:
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


def _folder(model_dir: Path) -> Path:
    here = model_dir / DIR_NAME
    if os.access(here if here.exists() else model_dir, os.W_OK):
        return here
    base = Path(os.environ.get("FUSELM_PREPARED_DIR") or Path.home() / ".cache" / "fuselm" / "prepared")
    return base / hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]


def _lock(path: Path):
    """An exclusive lock on `path` (held until closed; the OS drops it if the process dies)."""
    f = open(path, "a")  # noqa: SIM115 - held across the preparation, closed by PreparedStore.close
    fcntl.flock(f, fcntl.LOCK_EX)
    return f
