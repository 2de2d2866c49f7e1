"""Stream weights: safetensors in (single file or sharded), one external-data file out.

`Checkpoint` indexes the tensors of `model.safetensors` or `model.safetensors.index.json` from
their headers only. Reading opens the shard, copies a block of rows and closes it again, so the
mmap of an 8 GB shard never stays resident: peak memory is one block, not the model.

`write_data` lays every declared initializer out in `model.onnx.data` (64-byte aligned, 4096
for tensors of 1 MiB and more, so a runtime can mmap them), points each TensorProto at its
offset, then fills the file job by job. Big tensors are processed in row blocks; a transposed
output ([in, out] from HF's [out, in]) receives each block as a column block.
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from onnx import TensorProto

from fuselm.errors import FuselmError, shown
from fuselm.modeldir import within_checkpoint

from .graph import WeightJob
from .quant import Packed, pack_uint4

FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ITEM_BITS = {TensorProto.FLOAT: 32, TensorProto.FLOAT16: 16, TensorProto.UINT8: 8, TensorProto.UINT4: 4}
_NP_DTYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.UINT8: np.uint8,
              TensorProto.UINT4: np.uint8}  # uint4 values held one per uint8 until packed
BLOCK_ELEMENTS = 8 * 1024 * 1024  # rows per read: about 32 MB of float32
ENCODERS = 2  # threads reading and encoding blocks (the writer thread packs and writes behind them)


class Checkpoint:
    """The safetensors tensors of an HF checkpoint directory: name -> (file, dtype, shape)."""

    def __init__(self, hf_dir: Path):
        from safetensors import SafetensorError, safe_open

        self.dir = hf_dir
        index = hf_dir / "model.safetensors.index.json"
        single = hf_dir / "model.safetensors"
        weight_map = None
        if index.is_file():
            weight_map = _read_index(index)
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files = [single.name]
        else:
            found = sorted(p.name for p in hf_dir.glob("*.safetensors"))
            if found:
                files = found
            elif any((hf_dir / n).exists() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
                raise FuselmError(f"{hf_dir} holds only pickle weights (pytorch_model.bin); fuselm reads safetensors "
                                  "only and never unpickles. Convert it once in a trusted environment: "
                                  "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)`")
            else:
                raise FuselmError(f"{hf_dir} has no weights: expected model.safetensors or "
                                  "model.safetensors.index.json; point HF_DIR at a full checkpoint")
        self.tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        self.stored: dict[str, str] = {}  # name -> the name in the file, where they differ (rename)
        # name -> [source, op, dim, start, stop]: a tensor transformers makes from a stored one as it loads it (`convert`)
        self.views: dict[str, list] = {}
        self.view_sources: dict[str, tuple] = {}  # the sources' entries of `tensors`, which the views replace
        self._last: tuple[str, np.ndarray] | None = None  # the last source read whole for its views
        found_in: dict[str, list[str]] = {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise FuselmError(f"shard {name} listed in the checkpoint index is missing from {hf_dir}; "
                                  "download the complete checkpoint")
            if not within_checkpoint(path, hf_dir):
                raise FuselmError(f"{path} links to {path.resolve()}, outside the checkpoint directory; refusing to "
                                  "read it (copy the file into the checkpoint)")
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        sl = f.get_slice(key)
                        self.tensors[key] = (path, sl.get_dtype(), tuple(sl.get_shape()))
                        found_in.setdefault(key, []).append(name)
            except SafetensorError as e:
                raise FuselmError(f"{path} is not a readable safetensors file ({e}); it may be truncated — "
                                  "download it again") from None
        _check_shards(hf_dir, weight_map, found_in)

    def rename(self, model_name: Callable[[str], str]) -> None:
        """Key the tensors by the names the model gives them (transformers renames some at load:
        GPT-NeoX's `embed_out` is its `lm_head`); reading still uses the stored names."""
        renamed: dict[str, str] = {}
        for stored in self.tensors:
            renamed.setdefault(model_name(stored), stored)
        if len(renamed) != len(self.tensors):
            raise FuselmError(f"checkpoint {self.dir} holds tensors that transformers loads under one name; "
                              "re-download the checkpoint")
        self.tensors = {name: self.tensors[stored] for name, stored in renamed.items()}
        self.stored = {name: stored for name, stored in renamed.items() if name != stored}

    def convert(self, views: dict[str, list]) -> None:
        """Replace stored tensors by the tensors transformers makes from them as it loads them: name ->
        [source, "transpose", dim0, dim1] or [source, "slice", dim, start, stop] (its Chunk / Split); read whole
        and converted when their rows are read (a source at a time)."""
        for name, (source, op, *args) in views.items():
            entry = self.view_sources.setdefault(source, self.tensors.get(source))
            if entry is None:
                continue  # validate reports the view missing
            path, dtype, shape = entry
            shape = list(shape)
            if op == "transpose":
                shape[args[0]], shape[args[1]] = shape[args[1]], shape[args[0]]
            else:
                shape[args[0]] = args[2] - args[1]
            self.tensors[name] = (path, dtype, tuple(shape))
            self.views[name] = [source, op, *args]
        for source in self.view_sources:
            if source not in self.views:
                self.tensors.pop(source, None)

    def check_bounds(self, cfg) -> None:
        """Refuse config sizes that no tensor of the checkpoint could hold (a hidden size needing
        terabytes), before anything is sized by them; near misses get validate's per-tensor message."""
        largest = max((max(shape, default=1) for _, _, shape in self.tensors.values()), default=0)
        sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                 "vocab_size": cfg.vocab_size, "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim,
                 "num_key_value_heads * head_dim": cfg.num_key_value_heads * cfg.head_dim}
        for name, value in sizes.items():
            if value > largest:
                raise FuselmError(f"config.json: {name} = {value:,} is larger than any tensor dimension of the "
                                  f"checkpoint {self.dir} (at most {largest:,}); the config does not belong to these "
                                  "weights. Use the config.json that came with them")
        if cfg.num_hidden_layers > len(self.tensors):
            raise FuselmError(f"config.json: num_hidden_layers = {cfg.num_hidden_layers:,} but the checkpoint "
                              f"{self.dir} holds only {len(self.tensors)} tensors; use the config.json that came "
                              "with these weights")

    def validate(self, expected: dict[str, tuple[int, ...]], ignorable: Callable[[str], bool]) -> None:
        """Every expected tensor present with its shape and a float dtype; nothing else unmapped."""
        problems = []
        for name, shape in expected.items():
            if name not in self.tensors:
                problems.append(f"{name}: missing")
                continue
            _, dtype, got = self.tensors[name]
            if got != tuple(shape):
                problems.append(f"{name}: shape {list(got)}, expected {list(shape)} from config.json")
            if dtype not in FLOAT_DTYPES:
                problems.append(f"{name}: dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        unknown = [n for n in self.tensors if n not in expected and not ignorable(n)]
        problems += [f"{n}: not a tensor of this architecture" for n in unknown]
        if problems:
            shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
            raise FuselmError(f"checkpoint {self.dir} does not match its config.json: {shown}. "
                              "Use the config.json that belongs to these weights, or re-download the checkpoint")

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor as float32 (1-D tensors: the whole tensor)."""
        import torch
        from safetensors import safe_open

        if name in self.views:
            source, op, *args = self.views[name]
            last = self._last  # (a local: the writer reads on two threads)
            if last is None or last[0] != source:
                path, _, _ = self.view_sources[source]
                with safe_open(path, framework="pt") as f:
                    last = self._last = (source, f.get_tensor(self.stored.get(source, source)).to(torch.float32).numpy())
            whole = last[1]
            if op == "transpose":
                whole = np.swapaxes(whole, args[0], args[1])
            else:
                whole = np.take(whole, range(args[1], args[2]), axis=args[0])
            return np.ascontiguousarray(whole if whole.ndim == 1 else whole[start:stop])
        path, _, shape = self.tensors[name]
        key = self.stored.get(name, name)
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(key) if len(shape) == 1 else f.get_slice(key)[start:stop]
        return t.to(torch.float32).numpy()


def _read_index(index: Path) -> dict[str, str]:
    """weight_map of model.safetensors.index.json: tensor name -> a file name inside the checkpoint."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as e:  # bad JSON, bad UTF-8, deep nesting
        raise FuselmError(f"{index} is malformed ({type(e).__name__}: {e}); re-save the checkpoint with "
                          "`save_pretrained` or restore the file") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FuselmError(f"{index}: weight_map is not an object of tensor name -> shard file name; re-save the "
                          "checkpoint with `save_pretrained` or restore the file")
    bad = sorted({v for v in weight_map.values() if Path(v).name != v or v in ("", ".", "..")})
    if bad:
        raise FuselmError(f"{index} names shard {shown(bad[0])}, which is not a file name inside the checkpoint "
                          "directory; refusing to read it (restore the index)")
    return weight_map


def _check_shards(hf_dir: Path, weight_map: dict[str, str] | None, found_in: dict[str, list[str]]) -> None:
    """Each tensor stored once, and where the index says it is (HF reads it from there)."""
    problems = [f"{k} is stored in {' and '.join(v)}" for k, v in found_in.items() if len(v) > 1]
    if weight_map is not None:
        problems += [f"the index puts {k} in {shard}, but it is in {found_in[k][0]}" if k in found_in
                     else f"the index puts {k} in {shard}, but no shard holds it"
                     for k, shard in weight_map.items() if shard not in found_in.get(k, ())]
        problems += [f"{k} (in {v[0]}) is not in the index" for k, v in found_in.items() if k not in weight_map]
    if problems:
        shown_problems = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise FuselmError(f"the safetensors files in {hf_dir} are inconsistent: {shown_problems}. Re-save the "
                          "checkpoint with `save_pretrained` or download it again")


def layout(jobs: Iterable[WeightJob], location: str) -> int:
    """Assign every output its offset in the data file; returns the file size."""
    offset = 0
    for job in jobs:
        for out in job.outputs:
            nbytes = _nbytes(out.proto)
            offset = -(-offset // (4096 if nbytes >= 1 << 20 else 64)) * (4096 if nbytes >= 1 << 20 else 64)
            del out.proto.external_data[:]
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(nbytes))):
                entry = out.proto.external_data.add()
                entry.key, entry.value = key, value
            offset += nbytes
    return offset


