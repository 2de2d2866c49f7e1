#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# One worker per core, a test file each (tests/conftest.py gives each worker one torch thread);
# `scripts/test.sh -n 0` runs in this one process.
python -m pytest -q -n auto --dist loadfile "$@"
