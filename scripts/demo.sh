#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: build a small checkpoint, convert, optimize,
# diff, validate and generate text. Extra arguments go to examples/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python examples/demo.py "$@"
