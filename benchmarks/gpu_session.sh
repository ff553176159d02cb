#!/usr/bin/env bash
# The GPU figures of the watch and the recorder (benchmarks/README.md), as ONE command
# that fits a borrowed GPU machine's limits (10 minutes a command, no network there).
#
#   on a machine that reaches the package registry, first:
#       bash benchmarks/gpu_session.sh --fetch-wheels      (.whl/ is git-ignored locally)
#   then on the GPU machine, with .whl/ copied beside the tree:
#       bash benchmarks/gpu_session.sh
#
# The GPU image has torch, numpy, pytest and Lightning but not mldebug's prompt and view
# packages (debugpy, ipdb/IPython, bokeh, tornado, pexpect): those travel as wheels.
# Every part has its own time limit, so one that hangs still leaves the others' output;
# everything is written under $OUT (the tool brings it back), or ./gpu-out elsewhere.
# Without CUDA (a dry run here) it says so and ends at once.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(debugpy==1.8.22 ipdb==0.13.13 ipython==9.18.1 ipython-pygments-lexers decorator
        jedi parso matplotlib-inline pexpect ptyprocess prompt_toolkit wcwidth stack-data
        executing asttokens pure_eval traitlets bokeh==3.9.2 tornado==6.6.1 xyzservices)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    # the image's python is 3.12 on x86-64: wheels for it, whatever this machine is
    exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
fi

OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

part() {   # part NAME SECONDS COMMAND...: its output in $OUT/NAME.txt and on stdout
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%T), limit ${limit}s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} | tee "$OUT/machine.txt"
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_session: no CUDA device here: nothing to measure"
    exit 0
fi

# 1. correctness first: the CUDA paths, and the device-path tests on a real device
# (the image has pytest-xdist: four workers share the GPU)
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
part tests 180 python3 -m pytest -q -p no:cacheprovider $XDIST tests/test_cuda_paths.py \
    tests/record/test_record_ops.py tests/record/test_record.py \
    tests/watch/test_step_read.py tests/watch/test_step_ledger.py tests/watch/test_op_budget.py \
    tests/test_cuda_graph_capture.py tests/record/test_block_graphs.py \
    tests/watch/test_rerun.py
# 2. the watch: launch-bound models, then the GPT with 16x the batch (GPU busy)
part watch 120 python3 benchmarks/bench_watch.py --device cuda --quick --models mlp,cnn,gpt
part watch_x16 50 python3 benchmarks/bench_watch.py --device cuda --quick --models gpt \
    --batch-scale 16
# 3. the recorder, every step and not
part record 140 python3 benchmarks/bench_record.py --device cuda --quick --models mlp,cnn,gpt
# 4. the CPU's stand-in for a launch-bound step on this host, beside the GPU's figures above:
# what calibrates it for machines without a GPU (benchmarks/README.md, watch)
part standin 50 python3 benchmarks/bench_watch.py --launch-bound --quick --models mlp,cnn,gpt \
    --variants plain2,empty_mode,watch
echo "gpu_session: done $(date -u +%T); files in $OUT"
