#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there) what benches/gpu_bundle.sh built here, in one call:
#   1. nvidia-smi and the library paths (shared/notes/cuda.md),
#   2. meshgrad selftest --device cuda (every op against the CPU in f64, the tiny GPT's curve),
#   3. every meshgrad-tensor test binary with MESHGRAD_REQUIRE_CUDA=1 (CUDA variants must run),
#   4. meshgrad bench --device cuda --model gpt2-124m [--precision bf16] --pytorch (eager and
#      torch.compile; bf16 mixed precision, then f32), then a per-op profile of the bf16 step
#      (--profile: each op waits for the GPU, so its time is its own),
#   5. meshgrad train --device cuda on the built-in corpus: GPT in f32 and bf16, BERT (masked
#      LM) in f32,
#   6. NCCL with world size 1 through meshgrad launch (when built with nccl).
# Every step runs even if an earlier one failed; logs go to $OUT/<step>.log; a table is printed
# last. Environment: STEPS (selftest loss-curve steps, default 50), BATCH (bench, default 8),
# SKIP (space-separated step names to skip), SYNC=1 (MESHGRAD_CUDA_SYNC_LAUNCHES=1: each fused
# launch waits, so a kernel fault names its op), BUDGET (seconds, default 540: a step is cut off
# with `timeout` when the budget runs out, later steps are skipped, and the summary still prints
# inside the device tool's 600 s limit; rc=124 marks a step cut off).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/gpu-session-out}"
mkdir -p "$OUT"
BUNDLE="${BUNDLE:-target/gpu-bundle.tar.zst}"
[ -f "$BUNDLE" ] || { echo "no $BUNDLE: build it with benches/gpu_bundle.sh and carry it" >&2; exit 2; }
rm -rf target/gpu-bundle && zstd -q -d -c "$BUNDLE" | tar -C target -xf -
B="$ROOT/target/gpu-bundle"
echo "bundle: commit $(cat "$B/COMMIT"), features $(cat "$B/FEATURES")"

SP=$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null || true)
if [ -n "$SP" ] && [ -e "$SP/nvidia/nccl/lib/libnccl.so.2" ]; then
    mkdir -p /tmp/ncclshim && ln -sf "$SP/nvidia/nccl/lib/libnccl.so.2" /tmp/ncclshim/libnccl.so
fi
export LD_LIBRARY_PATH="/tmp/ncclshim:${SP:+$SP/nvidia/cu13/lib:$SP/nvidia/nccl/lib:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_INCLUDE_DIRS="/usr/local/cuda/include:/usr/local/cuda/include/cccl"
export MESHGRAD_REQUIRE_CUDA=1
[ "${SYNC:-0}" = 1 ] && export MESHGRAD_CUDA_SYNC_LAUNCHES=1

declare -a NAMES RESULTS
BUDGET="${BUDGET:-540}"
step() { # name, command...
    local name="$1"; shift
    if [[ " ${SKIP:-} " == *" $name "* ]]; then NAMES+=("$name"); RESULTS+=("skipped"); return; fi
    local left=$((BUDGET - SECONDS))
    if [ "$left" -le 5 ]; then NAMES+=("$name"); RESULTS+=("skipped (time budget)"); return; fi
    local t0=$SECONDS
    echo "== $name: $*"
    timeout "$left" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/$name.log"
    NAMES+=("$name"); RESULTS+=("rc=$rc $((SECONDS - t0))s")
}

step nvidia-smi nvidia-smi
step selftest "$B/meshgrad" selftest --device cuda --steps "${STEPS:-50}"
for t in "$B"/tests/*; do
    step "test-$(basename "$t")" "$t" --test-threads 1
done
step bench-gpt2-bf16 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 10 --precision bf16 --pytorch
step bench-gpt2-f32 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 10 --pytorch
step profile-gpt2-bf16 "$B/meshgrad" bench --device cuda --model gpt2-124m --batch "${BATCH:-8}" --steps 5 --precision bf16 --profile
step train-gpt "$B/meshgrad" train --device cuda --steps 50 --out "$OUT/run-gpt" --metrics "$OUT/run-gpt.jsonl"
step train-gpt-bf16 "$B/meshgrad" train --device cuda --precision bf16 --steps 50 --out "$OUT/run-gpt-bf16" --metrics "$OUT/run-gpt-bf16.jsonl"
step train-bert "$B/meshgrad" train --model bert --device cuda --steps 20 --out "$OUT/run-bert" --metrics "$OUT/run-bert.jsonl"
if grep -q nccl "$B/FEATURES"; then
    step nccl-world1 "$B/meshgrad" launch --nproc-per-node 1 --backend nccl -- train --device cuda --steps 20 --layout dp=1 --out "$OUT/run-nccl"
fi

echo
echo "== summary (logs in $OUT) =="
for i in "${!NAMES[@]}"; do printf '%-40s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done
