#!/usr/bin/env bash
# Installs mldebug (editable) and what it needs on a fresh machine with Python >= 3.10.
#   bash scripts/setup.sh          the package
#   bash scripts/setup.sh --dev    plus everything the test suite needs
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# torch first and pinned: an unpinned `torch` resolves to a multi-GB CUDA build, while
# 2.13.0 is the CPU build this project is developed and tested with.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
if [[ "${1:-}" == "--dev" ]]; then
    "$PY" -m pip install -q -e ".[dev]"
else
    "$PY" -m pip install -q -e .
fi
