#!/usr/bin/env bash
# Checks benches/gpu_session.sh without a GPU and without building anything: it runs the script
# against a fake bundle of stub executables (a `meshgrad` whose selftest errors, whose train
# panics, whose bf16 bench and profile pass and whose f32 bench hangs; one passing and one failing test
# binary; a stub nvidia-smi on PATH) and asserts what the device tool would bring back: exactly
# summary.txt and session-logs.tar.gz in $OUT (valid names, under 16 MiB), an archive that
# unpacks and holds every step's log but no training run, a summary printed last and under
# 11,500 characters with failures first (each with its first error line), the hung step cut off
# by timeout, later steps skipped by the budget, and nothing left running. Then ONLY= selection,
# TESTS_BUDGET and a missing bundle. About 20 s, nearly all of it the budget the hung step waits out.
#
#   bash .ci/gpu_session_check.sh
#
# Environment: KEEP=1 keeps the temporary folder (printed) for inspection.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT="$ROOT/benches/gpu_session.sh"
T="$(mktemp -d /tmp/gpu-session-check.XXXXXX)"
[ "${KEEP:-0}" = 1 ] && echo "temporary folder: $T" || trap 'rm -rf "$T"' EXIT
fails=0
check() { # description, command...
    local what="$1"; shift
    if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; fails=$((fails + 1)); fi
}

bash -n "$SCRIPT" || { echo "FAILED: bash -n $SCRIPT"; exit 1; }

# ---------------------------------------------------------------- the fake bundle
mkdir -p "$T/gpu-bundle/tests" "$T/bin"
cat >"$T/gpu-bundle/meshgrad" <<EOF
#!/usr/bin/env bash
case "\$1" in
    selftest) echo "Error: selftest: device=cuda:0: stub has no GPU (MESHGRAD_REQUIRE_CUDA=1)" >&2; exit 1 ;;
    bench)
        case " \$* " in
            *" --profile "*) echo "params=124475904 step_median_s=0.2"; exit 0 ;;
            *" bf16 "*) echo "params=124475904 step_median_s=0.1 tokens_per_s=81920 mfu=0.5"
                        echo "ratio_vs_pytorch_eager=1.10 ratio_vs_pytorch_compile=0.90"; exit 0 ;;
            *) echo "warm-up step 1 of 2"; echo \$\$ >"$T/hang.pid"; exec sleep 300 ;;  # the f32 bench hangs
        esac ;;
    train)
        [ "\$2" = --help ] && { echo "Train a GPT, or a BERT with --model bert"; exit 0; }
        mkdir -p "\$(echo "\$*" | sed 's/.*--out \([^ ]*\).*/\1/')/checkpoints"
        echo "loading"; echo "thread 'main' panicked at src/train.rs:10:5:"; echo "stub: CUDA_ERROR_NO_DEVICE"; exit 101 ;;
esac
echo "stub: unexpected \$*" >&2; exit 3
EOF
cat >"$T/gpu-bundle/tests/ops_ok" <<'EOF'
#!/usr/bin/env bash
case " $* " in *" --list "*) printf 'a::cuda: test\nb::cuda: test\n'; exit 0 ;; esac
printf 'running 2 tests\ntest a::cuda ... ok\ntest b::cuda ... ok\n\ntest result: ok. 2 passed; 0 failed; 0 ignored\n'
EOF
cat >"$T/gpu-bundle/tests/ops_bad" <<'EOF'
#!/usr/bin/env bash
case " $* " in *" --list "*) printf 'errors_are_named::cuda: test\nadd::cuda: test\n'; exit 0 ;; esac
printf 'running 2 tests\ntest errors_are_named::cuda ... ok\ntest add::cuda ... FAILED\n\nfailures:\n\n---- add::cuda stdout ----\nError: "CUDA_ERROR_ILLEGAL_ADDRESS in add"\n\nfailures:\n    add::cuda\n\ntest result: FAILED. 1 passed; 1 failed; 0 ignored\n'
exit 101
EOF
cat >"$T/bin/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
echo "GPU 0: Stub H100 (UUID: GPU-0)"
EOF
chmod +x "$T/gpu-bundle/meshgrad" "$T/gpu-bundle/tests/"* "$T/bin/nvidia-smi"
echo deadbeef >"$T/gpu-bundle/COMMIT"
echo cuda,nccl >"$T/gpu-bundle/FEATURES"
# xz through Python, as the GPU machine may read it (tar -xJf, or tarfile without xz).
python3 -c 'import sys, tarfile; t = tarfile.open(sys.argv[1], "w:xz"); t.add(sys.argv[2], "gpu-bundle"); t.close()' \
    "$T/bundle.tar.xz" "$T/gpu-bundle"

# ---------------------------------------------------------------- run 1: everything, small budget
OUT="$T/out" BUNDLE="$T/bundle.tar.xz" BUDGET=30 WORK_PARENT="$T" PATH="$T/bin:$PATH" \
    bash "$SCRIPT" >"$T/printed.txt" 2>&1
rc=$?
elapsed=$SECONDS
S="$T/out/summary.txt"
check "exit status 1 when steps fail (got $rc)" [ "$rc" = 1 ]
check "within the budget (${elapsed}s <= 33s)" [ "$elapsed" -le 33 ]
files=$(find "$T/out" -type f | wc -l)
check "OUT holds exactly 2 files (got $files)" [ "$files" = 2 ]
check "OUT holds summary.txt and session-logs.tar.gz" [ -f "$S" -a -f "$T/out/session-logs.tar.gz" ]
check "file names the device tool brings back" \
    bash -c '! find "$1" -type f -printf "%f\n" | grep -v -E "^[A-Za-z0-9._-]+$"' _ "$T/out"
