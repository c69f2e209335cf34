#!/usr/bin/env bash
# The GPU check: every CUDA path of radixserve in one device call, within 6 minutes by the
# estimates in bench/gpu_plan.py. Steps (names for --only), phase by phase:
#   wheels     the carried wheels (.whl/, bench/gpu_wheels.sh) installed into a private folder
#   preflight  every step's imports with the image's missing packages blocked
#   tests      tests/unit/test_kernels.py and test_awq_kernel.py compiled (pytest -n 8)  } side
#   server     radixserve serve on CUDA vs transformers, a radixserve bench burst       } by side
#   model kernels awq profile tokens   bench/gpu_bench.py's sections, timed one after another
# Every row is printed as soon as it is measured and appended to $OUT/gpu_check.md (a temp
# file without OUT); the verdict line comes last, also when the deadline or a signal stops it.
# docs/gpu.md says what to run before, the exact device call, and what to paste after.
#
#   bash bench/gpu_check.sh                   # on the GPU machine (the device call)
#   bash bench/gpu_check.sh --only tests,awq  # rerun the failing steps alone
#   bash bench/gpu_check.sh --dry-run         # each step's estimate and the total; runs nothing
#   bash bench/gpu_check.sh --smoke           # the same script on CPU (make test)
#   bash bench/gpu_check.sh --help            # the documented command
#
# Exit status: 0 every row passed, 1 a row failed or was not reached, 2 bad arguments.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" # kernels/, services/, bench/
export PYTHONUNBUFFERED=1

usage() {
    cat <<'EOF'
The GPU check (docs/gpu.md). Here first, where PyPI answers:
    make setup && make test                  # the CPU smoke of this script, the compile rehearsal
    bash bench/gpu_wheels.sh                 # .whl/: the wheels the GPU image lacks (~17 MiB)
    bash bench/gpu_check.sh --dry-run        # the steps' estimates: the total must be <= 360 s
Then ONE device call (the device tool's `run`):
    command:   bash bench/gpu_check.sh
    carry:     [".whl"]
    timeout_s: 450          (the check stops itself at 360 s and prints its verdict)
A FAIL or a step not reached: rerun only those steps, in the same warm machine if it is:
    command:   bash bench/gpu_check.sh --only tests,server     (the verdict line names them)
After: paste the table of gpu_check.md (under the call's files) and its verdict line into
docs/gpu.md's "Results", with the date and the commit; each FAIL row becomes a fix at once.
Options: --only STEPS (comma-separated: wheels,preflight,tests,server,model,kernels,awq,
profile,tokens), --dry-run, --smoke, --peak-tbps X, --deadline-s N, --help.
EOF
}

SMOKE=0
DRY=0
ONLY=""
DEADLINE_S=""
BENCH_EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
    --smoke) SMOKE=1 ;;
    --dry-run) DRY=1 ;;
    --only) ONLY=${2:-}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    --deadline-s) DEADLINE_S=${2:-}; shift ;;
    --peak-tbps) BENCH_EXTRA+=(--peak-tbps "${2:-}"); shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

