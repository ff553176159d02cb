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

# the C kernels, built now rather than at first use: the recorder's one-pass statistics
# (mldebug/record/fused.c) and the watch's NaN/Inf bit test (mldebug/watch/finite.c);
# without a C compiler each takes its torch path instead
"$PY" -c "from mldebug.record import native
from mldebug.watch import native_check
k = native.kernel()
print('setup: recorder kernel', 'built' if k else 'not built (' + native.reason() + '): the torch path is used')
why = native_check.reason()
print('setup: watch kernel', 'not built (' + why + '): the torch path is used' if why else 'built')"
