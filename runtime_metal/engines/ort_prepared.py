"""The graph lowered for onnxruntime, prepared once beside a standard one (`--backend auto` on a CPU).

`fuselm optimize --target onnxruntime` (MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization,
GatherBlockQuantized; its default accuracy level) writes the lowered copy into the prepared store's
`onnxruntime-<key>/` through runtime_metal/prepared.py's `prepared_dir` (keyed by
model.onnx's sha256, the data file's size and mtime, fuselm's and onnxruntime's versions and the accuracy
level; written atomically under a lock, checked on read, rebuilt when stale or damaged). A graph the passes
cannot lower (optimize refuses it, or no matmul became MatMulNBits, which is where the speed comes from),
or onnxruntime cannot load the lowered graph, is remembered under the key: `--backend auto` then runs the
torch backend and says why.

A fresh process finds the copy by the source's stat fingerprint (`existing`: no onnx, no graph read) and
runs it unchecked: it was checked when it was written, and its stamp proves it is what was written.

The copy only generates, so its head runs on the prompt's last position (passes/last_logits.py); onnxruntime-genai
0.18 binds a [B, S, vocab] logits buffer and rejects such a graph, so the copy runs on onnxruntime's IO-binding
loop (engines/ort.py BoundLoop). Its genai_config.json (fuselm/genai_config.py) turns onnxruntime's graph
optimizations off: the passes already lowered the graph, and onnxruntime's optimizer would only copy the tied
embedding's table and inline SwiGLU.
"""

from __future__ import annotations

import gc
from pathlib import Path

from fuselm import contract
from fuselm.errors import CheckFailed, FuselmError
from fuselm.genai_config import LOWERED_GRAPH_OPTIMIZATION as GRAPH_OPTIMIZATION

FORMAT = "onnxruntime"


def _tag() -> str:
    return (f"onnxruntime {onnxruntime_version()}, accuracy level {contract.ORT_ACCURACY_LEVEL}, "
            f"graph optimization {GRAPH_OPTIMIZATION}, the last logits_to_keep positions' logits")


def onnxruntime_version() -> str:
    """onnxruntime's version from its build file (what onnxruntime itself reports), without importing it:
    onnxruntime-genai loads the library itself."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("onnxruntime")
    try:
        text = (Path(spec.origin).parent / "capi" / "build_and_package_info.py").read_text()
        return re.search(r"^__version__ = [\'\"]([^\'\"]+)[\'\"]", text, re.M).group(1)
    except (AttributeError, OSError, TypeError):
        import onnxruntime

        return onnxruntime.__version__


def existing(model_dir) -> tuple[Path, dict] | None:
    """(directory, facts) of a lowered copy made from the model as it is now (stat fingerprint), else None."""
    from ..prepared import find_prepared_dir

    return find_prepared_dir(model_dir, FORMAT, _tag())


def lowered_copy(model_dir, facts: dict | None = None) -> tuple[Path, str]:
    """(directory of the lowered graph, "read" or "written ..."); CannotPrepare (runtime_metal/prepared.py)
    with the reason when the passes cannot lower this graph. `facts`: kept in the copy's stamp for `existing`."""
    from ..prepared import prepared_dir

    level = contract.ORT_ACCURACY_LEVEL
    return prepared_dir(model_dir, FORMAT, _tag(), lambda tmp: _lower(Path(model_dir), tmp, level), facts)


def _lower(model_dir: Path, out: Path, level: int) -> None:
    import onnx
    from fuselm.passes.pipeline import optimize

    from fuselm.graphcheck import ORT_DOMAIN

    from ..prepared import CannotPrepare

    try:
        optimize(model_dir, out, target="onnxruntime", accuracy_level=level, last_logits=True, quiet=True)
    except (FuselmError, CheckFailed) as e:
        raise CannotPrepare(f"`fuselm optimize --target onnxruntime` refused it ({e})") from None
    # the passes' graph is cyclic garbage holding a mapping of every source weight: free it now (this process
    # goes on to generate)
    gc.collect()
    graph = onnx.load(str(out / contract.MODEL_NAME), load_external_data=False).graph
    if not any(n.domain == ORT_DOMAIN and n.op_type == "MatMulNBits" for n in graph.node):
        raise CannotPrepare("the onnxruntime passes lowered none of its matmuls to MatMulNBits "
                            "(`fuselm diff --target onnxruntime` shows why)")
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level, so.log_severity_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL, 3
    so.add_session_config_entry("session.disable_prepacking", "1")  # kernels built on the real weights; packing is the run's
    try:  # every op has a CPU kernel in this onnxruntime (a run must not fail after auto chose it)
        ort.InferenceSession(str(out / contract.MODEL_NAME), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
        raise CannotPrepare(f"onnxruntime {ort.__version__} cannot load the lowered graph "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
