"""Load a model directory or .onnx file: graph, initializers (memory-mapped), functions, meta.

External data is mapped, not read: every tensor stored in `model.onnx.data` becomes a numpy view
of one `np.memmap` per file, so loading a multi-GB model costs page-table entries, not RAM; a
4-bit tensor stays packed (`Packed4`: unpacked only by whoever needs the values, one at a time). A
location that leaves the model's directory (absolute, `..`, or a symlink pointing outside) is
refused, as is a data file too short for the tensors that point into it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm import contract
from fuselm.contract import META_NAME, MODEL_NAME
from fuselm.errors import FuselmError
from fuselm.graphcheck import ORT_DOMAIN, ORT_ONNX_DOMAIN_CONTRIB, check_graph_file
from fuselm.modeldir import read_meta

# ONNX element type -> numpy dtype of the values as the runtime holds them on the host.
# 4-bit types are unpacked to one value per byte (uint8 / int8).
NP_DTYPES = {
    TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64, TensorProto.FLOAT16: np.float16,
    TensorProto.BFLOAT16: ml_dtypes.bfloat16, TensorProto.INT64: np.int64, TensorProto.INT32: np.int32,
    TensorProto.INT16: np.int16, TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8,
    TensorProto.UINT16: np.uint16, TensorProto.UINT32: np.uint32, TensorProto.UINT64: np.uint64,
    TensorProto.BOOL: np.bool_, TensorProto.UINT4: np.uint8, TensorProto.INT4: np.int8,
}
_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4)
ONNX_OF_NP = {np.dtype(v): k for k, v in NP_DTYPES.items() if k not in _FOUR_BIT}


@dataclass
class LoadedModel:
    """What the executor needs: the graph, its weights as host arrays, and model-local functions."""

    graph: onnx.GraphProto
    initializers: dict[str, np.ndarray]
    functions: dict[tuple[str, str], onnx.FunctionProto]
    opsets: dict[str, int]
    path: Path
    meta: dict | None = None
    input_types: dict[str, tuple[int, list]] = field(default_factory=dict)
    output_names: list[str] = field(default_factory=list)
    data_files: _DataFiles | None = None

    def release_pages(self) -> None:
        """Drop the mapped weight pages this process has read (the page cache keeps them): after the
        backend has made its own copies, what is read again (embedding rows) faults back in."""
        if self.data_files is not None:
            self.data_files.release()


@dataclass
class Packed4:
    """A 4-bit tensor as stored (ONNX packing: two values per byte, the first in the low nibble),
    a view of the mapped data file. `unpack()` makes the one-value-per-byte array; `rows` is the
    packed data as [rows, cols / 2] bytes when whole rows are whole bytes (cols even), else None."""

    raw: np.ndarray
    shape: tuple
    data_type: int

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(NP_DTYPES[self.data_type])

    def unpack(self) -> np.ndarray:
        return _unpack4(np.asarray(self.raw), self.shape, self.data_type)

    @property
    def rows(self) -> np.ndarray | None:
        if len(self.shape) != 2 or self.shape[1] % 2 or self.data_type != TensorProto.UINT4:
            return None
        return np.asarray(self.raw).reshape(self.shape[0], self.shape[1] // 2)


def model_path(path: str | os.PathLike) -> tuple[Path, dict | None]:
    """Resolve a model directory (with fuselm.json) or a .onnx file to (onnx path, meta or None)."""
    p = Path(path)
    if p.is_dir():
        if not (p / MODEL_NAME).is_file():
            raise FuselmError(f"{p} has no {MODEL_NAME}; pass a model directory written by `fuselm convert` "
                              "or `fuselm optimize`, or an .onnx file")
        meta = read_meta(p) if (p / META_NAME).is_file() else None
        return p / MODEL_NAME, meta
    if p.is_file() and p.suffix == ".onnx":
        meta = read_meta(p.parent) if p.name == MODEL_NAME and (p.parent / META_NAME).is_file() else None
        return p, meta
    raise FuselmError(f"{p} is neither a model directory nor an .onnx file; check the path")


def load(path: str | os.PathLike) -> LoadedModel:
    """Load the graph and map its weights; every problem is a FuselmError naming the fix."""
    onnx_path, meta = model_path(path)
    check_graph_file(onnx_path)  # tensor sizes, data paths, a DAG, onnx.checker: before anything is mapped
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, onnx raises various types
        raise FuselmError(f"{onnx_path} is not a readable ONNX model ({type(e).__name__}: {e}); "
                          "re-create it with `fuselm convert`") from None
    base = onnx_path.parent
    maps = _DataFiles(base)
    inits = {t.name: tensor_to_array(t, maps, packed=True) for t in model.graph.initializer}
    for t in model.graph.sparse_initializer:
        raise FuselmError(f"sparse initializer {t.values.name!r} is not supported; densify the model first")
    functions = {(f.domain, f.name): f for f in model.functions}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    input_types = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
        input_types[vi.name] = (tt.elem_type, dims)
    return LoadedModel(model.graph, inits, functions, opsets, onnx_path, meta, input_types,
                       [o.name for o in model.graph.output], maps)


def check_contract(lm: LoadedModel) -> contract.StepIO:
    """What one step of the loaded graph takes and returns (fuselm/contract.py checks it); a graph
    onnxruntime-genai's builder wrote is refused with the command that maps it to the contract."""
    genai = next((n for n in lm.graph.node if n.domain == ORT_DOMAIN or n.op_type in ORT_ONNX_DOMAIN_CONTRIB), None)
    if genai is not None:  # its contrib ops, no position_ids
        raise FuselmError(f"{lm.path} uses onnxruntime contrib ops ({genai.op_type}, node {genai.name!r}), "
                          "as onnxruntime-genai's builder writes them; run `fuselm optimize DIR -o OUT` first "
                          "(it maps them to standard ops and the graph contract) and run OUT")
    return contract.check_step_io(lm.input_types, lm.output_names, lm.path)


