"""The graph lowered for onnxruntime, prepared once beside a standard one (`--backend auto` on a CPU).

`fuselm optimize --target onnxruntime` (MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization,
GatherBlockQuantized; its default accuracy level) writes the lowered copy into
`MODEL/.fuselm-prepared/onnxruntime-<key>/` through runtime_metal/prepared.py's `prepared_dir` (keyed by
model.onnx's sha256, the data file's size and mtime, fuselm's and onnxruntime's versions and the accuracy
level; written atomically under a lock, checked on read, rebuilt when stale or damaged). A graph the passes
cannot lower (optimize refuses it, or no matmul became MatMulNBits, which is where the speed comes from),
or onnxruntime cannot load the lowered graph, is remembered under the key: `--backend auto` then runs the
torch backend and says why.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from . import contract
from .errors import CheckFailed, FuselmError
from .graphcheck import ORT_DOMAIN

FORMAT = "onnxruntime"


def lowered_copy(model_dir) -> tuple[Path, str]:
    """(directory of the lowered graph, "read" or "written ..."); CannotPrepare (runtime_metal/prepared.py)
    with the reason when the passes cannot lower this graph."""
    import onnxruntime

    from .passes.ort_matmul_nbits import DEFAULT_ACCURACY_LEVEL
    from .runtime_metal.prepared import prepared_dir

    level = DEFAULT_ACCURACY_LEVEL
    return prepared_dir(model_dir, FORMAT, f"onnxruntime {onnxruntime.__version__}, accuracy level {level}",
                        lambda tmp: _lower(Path(model_dir), tmp, level))


def _lower(model_dir: Path, out: Path, level: int) -> None:
    from . import optimize
    from .runtime_metal.prepared import CannotPrepare

    try:
        optimize(model_dir, out, target="onnxruntime", accuracy_level=level, quiet=True)
    except (FuselmError, CheckFailed) as e:
        raise CannotPrepare(f"`fuselm optimize --target onnxruntime` refused it ({e})") from None
    graph = onnx.load(str(out / contract.MODEL_NAME), load_external_data=False).graph
    if not any(n.domain == ORT_DOMAIN and n.op_type == "MatMulNBits" for n in graph.node):
        raise CannotPrepare("the onnxruntime passes lowered none of its matmuls to MatMulNBits "
                            "(`fuselm diff --target onnxruntime` shows why)")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level, so.log_severity_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL, 3
    try:  # every op has a CPU kernel in this onnxruntime (a run must not fail after auto chose it)
        ort.InferenceSession(str(out / contract.MODEL_NAME), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
        raise CannotPrepare(f"onnxruntime {ort.__version__} cannot load the lowered graph "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
