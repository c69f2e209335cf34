#!/usr/bin/env bash
# One-shot GPU check (about 3-5 minutes; hard limits keep it under 8). In order:
#   1. wheels carried in .whl/ (bench/gpu_wheels.sh) installed with --no-index into a
#      private folder, when the image lacks them;
#   2. a preflight (bench/gpu_preflight.py) that imports everything below and names what is
#      missing;
#   3. tests/unit/test_kernels.py and test_awq_kernel.py compiled for the GPU;
#   4. bench/gpu_bench.py: kernel speed, the model path (logits vs transformers, prefix
#      extend, CUDA-graph replay vs eager, seeded sampling), the default-config profile and
#      decode tokens/s; ONE markdown table, then one line: GPU CHECK: PASS | FAIL (<rows>).
#
#   bash bench/gpu_check.sh                  # on a CUDA machine, from anywhere
#   bash bench/gpu_check.sh --peak-tbps 3.35 # when the device is not in gpu_bench.py's table
#   bash bench/gpu_check.sh --smoke          # the same script on CPU (tiny shapes, kernels
#                                            # interpreted, graph rows skipped): make test
#
# Exit status: 0 all targets met, 1 a check failed, 2 no usable GPU / Python / imports.
set -u
cd "$(dirname "$0")/.."
SMOKE=0
for arg in "$@"; do [ "$arg" = "--smoke" ] && SMOKE=1; done
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
TESTS_LIMIT_S=200   # compiling ~40 kernel variants dominates
BENCH_LIMIT_S=300   # gpu_bench.py stops starting sections after --budget-s
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # kernels/, services/, bench/

if [ "$SMOKE" -eq 0 ] && ls .whl/*.whl > /dev/null 2>&1; then
    site=$(mktemp -d)/site
    echo "gpu_check: installing the carried wheels (.whl/) into $site" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl || { echo "GPU CHECK: FAIL (installing .whl/)"; exit 2; }
    export PYTHONPATH="$site:$PYTHONPATH"
fi

preflight_args=()
[ "$SMOKE" -eq 1 ] && preflight_args=(--smoke)
if ! "$PY" bench/gpu_preflight.py "${preflight_args[@]}"; then
    echo "GPU CHECK: FAIL (preflight: see the lines above)"
    exit 2
fi

log_dir=$(mktemp -d)
bench_args=("$@")
if [ "$SMOKE" -eq 1 ]; then
    export TRITON_INTERPRET=1
    # make test runs tests/unit/test_kernels.py itself: the smoke run checks this script.
    echo "gpu_check: --smoke: kernel tests skipped (make test runs them interpreted)" >&2
else
    unset TRITON_INTERPRET   # compile the kernels for the GPU
    echo "gpu_check: kernel tests (limit ${TESTS_LIMIT_S} s), logs in $log_dir" >&2
    timeout -k 10 "$TESTS_LIMIT_S" "$PY" -m pytest -q -p no:cacheprovider \
        tests/unit/test_kernels.py tests/unit/test_awq_kernel.py > "$log_dir/tests.log" 2>&1
    tests_rc=$?
    tests_summary=$(tail -n 1 "$log_dir/tests.log" | tr -d '|')
    if [ "$tests_rc" -eq 124 ] || [ "$tests_rc" -eq 137 ]; then
        tests_summary="timed out after ${TESTS_LIMIT_S} s"
    fi
    if [ "$tests_rc" -ne 0 ]; then
        echo "----- kernel tests (rc $tests_rc), last 80 lines -----"
        tail -n 80 "$log_dir/tests.log"
        echo "-----"
    fi
    bench_args+=(--tests-summary "$tests_summary" --tests-rc "$tests_rc")
fi

echo "gpu_check: benchmarks (limit ${BENCH_LIMIT_S} s)" >&2
timeout -k 10 "$BENCH_LIMIT_S" "$PY" bench/gpu_bench.py --budget-s $((BENCH_LIMIT_S - 60)) \
    "${bench_args[@]}" 2> "$log_dir/bench.log"
bench_rc=$?
if [ "$bench_rc" -ne 0 ] && [ "$bench_rc" -ne 1 ]; then
    echo "----- gpu_bench.py failed (rc $bench_rc; 124 = timed out), last 40 lines of its log -----"
    tail -n 40 "$log_dir/bench.log"
    echo "GPU CHECK: FAIL (gpu_bench.py exited $bench_rc)"
    exit 1
fi
if [ "$bench_rc" -ne 0 ] && grep -q Traceback "$log_dir/bench.log"; then
    echo "(tracebacks of the failed sections: $log_dir/bench.log)"
fi
exit "$bench_rc"
