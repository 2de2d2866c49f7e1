#!/usr/bin/env bash
# Create .venv (if missing) and install fuselm with its dev tools. torch is pinned: the CPU
# wheel on Linux; an open range would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
# The CPU kernels, compiled now into a persistent cache (keyed by their sources, torch and Python), so
# that no `fuselm run` needs a compiler; without one fuselm dequantizes weights to f32 at load.
python -m fuselm.runtime_metal.backends.kernel_build || echo "setup.sh: CPU kernels not built (see above)" >&2
# optimum-onnx, whose export is one of the foreign graphs the passes are tested on, needs transformers < 4.58:
# its own environment (tests/passes/test_foreign_graphs.py runs it in a child process).
if [ ! -x .venv-optimum/bin/python ]; then
    "$PY" -m venv .venv-optimum
    .venv-optimum/bin/python -m pip install -q torch==2.13.0
    .venv-optimum/bin/python -m pip install -q "optimum-onnx==0.1.0" "transformers>=4.57,<4.58" "onnx>=1.23" "onnxruntime>=1.31"
fi
# `fuselm diff --html` is checked in a real headless browser (tests/passes/test_passes_cli.py).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium >/dev/null
fi