plan() { "$PY" bench/gpu_plan.py "$@"; }
ALL_STEPS=$(plan steps) || { echo "gpu_check: $PY cannot run bench/gpu_plan.py"; exit 2; }
STEPS=${ONLY:-${ALL_STEPS// /,}}
plan est "$STEPS" > /dev/null || exit 2 # names an unknown step
[ -n "$DEADLINE_S" ] || DEADLINE_S=$("$PY" -c "from bench.gpu_plan import DEADLINE_S; print(DEADLINE_S)")
if [ "$DRY" -eq 1 ]; then
    plan dry-run "$STEPS"
    echo
    usage
    exit 0
fi
selected() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

if [ -n "${OUT:-}" ]; then
    LOGS=$OUT
else
    LOGS=$(mktemp -d)
fi
ROWS=$LOGS/gpu_check.md
export GPU_CHECK_ROWS=$ROWS
: > "$ROWS.steps"
{
    echo "GPU check of $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(date -u '+%Y-%m-%d %H:%M UTC'), steps $STEPS"
    echo
    echo "| check | measured | target | result |"
    echo "|---|---|---|---|"
} > "$ROWS"
echo "gpu_check: rows in $ROWS, logs in $LOGS; deadline ${DEADLINE_S} s" >&2
sed -n '3,4p' "$ROWS"

STEP=""
STOPPED=""
FINISHED=""
row() { # check, measured, target, result: printed now, kept in the rows file
    local line="| $1 | $2 | $3 | $4 |"
    echo "$line"
    echo "$line" >> "$ROWS"
    case "$4" in FAIL | SKIP) echo "$4 $STEP" >> "$ROWS.steps" ;; esac
}

finish() { # the verdict, last: on a normal end, the deadline, or a signal
    [ -n "$FINISHED" ] && return
    FINISHED=1
    local pids
    pids=$(jobs -p)
    local kids
    for pid in $pids; do # a step still running: its shell first (its row would follow the
        kids=$(pgrep -P "$pid") # verdict), then its timeout, which passes the signal on
        kill "$pid" 2> /dev/null
        [ -n "$kids" ] && kill -TERM $kids 2> /dev/null
        wait "$pid" 2> /dev/null
    done
    local failed rerun label verdict
    failed=$(grep -E '\| FAIL \|$' "$ROWS" | sed -E 's/^\| ([^|]*) \|.*/\1/' | sed 's/ *$//' | paste -sd ';' -)
    rerun=$(awk '{print $2}' "$ROWS.steps" | grep -v '^?$' | sort -u | paste -sd ',' -)
    label="GPU CHECK"
    [ "$SMOKE" -eq 1 ] && label="GPU CHECK (--smoke, CPU)"
    if [ -z "$failed" ] && [ -z "$rerun" ] && [ -z "$STOPPED" ]; then
        verdict="$label: PASS"
    else
        verdict="$label: FAIL (${failed:-no row failed}${STOPPED:+; stopped by $STOPPED}${rerun:+; rerun: bash bench/gpu_check.sh --only $rerun})"
    fi
    echo
    echo "----- the table ($ROWS) -----"
    tail -n +3 "$ROWS"
    echo "$verdict" >> "$ROWS"
    echo "$verdict"
    [ "$verdict" = "$label: PASS" ]
}
trap 'finish; exit $?' EXIT
trap 'STOPPED="a signal"; exit 1' TERM INT HUP

left_s() { echo $((DEADLINE_S - SECONDS)); }

run_step() { # step(s), log file, command...: under its cap and the deadline; a row if it dies
    STEP=$1
    local log=$2 est cap left before rc
    shift 2
    est=$(plan est "$STEP")
    cap=$(plan cap "$STEP")
    left=$(left_s)
    if [ "$left" -lt $((est / 2)) ] || [ "$left" -lt 5 ]; then
        row "$STEP" "not reached: $left s of the ${DEADLINE_S} s deadline left, needs ~$est s" "" SKIP
        return 1
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    before=$(grep -c "^FAIL $STEP\$" "$ROWS.steps")
    echo "gpu_check: $STEP (estimate $est s, cap $cap s) $(date -u +%T)" >&2
    GPU_CHECK_STEP=$STEP timeout -k 5 "$cap" "$@" 2>> "$log"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        row "$STEP" "stopped at its $cap s cap (log: $(basename "$log"))" "<= $cap s" FAIL
    elif [ "$rc" -ne 0 ] && [ "$(grep -c "^FAIL $STEP\$" "$ROWS.steps")" -eq "$before" ]; then
        row "$STEP" "exited $rc: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200 | tr '|' '/')" "" FAIL
    fi
    if [ "$rc" -ne 0 ]; then
        echo "----- $STEP: exit $rc, last 30 lines of $log -----" >&2
        tail -n 30 "$log" >&2
    fi
    return "$rc"
}

SITE=$(mktemp -d)/site # not under $OUT: only the rows and logs come back
wheels_step() {
    if [ "$SMOKE" -eq 1 ]; then
        row "carried wheels" "--smoke: .venv has every package" "" ""
        return 0
    fi
    local n
    n=$(ls .whl/*.whl 2> /dev/null | wc -l)
    if [ "$n" -eq 0 ]; then
        STEP=wheels row "carried wheels (.whl/)" "none: run bash bench/gpu_wheels.sh here and carry .whl" "the server step's packages" FAIL
        return 1
    fi
    run_step wheels "$LOGS/gpu_check.log" "$PY" -m pip install -q --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl &&
        row "carried wheels (.whl/)" "$n wheels, $(du -sh .whl | cut -f1), installed for the server's processes only" "installed" PASS
}

tests_step() {
    if [ "$SMOKE" -eq 1 ]; then
        row "GPU tests" "--smoke: make test runs them (interpreted); preflight imported them" "" ""
        return 0
    fi
    local xdist=() summary rc
    "$PY" -c "import xdist" 2> /dev/null && xdist=(-n 8)
    unset TRITON_INTERPRET # compiled for the GPU
    run_step tests "$LOGS/tests.log" "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        tests/unit/test_kernels.py tests/unit/test_awq_kernel.py
    rc=$?
    summary=$(grep -E '(passed|failed|error)' "$LOGS/tests.log" | tail -n 1 | tr -d '=|' | sed 's/^ *//')
    [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] && row "GPU tests compiled (pytest ${xdist[*]:-serial})" \
        "${summary:-no summary (exit $rc)}" "all pass" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
    return "$rc"
}

smoke_args=()
[ "$SMOKE" -eq 1 ] && smoke_args=(--smoke) && export TRITON_INTERPRET=1

if selected wheels || selected server; then wheels_step; fi # the server needs them
if selected preflight; then
    if run_step preflight "$LOGS/gpu_check.log" "$PY" bench/gpu_preflight.py "${smoke_args[@]}"; then
        row "preflight: every step imports without pyzmq, protobuf, grpc, xgrammar, pydantic" "all import" "all import" PASS
    else
        exit 1 # nothing below would import: the verdict names the preflight
    fi
fi

# Phase 2, side by side: the tests compile and check, the server row times nothing precise.
pids=()
if selected tests; then
    tests_step &
    pids+=($!)
fi
if selected server; then
    run_step server "$LOGS/server.log" "$PY" bench/gpu_server.py "${smoke_args[@]}" --site "$SITE" &
    pids+=($!)
fi
for pid in "${pids[@]}"; do wait "$pid"; done

bench_steps=()
for s in model kernels awq profile tokens; do selected "$s" && bench_steps+=("$s"); done
if [ ${#bench_steps[@]} -gt 0 ]; then
    list=$(IFS=,; echo "${bench_steps[*]}")
    run_step "$list" "$LOGS/gpu_check.log" "$PY" bench/gpu_bench.py "${smoke_args[@]}" \
        --only "$list" --budget-s "$(($(left_s) - 5))" "${BENCH_EXTRA[@]}"
fi
exit 0 # finish() prints the verdict and sets the status
