#!/usr/bin/env bash
# One GPU session in one call of the device tool: runs on the GPU machine (no Rust there) what
# benches/gpu_bundle.sh built here, within a time budget, and leaves in $OUT only what that
# tool brings back (at most 8 files of 16 MiB, names of letters, digits, '.', '_' and '-', plus
# the last 12,000 characters printed):
#
#   $OUT/summary.txt           the summary printed last (also rewritten after every step, so a
#                              call cut off by the tool still brings back how far it got)
#   $OUT/session-logs.tar.gz   every step's log (each capped to LOG_CAP bytes: head and tail),
#                              the training runs' metrics (.jsonl), steps.tsv, env.txt, summary
#                              (also refreshed after every step)
#
# Everything else (the unpacked bundle, full logs, training runs with their checkpoints) lives in
# a fresh work folder outside $OUT (mktemp -d under WORK_PARENT, default /tmp) and is not sent;
# the unpacked bundle is removed at the end, the full logs and runs stay there.
# While it runs it prints one line per step ("[  12s] selftest ... FAIL rc=1 3s"); the summary is
# the last thing printed and is kept under 11,500 characters: failures first, each with its
# first error line (panic, Error:, CUDA_ERROR, FAIL...), then passes with their times and result
# line, then skipped steps, then an ONLY="..." line that re-runs exactly the failed steps.
#
# Steps, ordered by what they teach per second (cap = the most seconds a step may take):
#   nvidia-smi        nvidia-smi and nvidia-smi -L                                      cap 30
#   libs              the libraries cudarc opens (libcuda, libnvrtc, libcublas, libcublasLt,
#                     libnccl.so), cuda_bf16.h on CUDA_INCLUDE_DIRS, torch, compute-sanitizer  60
#   selftest          meshgrad selftest --device cuda with MESHGRAD_CUDA_SYNC_LAUNCHES=1 (every
#                     fused launch waits, so a kernel fault names its op)                      120
#   test-<binary>     each meshgrad-tensor test binary, only tests whose name holds TEST_FILTER
#                     (default "cuda": the CUDA variants; the CPU ones are CI's), 1 thread,
#                     all of them within TESTS_BUDGET                                    90 each
#   bench-gpt2-bf16   meshgrad bench gpt2-124m bf16 beside PyTorch eager and torch.compile     180
#   profile-gpt2-bf16 the per-op profile of that step                                          120
#   train-gpt, train-gpt-bf16, train-bert, train-bert-bf16 (and train-llama when `train --help`
#                     names llama):
#                     meshgrad train --device cuda on the built-in corpus                  90 each
#   nccl-world1       meshgrad launch --backend nccl, world size 1 (when built with nccl; the
#                     ranks compute on the CPU, their collectives run through NCCL on the GPU) 90
#   bench-gpt2-f32    the f32 bench beside PyTorch (last: the bf16 one is the headline)        180
#   sanitize-<binary> the test binaries' CUDA tests under compute-sanitizer (memcheck)     90 each
#
# Environment:
#   BUNDLE      the bundle (default target/gpu-bundle.tar.xz; .tar.gz and .tar.zst are read too:
#               with tar, or with Python's tarfile when the compressor program is missing)
#   OUT         where the two files go (default /tmp/gpu-session-out; the device tool sets it)
#   BUDGET      seconds for the whole script, unpacking included (default 420 = 7 minutes): each
#               step is cut off with `timeout` at min(its cap, what is left less 15 s kept for
#               the archive and summary), and steps are skipped once under 5 s are left
#   ONLY        space-separated step names or globs to run (e.g. ONLY="selftest test-*"); the
#               unpacking always runs and the device name is read with nvidia-smi -L whatever
#               ONLY says. SKIP: names or globs not to run
#   STEPS       selftest loss-curve steps (default 50); BATCH: bench batch (default 8)
#   SYNC=1      MESHGRAD_CUDA_SYNC_LAUNCHES=1 for every step, not only selftest
#   SANITIZER   end (default): the sanitize-* steps run last, in whatever budget is left;
#               first: right after the plain test runs; 0: never
#   TEST_FILTER libtest filters for the test binaries (default cuda; several words are several
#               filters, a test runs if its name holds any; empty runs every test)
#   TESTS_BUDGET seconds for all test-* steps together (default 120; each binary is also capped
#               at 90 s): the binaries left when it is spent are skipped, so the bench still runs
#   LOG_CAP     bytes of each log kept in the archive (default 1048576: first 256 KiB, last rest)
#   WORK_PARENT where the fresh work folder is made (default /tmp)
# Exit status: 0 when no step failed, 1 when one did, 2 when the bundle could not be unpacked.
#
#   run(command="bash benches/gpu_session.sh", carry=["target/gpu-bundle.tar.xz"], timeout_s=480)
#   run(command="ONLY='selftest test-ops_math' BUDGET=240 bash benches/gpu_session.sh", ...)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

