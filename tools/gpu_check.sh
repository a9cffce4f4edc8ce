#!/usr/bin/env bash
# Does nanoqwen's CUDA path work on this machine, and how fast is it? One command, offline,
# in at most 9 minutes of wall time, flashinfer's kernel build included.
#
#   tools/gpu_wheels.sh                  # first, where the package index is reachable
#   tools/gpu_check.sh OUTDIR            # then on the GPU machine, from the same checkout
#   tools/gpu_check.sh OUTDIR --dry-run  # any machine: the CUDA parts skipped, saying so
#
# For a machine with a CUDA GPU, a CUDA build of torch, nvcc and transformers, and no
# package index. In order, each part under a time limit:
#   install       the wheels of .whl/ into a folder of the check's own, without an index,
#                 once (~/.cache/nanoqwen/gpu-check: later runs find them there)
#   environment   the GPU, driver, torch and its CUDA, nvcc, flashinfer, other versions
#   kernels       flashinfer's kernels for Qwen3-0.6B's shape, built as an engine does at
#                 start-up (decode, then FA3 prefill or FA2's), for this GPU only, timed
#   bench_graphs  bench.py on random weights of Qwen3-0.6B's shape with nano-vllm's published
#                 workload (256 requests, prompts and outputs of 100-1024 tokens, max_model_len
#                 4096), flashinfer with CUDA graphs
#   bench_eager   the same, --enforce-eager
#   bench_torch   the same, --attention-backend torch
#   bench_batch1  one request, 128 tokens in, 256 out, against the bandwidth and dense floors
#   pytest        pytest -m cuda (it builds the test models' kernels too), last, in the time
#                 the others left
# The random weights are built in the background meanwhile (part "checkpoint"). It writes
# OUTDIR/gpu_check.json (every figure; docs/gpu.md says what it holds) and OUTDIR/gpu_check.log
# (everything printed), and exits with 1 if a part failed or ran out of its time.
#
# Without a CUDA GPU (or with --dry-run) every CUDA part is skipped with the reason, and the
# rest still runs: CI runs it so, and keeps it from rotting. PYTHON picks the interpreter
# (default python3: on a GPU image, the one with the CUDA torch), WHEELS the folder of wheels
# (default .whl).
set -euo pipefail

usage() { echo "usage: tools/gpu_check.sh OUTDIR [--dry-run]" >&2; exit 2; }
OUTDIR=""
DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -h|--help) usage ;;
        -*) echo "gpu_check: unknown option $arg" >&2; usage ;;
        *) [[ -z $OUTDIR ]] || usage; OUTDIR=$arg ;;
    esac
done
[[ -n $OUTDIR ]] || usage

if ! command -v "${PYTHON:-python3}" >/dev/null; then
    echo "gpu_check: no ${PYTHON:-python3} here (PYTHON names the interpreter)" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG=$OUTDIR/gpu_check.log
JSON=$OUTDIR/gpu_check.json
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
PRESET=qwen3-0.6b
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
: >"$LOG"