def write_data(path: Path, jobs: list[WeightJob], ckpt: Checkpoint, on_job: Callable[[WeightJob], None]) -> None:
    """Fill the data file: each job reads its source in row blocks, encodes, writes its outputs.

    Blocks are read and encoded ENCODERS at a time on a thread pool (torch's and numpy's kernels release
    the GIL) and handed over in file order to the writer, whose thread packs uint4 and copies into the
    page cache behind a short queue, across jobs; memory stays at a few blocks.
    """
    import torch

    size = layout(jobs, path.name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    writer = _Writer(fd)
    # The stream's parallelism is its encoder and writer threads: torch's intra-op threads on a block's
    # short reductions cost more in hand-offs than they gain (several times slower on busy cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        os.ftruncate(fd, size)
        with ThreadPoolExecutor(ENCODERS, thread_name_prefix="fuselm-encode") as pool:
            pending: deque = deque()
            for job, start, stop, last in _blocks(jobs, ckpt):
                encoded = pool.submit(lambda j, a, b: j.encode(ckpt.read_rows(j.source, a, b)), job, start, stop)
                pending.append((job, start, last, encoded))
                if len(pending) > ENCODERS:
                    _hand_over(*pending.popleft(), writer, on_job)
            while pending:
                _hand_over(*pending.popleft(), writer, on_job)
        writer.sync()
    finally:
        torch.set_num_threads(threads)
        writer.close()
        os.close(fd)


def _blocks(jobs: list[WeightJob], ckpt: Checkpoint):
    """(job, start, stop, last block of the job) over every job's row blocks, in file order."""
    for job in jobs:
        shape = ckpt.tensors[job.source][2]
        rows = shape[0]
        step = rows if len(shape) == 1 else max(2, BLOCK_ELEMENTS // max(1, shape[1])) // 2 * 2
        if any(o.transposed and o.proto.data_type == TensorProto.UINT4 and o.proto.dims[1] % 2 for o in job.outputs):
            step = rows  # odd uint4 rows share bytes: no column blocks
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            yield job, start, stop, stop == rows


def _hand_over(job: WeightJob, start: int, last: bool, encoded, writer: _Writer, on_job) -> None:
    """The encoded block of `job` at row `start` to the writer (waits for its encoding)."""
    for out, arr in zip(job.outputs, encoded.result(), strict=True):
        writer.put(out.proto, arr, start, start == 0 and last, out.transposed)
    if last:
        on_job(job)  # encoded; its writes may still be queued (no wait: the next job's encoding overlaps them)


class _Writer:
    """pwrite on a background thread; errors surface in the caller at the next sync/close."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None
        self.queue: queue.Queue = queue.Queue(maxsize=3)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, proto, arr, start, whole, transposed):
        self._raise()
        self.queue.put((proto, arr, start, whole, transposed))

    def sync(self):
        self.queue.join()
        self._raise()

    def close(self):
        self.queue.put(None)
        self.thread.join()
        self._raise()

    def _raise(self):
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _run(self):
        while (item := self.queue.get()) is not None:
            try:
                if self.error is None:
                    _write_block(self.fd, *item)
            except BaseException as e:  # handed to the main thread
                self.error = e
            finally:
                self.queue.task_done()
        self.queue.task_done()


def _write_block(fd: int, proto: TensorProto, arr, start: int, whole: bool, transposed: bool) -> None:
    """Write a block of rows (or, transposed, a block of columns starting at column `start`, an even one
    for uint4). `arr` is an array of the proto's values, or a quant.Packed of its uint4 bytes."""
    offset = int(next(e.value for e in proto.external_data if e.key == "offset"))
    bits = _ITEM_BITS[proto.data_type]
    if isinstance(arr, Packed):
        arr, encode = arr.data, _raw
    else:
        arr, encode = np.ascontiguousarray(arr, dtype=_NP_DTYPES[proto.data_type]), pack_uint4 if bits == 4 else _raw
    if whole:
        _pwrite(fd, encode(arr), offset)
    elif not transposed:
        _pwrite(fd, encode(arr), offset + start * int(np.prod(proto.dims[1:])) * bits // 8)
    else:
        n_cols = proto.dims[1]
        for r in range(arr.shape[0]):  # one strided segment per output row
            _pwrite(fd, encode(arr[r]), offset + (r * n_cols + start) * bits // 8)


def _raw(arr: np.ndarray):
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _nbytes(proto: TensorProto) -> int:
    return -(-int(np.prod(proto.dims, dtype=np.int64)) * _ITEM_BITS[proto.data_type] // 8)