OUT="${OUT:-/tmp/gpu-session-out}"
BUNDLE="${BUNDLE:-target/gpu-bundle.tar.xz}"
BUDGET="${BUDGET:-420}"
RESERVE=15   # seconds kept for the archive and the summary
MIN_STEP=5   # a step is not started with less than this left
LOG_CAP="${LOG_CAP:-1048576}"
TEST_FILTER="${TEST_FILTER-cuda}"
TESTS_BUDGET="${TESTS_BUDGET:-120}"
SANITIZER="${SANITIZER:-end}"
SUMMARY_MAX=11500
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

mkdir -p "$OUT"
rm -f "$OUT/summary.txt" "$OUT/session-logs.tar.gz"
WORK="$(mktemp -d "${WORK_PARENT:-/tmp}/gpu-session.XXXXXX")" || { echo "error: cannot make a work folder" >&2; exit 2; }
LOGS="$WORK/logs"    # every step's full log and the runs' metrics: archived (capped)
RUNS="$WORK/runs"    # training runs' folders (checkpoints): never archived
mkdir -p "$LOGS" "$RUNS"
echo "gpu session: work folder $WORK, OUT $OUT, BUDGET ${BUDGET}s"

declare -a NAMES=() STATES=() RCS=() SECS=() DETAILS=() SHORTS=()
DEVICE="unknown (nvidia-smi -L did not answer)"
COMMIT="unknown"
FEATURES="unknown"

# ---------------------------------------------------------------- summary and archive
first_error() { # log width -> the first error line, then a panic's message line if any
    local log="$1" w="$2" line
    # Errors first; a libtest "... FAILED" line only when no line says more; else the last line.
    line=$(grep -n -E 'panicked|Error|error|ERROR|CUDA_ERROR|NCCL WARN|Traceback|Segmentation fault|core dumped|Aborted|Killed|cannot open shared object|No such file|not found|NOT FOUND|cut off by timeout' "$log" 2>/dev/null \
        | grep -v -E '^[0-9]+:test .* \.\.\. |^[0-9]+:.* ok$' | head -n1)
    [ -z "$line" ] && line=$(grep -n -E 'FAIL' "$log" 2>/dev/null | head -n1)
    [ -z "$line" ] && line=$(grep -n -v -E '^[[:space:]]*$' "$log" 2>/dev/null | tail -n1)
    [ -z "$line" ] && { echo "(empty log)"; return; }
    local n="${line%%:*}" text="${line#*:}"
    printf '%s\n' "${text:0:$w}"
    # A Rust panic prints its location line ending in ':', then the message on the next line.
    if [[ "$text" == *panicked* && "$text" == *: ]]; then
        local next
        next=$(sed -n "$((n + 1))p" "$log")
        printf '%s\n' "${next:0:$w}"
    fi
}