class _DataFiles:
    """One read-only memory map per external data file, opened on first use."""

    def __init__(self, base: Path):
        self.base = base.resolve()
        self.maps: dict[str, np.memmap] = {}

    def get(self, location: str, tensor: str) -> np.memmap:
        if location in self.maps:
            return self.maps[location]
        if os.path.isabs(location) or ".." in Path(location).parts:
            raise FuselmError(f"tensor {tensor!r}: external data location {location!r} leaves the model directory; "
                              "refusing to read it (re-create the model with `fuselm convert`)")
        path = self.base / location
        real = path.resolve()
        if self.base not in real.parents:
            raise FuselmError(f"tensor {tensor!r}: external data {location!r} resolves to {real}, outside the "
                              "model directory (a symlink?); refusing to read it (copy the file into the directory)")
        if not path.is_file():
            raise FuselmError(f"tensor {tensor!r}: external data file {path} is missing; copy the whole model "
                              "directory (model.onnx and model.onnx.data belong together)")
        empty = path.stat().st_size == 0
        self.maps[location] = np.zeros(0, np.uint8) if empty else np.memmap(path, dtype=np.uint8, mode="r")
        return self.maps[location]

    def release(self) -> None:
        for mm in self.maps.values():
            handle = getattr(mm, "_mmap", None)
            if handle is not None and hasattr(mmap, "MADV_DONTNEED"):
                handle.madvise(mmap.MADV_DONTNEED)


def tensor_to_array(t: TensorProto, maps: _DataFiles | None = None, packed: bool = False) -> np.ndarray | Packed4:
    """A TensorProto as a host array: 4-bit types unpacked to one value per byte (packed=True: a
    4-bit tensor in a data file stays a `Packed4` view), bf16 via ml_dtypes."""
    shape = tuple(t.dims)
    if t.data_type not in NP_DTYPES:
        raise FuselmError(f"tensor {t.name!r}: element type {helper.tensor_dtype_to_string(t.data_type)} "
                          "is not supported by the runtime")
    if t.data_location != TensorProto.EXTERNAL:
        if t.data_type in _FOUR_BIT:
            return _unpack4(np.frombuffer(t.raw_data, np.uint8), shape, t.data_type) if t.raw_data else \
                numpy_helper.to_array(t).astype(NP_DTYPES[t.data_type])
        arr = numpy_helper.to_array(t)
        return arr.astype(NP_DTYPES[t.data_type], copy=False) if arr.dtype != NP_DTYPES[t.data_type] else arr
    if maps is None:
        raise FuselmError(f"tensor {t.name!r} has external data but no model directory was given")
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location")
    if not location:
        raise FuselmError(f"tensor {t.name!r}: external data without a location; re-create the model")
    offset, count = int(info.get("offset", 0)), int(np.prod(shape, dtype=np.int64))
    dtype = np.dtype(NP_DTYPES[t.data_type])
    nbytes = (count + 1) // 2 if t.data_type in _FOUR_BIT else count * dtype.itemsize
    if "length" in info and int(info["length"]) < nbytes:
        raise FuselmError(f"tensor {t.name!r}: external data length {info['length']} is shorter than its shape "
                          f"{list(shape)} needs ({nbytes} bytes); the model file is corrupt, re-create it")
    mm = maps.get(location, t.name)
    if offset + nbytes > mm.shape[0]:
        raise FuselmError(f"tensor {t.name!r}: {location} is truncated ({mm.shape[0]} bytes, the tensor needs "
                          f"bytes {offset}..{offset + nbytes}); copy the complete file or re-create the model")
    raw = mm[offset:offset + nbytes]
    if t.data_type in _FOUR_BIT:
        return Packed4(raw, shape, t.data_type) if packed else _unpack4(np.asarray(raw), shape, t.data_type)
    if offset % dtype.itemsize:
        raw = np.array(raw)  # unaligned: copy once
    return np.asarray(raw).view(dtype).reshape(shape)


def _unpack4(packed: np.ndarray, shape: tuple, data_type: int) -> np.ndarray:
    """ONNX 4-bit packing: two values per byte, the first in the low nibble."""
    count = int(np.prod(shape, dtype=np.int64))
    out = np.empty(packed.size * 2, np.uint8)
    np.bitwise_and(packed, 0x0F, out=out[0::2])  # in place: no weight-sized temporaries
    np.right_shift(packed, 4, out=out[1::2])
    out = out[:count].reshape(shape)
    if data_type == TensorProto.INT4:
        out = ((out.astype(np.int8) << 4) >> 4).astype(np.int8)
    return out
