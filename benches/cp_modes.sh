#!/usr/bin/env bash
# Context parallelism's two attentions against one device, in the same run: trains a GPT with
# long rows (block_size 1024, 2 layers, n_embd 64, batch 2) for STEPS steps (default 6) on one
# device and under cp=2 and cp=4 with the ring and with `--cp-mode allgather`, and prints each
# run's throughput (the mean tokens_per_s of its steps after the first), peak memory per rank
# and the planner's prediction, with the ratios against the single-device run.
# Usage: bash benches/cp_modes.sh [STEPS] [OUT_DIR]. Needs a release build (`cargo build --release`).
# On a CPU the ranks are threads sharing the cores: the ratios say what the modes cost in
# transfers and memory, not what they would gain on separate devices.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${1:-6}
OUT=${2:-$(mktemp -d)}
BIN=target/release/meshgrad
mkdir -p "${OUT}"
MODEL=(--set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set model.block_size=1024
       --set model.dropout=0 --set train.batch_size=2 --set train.sample_tokens=0
       --set train.eval_interval=1000 --set train.eval_batches=1 --set train.log_interval=1)
runs=(
    "single|"
    "cp2_ring|--layout cp=2"
    "cp2_allgather|--layout cp=2 --cp-mode allgather"
    "cp4_ring|--layout cp=4"
    "cp4_allgather|--layout cp=4 --cp-mode allgather"
)
printf "%-14s %12s %8s %10s %8s %12s\n" run tok/s ratio peak_MiB ratio predicted_MiB
base_tps=""
base_mem=""
for r in "${runs[@]}"; do
    name=${r%%|*}
    args=${r#*|}
    # shellcheck disable=SC2086 # the layout arguments are split into words on purpose
    "${BIN}" train --steps "${STEPS}" "${MODEL[@]}" ${args} --metrics "${OUT}/${name}.jsonl" \
        --out "${OUT}/${name}" --overwrite >"${OUT}/${name}.log" 2>&1 \
        || { echo "${name} failed:"; tail -5 "${OUT}/${name}.log"; exit 1; }
    # shellcheck disable=SC2086
    predicted=$("${BIN}" train --steps "${STEPS}" "${MODEL[@]}" ${args} --dry-run \
        --out "${OUT}/${name}_dry" 2>&1 | sed -n 's/^predicted_memory_per_rank_mib=//p')
    tps=$(python3 -c "
import json, sys
v = [json.loads(l)['tokens_per_s'] for l in open(sys.argv[1])][1:]
print(f'{sum(v) / max(len(v), 1):.1f}')" "${OUT}/${name}.jsonl")
    mem=$(sed -n 's/^peak_memory_per_rank_mib=//p' "${OUT}/${name}.log")
    base_tps=${base_tps:-$tps}
    base_mem=${base_mem:-$mem}
    printf "%-14s %12s %8s %10s %8s %12s\n" "${name}" "${tps}" \
        "$(python3 -c "print(f'{$tps / $base_tps:.2f}')")" "${mem}" \
        "$(python3 -c "print(f'{$mem / $base_mem:.2f}')")" "${predicted}"
done
echo "runs in ${OUT}"