result_lines() { # name log -> the line(s) that say what a passing step measured
    local name="$1" log="$2" pat
    case "$name" in
        nvidia-smi) pat='^GPU [0-9]+:' ;;
        libs) pat='^torch:' ;;
        selftest) pat='^selftest: device' ;;
        test-*|sanitize-*) pat='^test result:' ;;
        bench-*|profile-*) grep -E '^params=' "$log" 2>/dev/null | tail -n1 | cut -c1-220
                           pat='^ratio_vs_pytorch' ;;
        train-*|nccl-*) pat='done: ' ;;
        *) pat='.' ;;
    esac
    grep -E "$pat" "$log" 2>/dev/null | tail -n1 | cut -c1-220
}

write_summary() {
    local f="$WORK/summary.txt" i nfail=0 npass=0 nskip=0 failed=""
    for i in "${!NAMES[@]}"; do
        case "${STATES[$i]}" in
            FAIL) nfail=$((nfail + 1)); [ "${NAMES[$i]}" = unpack ] || failed+="${NAMES[$i]} " ;;
            pass) npass=$((npass + 1)) ;;
            *) nskip=$((nskip + 1)) ;;
        esac
    done
    {
        echo "== GPU session summary =="
        echo "bundle: commit $COMMIT, features $FEATURES"
        echo "device: $DEVICE"
        echo "started $STARTED, used ${SECONDS}s of BUDGET=${BUDGET}s; steps: ${nfail} failed, ${npass} passed, ${nskip} skipped"
        echo "knobs: STEPS=${STEPS:-50} BATCH=${BATCH:-8} SYNC=${SYNC:-0} SANITIZER=$SANITIZER TEST_FILTER='$TEST_FILTER' TESTS_BUDGET=$TESTS_BUDGET ONLY='${ONLY:-}' SKIP='${SKIP:-}'"
        if [ "$nfail" -gt 0 ]; then
            echo "-- failed (rc, seconds, first error line; rc=124/137: cut off by timeout)"
            # Many failures (a GPU that is not there): one line each, so the passes still fit.
            for i in "${!NAMES[@]}"; do
                [ "${STATES[$i]}" = FAIL ] || continue
                printf '%-26s rc=%-3s %4ss\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
                if [ "$nfail" -gt 12 ]; then
                    printf '    %s\n' "${SHORTS[$i]}"
                else
                    printf '%s\n' "${DETAILS[$i]}"
                fi
            done
        fi
        if [ "$npass" -gt 0 ]; then
            echo "-- passed (seconds, result line)"
            for i in "${!NAMES[@]}"; do
                [ "${STATES[$i]}" = pass ] || continue
                printf '%-26s %4ss\n' "${NAMES[$i]}" "${SECS[$i]}"
                [ -n "${DETAILS[$i]}" ] && printf '%s\n' "${DETAILS[$i]}"
            done
        fi
        if [ "$nskip" -gt 0 ]; then
            echo "-- skipped"
            local unsel=""
            for i in "${!NAMES[@]}"; do
                case "${STATES[$i]}" in
                    FAIL|pass) ;;
                    "not selected"*) unsel+="${NAMES[$i]} " ;;
                    *) printf '%-26s %s\n' "${NAMES[$i]}" "${STATES[$i]}" ;;
                esac
            done
            [ -n "$unsel" ] && echo "not selected (ONLY/SKIP): ${unsel% }" | fold -s -w 160
        fi
        [ -n "$failed" ] && echo "re-run the failed steps: ONLY='${failed% }'"
        echo "logs: session-logs.tar.gz in OUT (every log, capped at LOG_CAP=${LOG_CAP} bytes or less to fit; steps.tsv, env.txt)"
    } >"$f.full"
    # Never more than SUMMARY_MAX characters: what the tool returns is the output's last 12,000.
    if [ "$(wc -c <"$f.full")" -gt "$SUMMARY_MAX" ]; then
        { head -c $((SUMMARY_MAX - 200)) "$f.full"; printf '\n... summary cut at %s characters (the archive holds every log)\n' "$SUMMARY_MAX"; } >"$f"
    else
        cp "$f.full" "$f"
    fi
    rm -f "$f.full"
    cp "$f" "$OUT/summary.txt"
}