# The parts' records and their own results live here until the report gathers them into
# OUTDIR.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nanoqwen-gpu-check.XXXXXX")
# The wheels are installed once per set of wheels, into a folder that stays: flashinfer's
# kernel cache is only reused from the same flashinfer folder (the build files it writes name
# its headers' paths, and ninja rebuilds a module whose command line or headers changed).
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
SITE=$WORK/site  # where no wheels are installed: nothing there
if (( ${#wheels[@]} )); then
    wheels_id=$(printf '%s\n' "${wheels[@]##*/}" | sort | sha256sum | cut -c1-12)
    SITE=${XDG_CACHE_HOME:-$HOME/.cache}/nanoqwen/gpu-check/site-$wheels_id
fi
CHECKPOINT_PID=""
cleanup() {
    # The background build is a shell that runs `timeout` (which passes the signal on): both.
    if [[ -n $CHECKPOINT_PID ]]; then
        pkill -P "$CHECKPOINT_PID" 2>/dev/null || true
        kill "$CHECKPOINT_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# The whole run stays within TOTAL_S. Each part gets at most its cap, and never the time the
# parts after it need at the least (their floors): a part that cannot have its own floor is
# skipped, and time a part leaves unused goes to the next. A part that outruns its limit is
# interrupted with SIGINT (pytest then still reports what ran), and killed GRACE_S later.
# On a machine that has never built flashinfer's kernels, compiling them takes most of the
# time (the kernels part, then pytest's own models): the tests run last, so that what the
# benchmarks leave of their caps goes to them, and the floors keep the kernels' build from
# taking the benchmarks' time. flashinfer caches what it built (~/.cache/flashinfer), and
# so does the random-weights checkpoint (~/.cache/nanoqwen): a second run, from the same
# installed wheels and for the same FLASHINFER_CUDA_ARCH_LIST, starts where the first left.
# The floors are what each benchmark took on the first run on an H100 (docs/gpu.md), and a
# margin: bench.py spends some 20 s importing and starting its engines before it measures.
TOTAL_S=540
REPORT_S=15  # kept for the report at the end
GRACE_S=10
#      part             cap  floor  (seconds)
PARTS="install          60     10
       environment      60     10
       kernels         240     60
       kernels_resumed 170     30
       bench_graphs     80     60
       bench_eager      80     65
       bench_torch     150    125
       bench_batch1     60     45
       pytest          400     60"

# No time is set aside for these parts' floors: the resumed kernel build runs only when the
# first one ran out of time, and then in the flashinfer benchmarks' place (see below).
UNRESERVED="kernels_resumed"

say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
part_field() { awk -v name="$1" -v field="$2" '$1 == name { print $field }' <<<"$PARTS"; }
floors_after() {
    awk -v name="$1" -v unreserved=" $UNRESERVED " '
        after && !index(unreserved, " " $1 " ") { s += $3 }
        $1 == name { after = 1 }
        END { print s + 0 }' <<<"$PARTS"
}
# record NAME STATUS SECONDS LIMIT NOTE COMMAND: one line of WORK/parts.tsv for the report.
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$WORK/parts.tsv"; }
skip() {  # skip NAME WHY COMMAND...
    local name=$1 why=$2; shift 2
    say "== $name: skipped: $why"
    record "$name" skipped 0 "" "$why" "$*"
}

# run_part NAME COMMAND...: run COMMAND under NAME's time limit, its output into the log.
run_part() {
    local name=$1; shift
    local cap floor left limit start status outcome note
    cap=$(part_field "$name" 2)
    floor=$(part_field "$name" 3)
    left=$(( TOTAL_S - REPORT_S - SECONDS - $(floors_after "$name") ))
    limit=$(( cap < left ? cap : left ))
    if (( limit < floor )); then
        skip "$name" "not enough time left (${left} s, it needs ${floor} s)" "$@"
        return 0
    fi
    say "== $name: at most ${limit} s: $*"
    start=$SECONDS
    set +e
    timeout --signal=INT --kill-after="$GRACE_S" "$(( limit - GRACE_S ))" "$@" 2>&1 | tee -a "$LOG"
    status=${PIPESTATUS[0]}
    set -e
    case $status in
        0) outcome=ok; note="" ;;
        124|137) outcome=timed_out; note="ran out of its ${limit} s and was stopped" ;;
        *) outcome=failed; note="exit status $status" ;;
    esac
    say "== $name: $outcome after $(( SECONDS - start )) s${note:+ ($note)}"
    record "$name" "$outcome" "$(( SECONDS - start ))" "$limit" "$note" "$*"
    LAST_OUTCOME=$outcome
}
LAST_OUTCOME=""

# The benchmark workload: nano-vllm's published one (bench.py's defaults, spelled out) on
# random weights of Qwen3-0.6B's shape, at the max_model_len nano-vllm's benchmark uses.
WORKLOAD=(--random-weights "$PRESET" --num-seqs 256 --min-input 100 --max-input 1024
          --min-output 100 --max-output 1024 --max-model-len 4096 --device cuda)
BATCH1=(--random-weights "$PRESET" --num-seqs 1 --min-input 128 --max-input 128
        --min-output 256 --max-output 256 --max-num-seqs 1 --max-model-len 4096 --device cuda)
# flashinfer is asked for by name, so that a failed kernel build fails the part instead of
# quietly measuring the torch backend.
BENCH=("$PYTHON" bench.py)
BENCH_GRAPHS=("${BENCH[@]}" "${WORKLOAD[@]}" --attention-backend flashinfer
              --json "$WORK/bench_graphs.json")
BENCH_EAGER=("${BENCH[@]}" "${WORKLOAD[@]}" --attention-backend flashinfer --enforce-eager
             --json "$WORK/bench_eager.json")
BENCH_TORCH=("${BENCH[@]}" "${WORKLOAD[@]}" --attention-backend torch
             --json "$WORK/bench_torch.json")
BENCH_BATCH1=("${BENCH[@]}" "${BATCH1[@]}" --attention-backend flashinfer --floor
              --json "$WORK/bench_batch1.json")
# -o addopts= drops pyproject's coverage options (pytest-cov need not be there);
# --continue-on-collection-errors keeps a test file that fails to import from stopping the rest.
PYTEST=("$PYTHON" -m pytest -m cuda -o addopts= -p no:cacheprovider -v -ra --durations=10
        --continue-on-collection-errors --junitxml "$WORK/pytest.xml" tests)
# Into a folder of its own first, renamed into place once complete, so that an interrupted
# install is never taken for a finished one.
INSTALL=("$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile
         --target "$SITE.partial")
KERNELS=("$PYTHON" -m tools.gpu_check kernels --preset "$PRESET" --out "$WORK/kernels.json")
CHECKPOINT=("$PYTHON" -m tools.gpu_check checkpoint --preset "$PRESET"
            --out "$WORK/checkpoint.json")

# Installed with --target and found through PYTHONPATH, not in a virtual environment: one
# made with --system-site-packages from a Python that is itself a virtual environment (as
# a GPU image's often is) would not see that environment's CUDA torch. PYTHONPATH comes
# before site-packages, so these wheels are the ones imported; they hold no torch.
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# flashinfer's JIT runs `ninja` from the PATH: the one beside the interpreter (a virtual
# environment's, say) comes first, even when the interpreter was named by its full path.
if python_path=$(command -v "$PYTHON"); then
    PATH="$(dirname "$python_path"):$PATH"
fi

say "nanoqwen GPU check, $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'), into $OUTDIR"
# Whether there is a GPU at all, asked of the driver first (cheaper than importing torch),
# then of torch itself once the environment part has run.
MODE=gpu
REASON=""
if (( DRY_RUN )); then
    MODE=dry-run
    REASON="--dry-run"
elif ! command -v nvidia-smi >/dev/null; then
    MODE=dry-run
    REASON="no CUDA GPU: nvidia-smi is not installed"
elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    MODE=dry-run
    REASON="no CUDA GPU: nvidia-smi lists none"
fi
if [[ $MODE == dry-run ]]; then
    say "CPU dry run: every CUDA part is skipped ($REASON)"
fi

# --- install
if [[ $MODE == dry-run ]]; then
    skip install "dry run: the wheels are for the GPU machine's Python" "${INSTALL[@]}" \
        "$WHEELS/*.whl"
elif (( ${#wheels[@]} == 0 )); then
    skip install "no wheels in $WHEELS/ (tools/gpu_wheels.sh downloads them): this Python's \
own packages are used" "${INSTALL[@]}"
elif [[ -d $SITE ]]; then
    skip install "these wheels are installed already, in $SITE" "${INSTALL[@]}" "${wheels[@]}"
else
    mkdir -p "$(dirname "$SITE")"
    rm -rf "$SITE.partial"
    run_part install "${INSTALL[@]}" "${wheels[@]}"
    if [[ $LAST_OUTCOME == ok ]]; then mv "$SITE.partial" "$SITE"; fi
fi

# --- environment; then the random weights build in the background while the kernels do
run_part environment "$PYTHON" -m tools.gpu_check environment --out "$WORK/environment.json"
if [[ $MODE == gpu ]]; then
    capability=$("$PYTHON" -m tools.gpu_check capability "$WORK/environment.json" || true)
    if [[ -z $capability ]]; then
        MODE=dry-run
        REASON="no CUDA GPU for torch (the environment part says why)"
        say "CPU dry run: every CUDA part is skipped ($REASON)"
    else
        # flashinfer compiles its kernels for this GPU's architecture alone (its default
        # too, on a machine of one kind of GPU; set here so the log shows it).
        export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-$capability}
        say "flashinfer builds for compute capability $FLASHINFER_CUDA_ARCH_LIST"
        # Its own time is recorded as it ends, apart from how long the benchmarks waited.
        {
            checkpoint_start=$(date +%s)
            status=0
            timeout 300 "${CHECKPOINT[@]}" || status=$?
            echo $(( $(date +%s) - checkpoint_start )) >"$WORK/checkpoint.seconds"
            exit $status
        } >"$WORK/checkpoint.out" 2>&1 &
        CHECKPOINT_PID=$!
    fi
fi

# --- the kernels; then the benchmarks, once the random weights are there; then the tests
if [[ $MODE == gpu ]]; then
    run_part kernels "${KERNELS[@]}"
    if [[ $LAST_OUTCOME == timed_out ]]; then
        # An interrupted build keeps only the files it finished: each flashinfer benchmark
        # would begin the rest again under its own shorter limit and be stopped too (a cold
        # H200 lost three so). The build goes on instead, in the time set aside for them;
        # they run after it in what is left.
        UNRESERVED="bench_graphs bench_eager bench_batch1"
        run_part kernels_resumed "${KERNELS[@]}"
    fi
    KERNELS_OUTCOME=$LAST_OUTCOME
    say "== checkpoint: waiting for the random weights (built in the background)"
    waited=$SECONDS
    if wait "$CHECKPOINT_PID"; then
        status=ok; note=""
    else
        status=failed; note="exit status $?"
    fi
    CHECKPOINT_PID=""
    waited=$(( SECONDS - waited ))
    built=$(cat "$WORK/checkpoint.seconds" 2>/dev/null || echo 0)
    note="${note:+$note; }built in the background, the benchmarks waited ${waited} s for it"
    tee -a "$LOG" <"$WORK/checkpoint.out"
    say "== checkpoint: $status after $built s ($note)"
    record checkpoint "$status" "$built" 300 "$note" "${CHECKPOINT[*]}"
    # Kernels that failed to build, or were still building when the time ran out, would
    # fail every flashinfer part the same way.
    if [[ $KERNELS_OUTCOME != ok ]]; then
        no_flashinfer="flashinfer's kernels failed to build (see the kernels part)"
        if [[ $KERNELS_OUTCOME == timed_out ]]; then
            no_flashinfer="flashinfer's kernels were not built in time (see the kernels parts)"
        fi
        skip bench_graphs "$no_flashinfer" "${BENCH_GRAPHS[@]}"
        skip bench_eager "$no_flashinfer" "${BENCH_EAGER[@]}"
        run_part bench_torch "${BENCH_TORCH[@]}"
        skip bench_batch1 "$no_flashinfer" "${BENCH_BATCH1[@]}"
    else
        run_part bench_graphs "${BENCH_GRAPHS[@]}"
        run_part bench_eager "${BENCH_EAGER[@]}"
        run_part bench_torch "${BENCH_TORCH[@]}"
        run_part bench_batch1 "${BENCH_BATCH1[@]}"
    fi
    run_part pytest "${PYTEST[@]}"
else
    skip kernels "dry run: needs a CUDA GPU" "${KERNELS[@]}"
    skip checkpoint "dry run: only the benchmarks need it" "${CHECKPOINT[@]}"
    skip bench_graphs "dry run: needs a CUDA GPU" "${BENCH_GRAPHS[@]}"
    skip bench_eager "dry run: needs a CUDA GPU" "${BENCH_EAGER[@]}"
    skip bench_torch "dry run: needs a CUDA GPU" "${BENCH_TORCH[@]}"
    skip bench_batch1 "dry run: needs a CUDA GPU" "${BENCH_BATCH1[@]}"
    skip pytest "dry run: needs a CUDA GPU" "${PYTEST[@]}"
fi

# --- the report: one JSON, and a summary at the end of the log
say "== report: $JSON"
set +e
"$PYTHON" -m tools.gpu_check report --work "$WORK" --out "$JSON" --mode "$MODE" \
    --dry-run-reason "$REASON" --started "$STARTED" --wall-s "$SECONDS" --deadline-s "$TOTAL_S" \
    2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
set -e
say "done in $SECONDS s: $JSON, $LOG"
exit "$status"
