#!/usr/bin/env bash
# One-shot GPU check (about 3-5 minutes; hard limits keep it under 8): runs
# tests/unit/test_kernels.py compiled for the GPU, then bench/gpu_bench.py, and prints ONE
# markdown table (pytest's failure output, if any, comes before it).
#
#   bench/gpu_check.sh                  # on a CUDA machine, from anywhere
#   bench/gpu_check.sh --peak-tbps 3.35 # when the device is not in gpu_bench.py's table
#
# Exit status: 0 all targets met, 1 a check failed, 2 no usable GPU / Python.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TESTS_LIMIT_S=200   # compiling ~40 kernel variants dominates
BENCH_LIMIT_S=270   # gpu_bench.py stops starting sections after --budget-s

if ! "$PY" -c 'import sys, torch, triton, transformers; sys.exit(0 if torch.cuda.is_available() else 3)'; then
    echo "gpu_check: needs $PY with torch (CUDA build, a visible GPU), triton and transformers" >&2
    exit 2
fi
unset TRITON_INTERPRET   # compile the kernels for the GPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # kernels/, services/ without an install

log_dir=$(mktemp -d)
echo "gpu_check: kernel tests (limit ${TESTS_LIMIT_S} s), logs in $log_dir" >&2
timeout -k 10 "$TESTS_LIMIT_S" "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kernels.py \
    > "$log_dir/tests.log" 2>&1
tests_rc=$?
tests_summary=$(tail -n 1 "$log_dir/tests.log" | tr -d '|')
if [ "$tests_rc" -eq 124 ] || [ "$tests_rc" -eq 137 ]; then
    tests_summary="timed out after ${TESTS_LIMIT_S} s"
fi
if [ "$tests_rc" -ne 0 ]; then
    echo "----- tests/unit/test_kernels.py (rc $tests_rc), last 80 lines -----"
    tail -n 80 "$log_dir/tests.log"
    echo "-----"
fi

echo "gpu_check: benchmarks (limit ${BENCH_LIMIT_S} s)" >&2
timeout -k 10 "$BENCH_LIMIT_S" "$PY" bench/gpu_bench.py --budget-s $((BENCH_LIMIT_S - 60)) \
    --tests-summary "$tests_summary" --tests-rc "$tests_rc" "$@" 2> "$log_dir/bench.log"
bench_rc=$?
if [ "$bench_rc" -ne 0 ] && [ "$bench_rc" -ne 1 ]; then
    echo "----- gpu_bench.py failed (rc $bench_rc; 124 = timed out), last 40 lines of its log -----"
    tail -n 40 "$log_dir/bench.log"
    exit 1
fi
if [ "$bench_rc" -ne 0 ] && grep -q Traceback "$log_dir/bench.log"; then
    echo "(tracebacks of the failed sections: $log_dir/bench.log)"
fi
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