check "each file under 16 MiB" bash -c '! find "$1" -type f -size +16M | grep -q .' _ "$T/out"
mkdir -p "$T/unpacked"
check "the archive unpacks" tar -C "$T/unpacked" -xzf "$T/out/session-logs.tar.gz"
A="$T/unpacked/gpu-session-logs"
for f in steps.tsv summary.txt env.txt unpack.log nvidia-smi.log libs.log selftest.log test-ops_ok.log \
    test-ops_bad.log bench-gpt2-bf16.log profile-gpt2-bf16.log train-gpt.log; do
    check "archive has $f" [ -f "$A/$f" ]
done
check "archive has no training run" bash -c '! find "$1" -name checkpoints | grep -q .' _ "$T/unpacked"
chars=$(wc -c <"$S")
check "summary under 11,500 characters (got $chars)" [ "$chars" -le 11500 ]
check "the summary is printed last" bash -c 'diff <(tail -n "$(wc -l <"$1")" "$2") "$1" >/dev/null' _ "$S" "$T/printed.txt"
tail_chars=$(awk '/^== GPU session summary ==/{f=1} f' "$T/printed.txt" | wc -c)
check "printed from the summary on: $tail_chars <= 12000 characters" [ "$tail_chars" -le 12000 ]
line_of() { grep -n -m1 -F -- "$1" "$S" | cut -d: -f1; }
check "failures before passes" [ "$(line_of '-- failed')" -lt "$(line_of '-- passed')" ]
check "device and bundle recorded" grep -q -F 'device: GPU 0: Stub H100' "$S"
check "bundle commit recorded" grep -q -F 'commit deadbeef, features cuda,nccl' "$S"
check "selftest's error line" grep -q -F 'Error: selftest: device=cuda:0: stub has no GPU' "$S"
check "the panic's location and message lines" bash -c 'grep -A1 -E "^train-gpt +rc=101" "$1" | grep -q -F "thread '"'main'"' panicked at src/train.rs:10:5:" &&
    grep -A2 -E "^train-gpt +rc=101" "$1" | grep -q -F "    stub: CUDA_ERROR_NO_DEVICE"' _ "$S"
check "the failing test's error, name and counts" bash -c 'grep -q -F "Error: \"CUDA_ERROR_ILLEGAL_ADDRESS in add\"" "$1" &&
    grep -q -F "first failed: test add::cuda ... FAILED" "$1" && grep -q -F "test result: FAILED. 1 passed; 1 failed" "$1"' _ "$S"
check "the hung f32 bench cut off (rc=124), with its last line" bash -c 'grep -A2 -E "^bench-gpt2-f32 +rc=124" "$1" | grep -q -F "    last line: warm-up step 1 of 2"' _ "$S"
check "the bench's result lines among the passes" grep -q -F 'ratio_vs_pytorch_eager=1.10' "$S"
check "later steps skipped by the budget" grep -q -E '^sanitize-ops_ok +skipped \(time budget\)' "$S"
check "the re-run line" grep -q -E "^re-run the failed steps: ONLY='libs selftest test-ops_bad train-gpt train-gpt-bf16 train-bert train-bert-bf16 nccl-world1 bench-gpt2-f32'" "$S"
check "the hung stub is gone" bash -c '! kill -0 "$(cat "$1")" 2>/dev/null' _ "$T/hang.pid"
check "the work folder holds the training run, outside OUT" bash -c 'ls -d "$1"/gpu-session.*/runs/gpt/checkpoints >/dev/null' _ "$T"

# ---------------------------------------------------------------- run 2: ONLY, a second run into the same OUT
OUT="$T/out" BUNDLE="$T/bundle.tar.xz" ONLY='selftest test-*' SANITIZER=0 WORK_PARENT="$T" PATH="$T/bin:$PATH" \
    bash "$SCRIPT" >"$T/printed2.txt" 2>&1
check "ONLY: exit status 1" [ $? = 1 ]
check "ONLY: still 2 files in OUT" [ "$(find "$T/out" -type f | wc -l)" = 2 ]
check "ONLY: ran selftest and the tests only" bash -c 'grep -q -E "^selftest +rc=1" "$1" && grep -q -E "^test-ops_ok " "$1" &&
    ! grep -q -E "^(bench|train|libs)" "$1" && grep -q "^not selected (ONLY/SKIP): nvidia-smi libs bench-gpt2-bf16" "$1"' _ "$S"

# ---------------------------------------------------------------- run 3: TESTS_BUDGET spent
OUT="$T/out4" BUNDLE="$T/bundle.tar.xz" ONLY='test-*' TESTS_BUDGET=0 WORK_PARENT="$T" PATH="$T/bin:$PATH" \
    bash "$SCRIPT" >"$T/printed4.txt" 2>&1
check "TESTS_BUDGET=0: exit status 0, the test binaries skipped" bash -c '[ "$2" = 0 ] &&
    grep -q -E "^test-ops_ok +skipped \(TESTS_BUDGET=0s spent\)" "$1"' _ "$T/out4/summary.txt" $?

# ---------------------------------------------------------------- run 4: no bundle
OUT="$T/out3" BUNDLE="$T/missing.tar.xz" WORK_PARENT="$T" bash "$SCRIPT" >"$T/printed3.txt" 2>&1
check "no bundle: exit status 2" [ $? = 2 ]
check "no bundle: the summary says so" grep -q -F 'error: no bundle' "$T/out3/summary.txt"

if [ "$fails" != 0 ]; then
    echo "--- printed by run 1:"; cat "$T/printed.txt"
    echo "$fails check(s) failed"
    exit 1
fi
echo "gpu_session.sh checks passed (${SECONDS}s)"