write_archive() { # capped copies of the logs + metrics, steps.tsv, env.txt, summary -> $OUT
    local pack="$WORK/pack/gpu-session-logs" cap="$LOG_CAP" try f size
    for try in 1 2 3; do
        rm -rf "$WORK/pack" && mkdir -p "$pack"
        for f in "$LOGS"/*; do
            [ -f "$f" ] || continue
            size=$(stat -c %s "$f")
            if [ "$size" -gt "$cap" ]; then
                { head -c $((cap / 4)) "$f"
                  printf '\n\n[... %s bytes of %s left out: LOG_CAP=%s keeps the first quarter and the end ...]\n\n' \
                      "$((size - cap))" "$size" "$cap"
                  tail -c $((cap - cap / 4)) "$f"; } >"$pack/$(basename "$f")"
            else
                cp "$f" "$pack/"
            fi
        done
        for i in "${!NAMES[@]}"; do
            printf '%s\t%s\t%s\t%s\n' "${NAMES[$i]}" "${STATES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
        done >"$pack/steps.tsv"
        cp "$WORK/summary.txt" "$pack/" 2>/dev/null
        cp "$WORK/env.txt" "$pack/" 2>/dev/null
        tar -C "$WORK/pack" -czf "$WORK/session-logs.tar.gz" gpu-session-logs || return 1
        size=$(stat -c %s "$WORK/session-logs.tar.gz")
        # The tool brings back files of at most 16 MiB: shrink the caps until it fits.
        [ "$size" -le $((15 * 1024 * 1024)) ] && break
        cap=$((cap / 4))
    done
    cp "$WORK/session-logs.tar.gz" "$OUT/session-logs.tar.gz"
}

details() { # name state rc -> the summary's lines for that step (read once, from its log)
    local name="$1" state="$2" rc="$3" log="$LOGS/$1.log"
    if [ "$state" = FAIL ]; then
        first_error "$log" 200
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            # Where it was when cut off: the last line before the marker.
            local last
            last=$(grep -v -E '^[[:space:]]*$|^\[cut off by timeout' "$log" | tail -n1)
            [ -n "$last" ] && printf 'last line: %s\n' "${last:0:180}"
        fi
        # libtest: the first failing test's name and the counts.
        grep -m1 -E '^test .* \.\.\. FAILED$' "$log" 2>/dev/null | cut -c1-120 | sed 's/^/first failed: /'
        grep -m1 '^test result:' "$log" 2>/dev/null | cut -c1-120
    elif [ "$state" = pass ]; then
        result_lines "$name" "$log"
    fi
}

record() { # name state rc seconds: a step that ran (or the unpacking); summary and archive refreshed
    NAMES+=("$1"); STATES+=("$2"); RCS+=("$3"); SECS+=("$4")
    DETAILS+=("$(details "$1" "$2" "$3" | sed 's/^/    /')")
    # One line for the compact summary: a panic's location and message joined, no thread name.
    if [ "$2" = FAIL ]; then
        SHORTS+=("$(first_error "$LOGS/$1.log" 300 | head -n2 | tr '\n' ' ' \
            | sed -e 's/^thread .* panicked at /panicked at /' -e 's/ *$//' | cut -c1-150)")
    else
        SHORTS+=("")
    fi
    write_summary
    write_archive
}

note() { # name state: a step that did not run (no log; the summary is refreshed at the end)
    NAMES+=("$1"); STATES+=("$2"); RCS+=("-"); SECS+=(0); DETAILS+=(""); SHORTS+=("")
}

selected() { # name -> whether ONLY/SKIP let it run
    local name="$1" p
    if [ -n "${ONLY:-}" ]; then
        local hit=0
        for p in $ONLY; do
            # shellcheck disable=SC2053 # globs on purpose
            [[ "$name" == $p ]] && hit=1
        done
        [ "$hit" = 1 ] || return 1
    fi
    for p in ${SKIP:-}; do
        # shellcheck disable=SC2053
        [[ "$name" == $p ]] && return 1
    done
    return 0
}

step() { # name cap command...
    local name="$1" cap="$2"; shift 2
    if ! selected "$name"; then
        note "$name" "not selected (ONLY/SKIP)"
        return
    fi
    local left=$((BUDGET - RESERVE - SECONDS))
    if [ "$left" -lt "$MIN_STEP" ]; then
        printf '[%4ss] %-26s skipped: time budget\n' "$SECONDS" "$name"
        note "$name" "skipped (time budget)"
        return
    fi
    local lim=$((cap < left ? cap : left)) t0=$SECONDS rc
    printf '[%4ss] %-26s ' "$SECONDS" "$name"
    # timeout makes its own process group and signals all of it (a launch's ranks, the PyTorch
    # child), then kills it 5 s later if it is still there.
    timeout -k 5 "$lim" "$@" >"$LOGS/$name.log" 2>&1 </dev/null
    rc=$?
    local dt=$((SECONDS - t0))
    if [ "$rc" = 0 ]; then
        echo "pass ${dt}s"
        record "$name" pass 0 "$dt"
    else
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
            echo "[cut off by timeout after ${lim}s]" >>"$LOGS/$name.log"
        fi
        echo "FAIL rc=$rc ${dt}s"
        record "$name" FAIL "$rc" "$dt"
    fi
}

finish() {
    write_summary
    write_archive
    rm -rf "$B"  # the unpacked bundle (60 MB); the work folder keeps the full logs and the runs
    echo
    cat "$WORK/summary.txt"
    local f
    for f in "${STATES[@]}"; do [ "$f" = FAIL ] && exit 1; done
    exit 0
}

# ---------------------------------------------------------------- unpack the bundle
unpack() { # archive dir
    local a="$1" d="$2"
    case "$a" in
        *.tar.xz) if command -v xz >/dev/null; then tar -C "$d" -xJf "$a"; return; fi ;;
        *.tar.gz|*.tgz) if command -v gzip >/dev/null; then tar -C "$d" -xzf "$a"; return; fi ;;
        *.tar.zst)
            if command -v zstd >/dev/null; then zstd -q -d -c "$a" | tar -C "$d" -xf -; return; fi
            echo "error: $a needs zstd, which this machine lacks (build a .tar.xz bundle)" >&2
            return 1 ;;
    esac
    # No compressor program: Python's tarfile reads xz, gz and bz2 by itself.
    python3 -c '
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    if hasattr(tarfile, "data_filter"):
        t.extractall(sys.argv[2], filter="data")
    else:
        t.extractall(sys.argv[2])' "$a" "$d"
}

t0=$SECONDS
if [ ! -f "$BUNDLE" ]; then
    echo "error: no bundle $BUNDLE: build it with benches/gpu_bundle.sh and carry it" >"$LOGS/unpack.log"
    rc=2
else
    unpack "$BUNDLE" "$WORK" >"$LOGS/unpack.log" 2>&1
    rc=$?
fi
B="$WORK/gpu-bundle"
if [ "$rc" != 0 ] || [ ! -x "$B/meshgrad" ]; then
    [ "$rc" = 0 ] && { echo "error: $BUNDLE holds no gpu-bundle/meshgrad" >>"$LOGS/unpack.log"; rc=2; }
    printf '[%4ss] %-26s FAIL rc=%s\n' "$SECONDS" unpack "$rc"
    record unpack FAIL "$rc" $((SECONDS - t0))
    echo; cat "$WORK/summary.txt"
    exit 2
fi
COMMIT="$(cat "$B/COMMIT" 2>/dev/null || echo unknown)"
FEATURES="$(cat "$B/FEATURES" 2>/dev/null || echo unknown)"
echo "unpacked $BUNDLE: $(du -sh "$B" | cut -f1), commit $COMMIT, features $FEATURES" >>"$LOGS/unpack.log"
printf '[%4ss] %-26s pass %ss\n' "$SECONDS" unpack "$((SECONDS - t0))"
record unpack pass 0 $((SECONDS - t0))

# ---------------------------------------------------------------- environment
SP=$(timeout 30 python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)
if [ -n "$SP" ] && [ -e "$SP/nvidia/nccl/lib/libnccl.so.2" ]; then
    # cudarc opens libnccl.so (never .so.2): a link of that name on LD_LIBRARY_PATH.
    mkdir -p "$WORK/ncclshim" && ln -sf "$SP/nvidia/nccl/lib/libnccl.so.2" "$WORK/ncclshim/libnccl.so"
fi
export LD_LIBRARY_PATH="$WORK/ncclshim:${SP:+$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_INCLUDE_DIRS="${CUDA_INCLUDE_DIRS:-/usr/local/cuda/include:/usr/local/cuda/include/cccl}"
export MESHGRAD_REQUIRE_CUDA=1
[ "${SYNC:-0}" = 1 ] && export MESHGRAD_CUDA_SYNC_LAUNCHES=1
export RUST_BACKTRACE=1
{
    echo "started: $STARTED"
    echo "uname: $(uname -a)"
    echo "cpus: $(nproc)"
    echo "python packages folder: ${SP:-not found}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "CUDA_INCLUDE_DIRS=$CUDA_INCLUDE_DIRS"
    echo "bundle: $BUNDLE commit $COMMIT features $FEATURES"
    ls -l "$B" "$B/tests"
} >"$WORK/env.txt" 2>&1
if command -v nvidia-smi >/dev/null; then
    DEVICE="$(timeout 10 nvidia-smi -L 2>&1 | head -n 2 | tr '\n' ' ' | cut -c1-200 | sed 's/ *$//')"
else
    DEVICE="none: nvidia-smi not found"
fi

# The libraries as cudarc looks for them (lib<name>.so, .so.13, .so.12 ... .so.1, on the
# dynamic loader's path), the NVRTC header, PyTorch and compute-sanitizer.
LIBS_PY='
import ctypes, os, sys
bad = []
libs = ["cuda", "nvrtc", "cublas", "cublasLt"] + (["nccl"] if "nccl" in sys.argv[1] else [])
for lib in libs:
    names = ["lib%s.so%s" % (lib, s) for s in ["", ".13", ".12", ".11", ".10", ".9", ".1"]]
    for n in names:
        try:
            ctypes.CDLL(n)
        except OSError:
            continue
        path = next((l.split()[-1] for l in open("/proc/self/maps") if ("/lib%s.so" % lib) in l), "?")
        print("%s: %s -> %s" % (lib, n, path))
        break
    else:
        bad.append(lib)
        print("%s: NOT FOUND (tried %s)" % (lib, " ".join(names)))
dirs = [d for d in os.environ.get("CUDA_INCLUDE_DIRS", "").split(":") if d]
hdr = [d for d in dirs if os.path.exists(os.path.join(d, "cuda_bf16.h"))]
print("cuda_bf16.h: %s" % (hdr[0] if hdr else "NOT FOUND in " + ":".join(dirs)))
if not hdr:
    bad.append("cuda_bf16.h")
try:
    import torch
    print("torch: %s, cuda %s, available %s" % (torch.__version__, torch.version.cuda, torch.cuda.is_available()))
except Exception as e:
    print("torch: import failed: %r" % e)
if bad:
    sys.exit("error: missing %s" % ", ".join(bad))
'

# ---------------------------------------------------------------- the steps
TESTS=()
for t in "$B"/tests/*; do [ -x "$t" ] && TESTS+=("$t"); done
# shellcheck disable=SC2206 # an empty TEST_FILTER passes no filter
FILTER_ARGS=($TEST_FILTER)
sanitize_steps() {
    local t name
    for t in "${TESTS[@]}"; do
        name="sanitize-$(basename "$t")"
        # A binary none of whose tests match makes no CUDA call, which compute-sanitizer
        # reports as an error ("terminated before first instrumented API call").
        if selected "$name" && [ $((BUDGET - RESERVE - SECONDS)) -ge "$MIN_STEP" ] \
            && ! "$t" "${FILTER_ARGS[@]}" --list 2>/dev/null | grep -q ': test$'; then
            note "$name" "skipped (no test matches TEST_FILTER)"
            continue
        fi
        step "$name" 90 compute-sanitizer --tool memcheck --error-exitcode 99 \
            --print-limit 20 "$t" "${FILTER_ARGS[@]}" --test-threads 1
    done
}

step nvidia-smi 30 bash -c 'nvidia-smi && nvidia-smi -L'
step libs 60 bash -c 'python3 -c "$1" "$2"; rc=$?; echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | tail -n1)"; exit $rc' _ "$LIBS_PY" "$FEATURES"
step selftest 120 env MESHGRAD_CUDA_SYNC_LAUNCHES=1 "$B/meshgrad" selftest --device cuda --steps "${STEPS:-50}"
tests_t0=$SECONDS  # all test binaries together get TESTS_BUDGET seconds, so the bench still runs
for t in "${TESTS[@]}"; do
    name="test-$(basename "$t")"
    left=$((TESTS_BUDGET - (SECONDS - tests_t0)))
    if selected "$name" && [ "$left" -lt "$MIN_STEP" ]; then
        printf '[%4ss] %-26s skipped: TESTS_BUDGET\n' "$SECONDS" "$name"
        note "$name" "skipped (TESTS_BUDGET=${TESTS_BUDGET}s spent)"
        continue
    fi
    step "$name" $((left < 90 ? left : 90)) "$t" "${FILTER_ARGS[@]}" --test-threads 1
done
[ "$SANITIZER" = first ] && sanitize_steps
step bench-gpt2-bf16 180 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 10 --precision bf16 --pytorch
step profile-gpt2-bf16 120 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 5 --precision bf16 --profile
step train-gpt 90 "$B/meshgrad" train --device cuda --steps 50 --out "$RUNS/gpt" --metrics "$LOGS/train-gpt.metrics.jsonl"
step train-gpt-bf16 90 "$B/meshgrad" train --device cuda --precision bf16 --steps 50 --out "$RUNS/gpt-bf16" --metrics "$LOGS/train-gpt-bf16.metrics.jsonl"
step train-bert 90 "$B/meshgrad" train --model bert --device cuda --steps 20 --out "$RUNS/bert" --metrics "$LOGS/train-bert.metrics.jsonl"
step train-bert-bf16 90 "$B/meshgrad" train --model bert --device cuda --precision bf16 --steps 20 --out "$RUNS/bert-bf16" --metrics "$LOGS/train-bert-bf16.metrics.jsonl"
if timeout 10 "$B/meshgrad" train --help 2>/dev/null | grep -qi llama; then
    step train-llama 90 "$B/meshgrad" train --model llama --device cuda --steps 20 --out "$RUNS/llama" --metrics "$LOGS/train-llama.metrics.jsonl"
fi
if grep -q nccl "$B/FEATURES"; then
    # The ranks of a layout compute on the CPU; NCCL runs their collectives on cuda:LOCAL_RANK.
    step nccl-world1 90 "$B/meshgrad" launch --nproc-per-node 1 --backend nccl -- train --steps 20 --layout dp=1 --out "$RUNS/nccl"
fi
step bench-gpt2-f32 180 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 10 --pytorch
[ "$SANITIZER" = end ] && sanitize_steps
finish
