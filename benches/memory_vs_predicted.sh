#!/usr/bin/env bash
# The planner's memory estimate against the measured peak, per rank: for each of 57 runs (the
# default GPT under every kind of layout, recomputation, bf16, dropout, a larger vocabulary and
# long rows; Llama, BERT and a small Mixtral under theirs) it prints what `train --dry-run`
# predicts (`predicted_memory_per_rank_mib=`), what a 2-step run measures
# (`peak_memory_per_rank_mib=`, the tracking allocator's peak) and the relative error, then the
# mean and largest absolute error. Deterministic: the allocator counts bytes, no timing.
# Usage: bash benches/memory_vs_predicted.sh [OUT_DIR]. Needs a release build (`cargo build
# --release`); about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-$(mktemp -d)}
BIN=$(pwd)/target/release/meshgrad
mkdir -p "${OUT}"
errors=()
check() {
    local name=$1
    shift
    local quick=(--steps 2 --set train.sample_tokens=0 --set train.eval_batches=1)
    local predicted measured
    predicted=$("${BIN}" train "${quick[@]}" "$@" --dry-run --out "${OUT}/${name}" 2>&1 \
        | sed -n 's/^predicted_memory_per_rank_mib=//p')
    measured=$("${BIN}" train "${quick[@]}" "$@" --out "${OUT}/${name}" --overwrite \
        >"${OUT}/${name}.log" 2>&1 && sed -n 's/^peak_memory_per_rank_mib=//p' "${OUT}/${name}.log")
    if [ -z "${predicted}" ] || [ -z "${measured}" ]; then
        echo "${name} failed:"; tail -3 "${OUT}/${name}.log"; exit 1
    fi
    local err
    err=$(python3 -c "print(f'{100 * (${predicted} - ${measured}) / ${measured}:+.1f}')")
    errors+=("${err}")
    printf "%-16s %10s %10s %7s%%\n" "${name}" "${predicted}" "${measured}" "${err}"
}
printf "%-16s %10s %10s %8s\n" run predicted measured error
LONG=(--set model.n_layer=2 --set model.n_embd=64 --set model.n_head=4 --set train.batch_size=2)
check default
check L2 --set model.n_layer=2
check L8 --set model.n_layer=8
check dp2 --layout dp=2
check tp2 --layout tp=2
check tp4 --layout tp=4
check tp2sp --layout tp=2 --sequence-parallel
check fsdp4 --layout fsdp=4
check zero2_4 --layout zero2=4
check pp2 --layout pp=2 --microbatches 4
check pp2zb --layout pp=2 --schedule zb --microbatches 4
check tp2pp2 --layout tp=2,pp=2 --microbatches 4
check tp2sp_pp2 --layout tp=2,pp=2 --sequence-parallel --microbatches 4
check cp2 --layout cp=2
check cp4 --layout cp=4
check ckpt --activation-checkpointing all
check ckpt_L2 --activation-checkpointing all --set model.n_layer=2
check ckpt_L8 --activation-checkpointing all --set model.n_layer=8
check ckpt_B32 --activation-checkpointing all --set train.batch_size=32
check ckpt_V1024 --activation-checkpointing all --set model.vocab_size=1024
check bf16 --set train.precision=bf16
check V1024 --set model.vocab_size=1024
check long1024 "${LONG[@]}" --set model.block_size=1024
check long1024_cp4 "${LONG[@]}" --set model.block_size=1024 --layout cp=4
check dropout --set model.dropout=0.1
check dropout_tp2 --set model.dropout=0.1 --layout tp=2
check llama --model llama
check llama_tp2 --model llama --layout tp=2
check llama_cp2 --model llama --layout cp=2
check llama_V1024 --model llama --set model.vocab_size=1024
check llama_ckpt --model llama --activation-checkpointing all
check bert --model bert
check bert_tp2 --model bert --layout tp=2 --set model.vocab_multiple=2
check bert_ckpt --model bert --activation-checkpointing all
check bert_drop --model bert --set model.dropout=0.1
check bert_drop_tp2 --model bert --set model.dropout=0.1 --layout tp=2 --set model.vocab_multiple=2
check bert_drop_T256 --model bert --set model.dropout=0.1 --set model.block_size=256 \
    --set train.batch_size=8
MX=(--model mixtral --set model.n_layer=4 --set model.n_embd=128 --set model.n_head=4
    --set model.n_kv_head=2 --set model.intermediate_size=128 --set model.n_experts=8
    --set model.experts_per_token=2 --set model.vocab_size=1024 --set model.block_size=128
    --set train.batch_size=8)
check mx "${MX[@]}"
check mx_L2 "${MX[@]}" --set model.n_layer=2
check mx_L8 "${MX[@]}" --set model.n_layer=8
check mx_V256 "${MX[@]}" --set model.vocab_size=256
check mx_ckpt "${MX[@]}" --activation-checkpointing all
check mx_dp2 "${MX[@]}" --layout dp=2
check mx_ep2 "${MX[@]}" --layout ep=2
check mx_ep4 "${MX[@]}" --layout ep=4
check mx_dp4ep2 "${MX[@]}" --layout dp=4,ep=2
check mx_fsdp4 "${MX[@]}" --layout fsdp=4
check mx_zero2_4 "${MX[@]}" --layout zero2=4
check mx_hsdp2x2 "${MX[@]}" --layout hsdp=2x2
check mx_fsdp4ep2 "${MX[@]}" --layout fsdp=4,ep=2
check mx_zero1_4ep2 "${MX[@]}" --layout zero1=4,ep=2
check mx_zero2_4ep2 "${MX[@]}" --layout zero2=4,ep=2
check mx_fsdp8ep2 "${MX[@]}" --layout fsdp=8,ep=2
check mx_cp2 "${MX[@]}" --layout cp=2
check mx_tp2 "${MX[@]}" --layout tp=2
check mx_tp2sp "${MX[@]}" --layout tp=2 --sequence-parallel
check mx_pp2 "${MX[@]}" --layout pp=2 --microbatches 4
python3 -c "
import sys
e = [abs(float(x)) for x in sys.argv[1:]]
print(f'memory_vs_predicted: runs={len(e)} mean_abs_error={sum(e) / len(e):.1f}% '
      f'max_abs_error={max(e):.1f}% over_10_percent={sum(x > 10 for x in e)}')
" "${errors[@]}"
