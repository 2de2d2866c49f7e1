"""Reading and writing graphs for the passes: weights stay on disk until they are written.

`load` reads the graph without its external data (onnx_ir maps each tensor lazily); `save` writes
a new `model.onnx` + `model.onnx.data`, streaming each tensor's bytes from its source file, so a
pass only ever reads the weights it concatenates.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnx_ir as ir

from fuselm.contract import DATA_NAME, META_NAME, MODEL_NAME
from fuselm.errors import FuselmError
from fuselm.graphcheck import ORT_DOMAIN, ORT_ONNX_DOMAIN_CONTRIB, check_graph_file
from fuselm.modeldir import read_meta


def resolve(in_path: str | os.PathLike) -> tuple[Path, dict | None]:
    """(path of the .onnx file, fuselm.json contents or None) for a model dir or a plain .onnx.

    The file is checked first (fuselm/graphcheck.py: tensor sizes, external data paths, a DAG,
    onnx.checker), so a bad input stops here with exit 2, not inside a pass."""
    p = Path(in_path)
    if p.is_dir():
        onnx_path = p / MODEL_NAME
        if not onnx_path.is_file():
            raise FuselmError(f"{p} has no {MODEL_NAME}; pass a fuselm model directory (from `fuselm convert`) "
                              "or an .onnx file")
        meta = read_meta(p) if (p / META_NAME).is_file() else None
        check_graph_file(onnx_path)
        return onnx_path, meta
    if p.is_file():
        if p.suffix != ".onnx":
            raise FuselmError(f"{p} is not an .onnx file; pass a fuselm model directory or an .onnx file")
        check_graph_file(p)
        return p, None
    raise FuselmError(f"{p} does not exist; pass a fuselm model directory or an .onnx file")


def load(onnx_path: str | os.PathLike) -> ir.Model:
    """The graph with lazily mapped external weights; a clear error for a file that is not ONNX."""
    try:
        return ir.load(onnx_path)
    except FuselmError:
        raise
    except Exception as e:
        raise FuselmError(f"cannot read {onnx_path} as an ONNX model ({type(e).__name__}: {e}); "
                          "pass a file written by torch.onnx, optimum or `fuselm convert`") from None


def save(model: ir.Model, out_dir: str | os.PathLike) -> Path:
    """Write `model.onnx` + `model.onnx.data` into `out_dir` (weights > 256 bytes external); a GatherBlockQuantized
    sharing its table with the lm_head gets initializers of its own over the same bytes (`map_tables_apart`)."""
    path = Path(out_dir) / MODEL_NAME
    ir.save(model, path, external_data=DATA_NAME)
    if any(n.domain == ORT_DOMAIN and n.op_type == "GatherBlockQuantized" for n in model.graph):
        from .ort_gather_quantized import map_tables_apart

        map_tables_apart(path)  # a tied table: the embedding maps its own view of the head's bytes
    return path


def check(path: str | os.PathLike) -> None:
    """The contract's validity check (full check, with shape inference); a graph lowered to
    onnxruntime's contrib ops goes through fuselm/graphcheck.py, which has onnxruntime check them."""
    model = onnx.load(str(path), load_external_data=False)
    if any(n.domain == ORT_DOMAIN or n.op_type in ORT_ONNX_DOMAIN_CONTRIB for n in model.graph.node):
        check_graph_file(path)
    else:
        onnx.checker.check_model(str(path), full_check=True)


def save_checked(model: ir.Model, out_dir: str | os.PathLike, what: str, fix: str) -> Path:
    """`save` then `check`; a graph that fails the check is a CheckFailed naming `what` and the `fix`."""
    from fuselm.errors import CheckFailed

    path = save(model, out_dir)
    try:
        check(path)
    except Exception as e:
        raise CheckFailed(f"{what} fails onnx.checker ({e}); {fix}") from None
    return path
