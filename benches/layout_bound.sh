#!/usr/bin/env bash
# Fast mode's own bound: trains the default GPT for STEPS steps (default 20) on one device and
# under every layout below, then `meshgrad compare`s each run's losses, gradient norms and final
# weights with the single-device run. Usage: bash benches/layout_bound.sh [STEPS] [OUT_DIR]
# Needs a release build (`cargo build --release`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
STEPS=${1:-20}
OUT=${2:-$(mktemp -d)}
BIN=target/release/meshgrad
mkdir -p "${OUT}"
runs=(
    "single|"
    "dp2|--layout dp=2"
    "dp4|--layout dp=4"
    "zero1_4|--layout zero1=4"
    "zero2_4|--layout zero2=4"
    "fsdp4|--layout fsdp=4"
    "hsdp2x2|--layout hsdp=2x2"
    "tp2|--layout tp=2"
    "tp4|--layout tp=4"
    "tp2_sp|--layout tp=2 --sequence-parallel"
    "pp2_1f1b|--layout pp=2 --schedule 1f1b --microbatches 4"
    "pp4_gpipe|--layout pp=4 --schedule gpipe --microbatches 4"
    "pp2_zb|--layout pp=2 --schedule zb --microbatches 4"
    "dp2_tp2_pp2|--layout dp=2,tp=2,pp=2 --microbatches 2"
    "fsdp2_tp2|--layout fsdp=2,tp=2"
    "mb2|--microbatches 2"
    "mb4|--microbatches 4"
)
files=()
weights=()
for r in "${runs[@]}"; do
    name=${r%%|*}
    args=${r#*|}
    # shellcheck disable=SC2086 # the layout arguments are split into words on purpose
    "${BIN}" train --steps "${STEPS}" ${args} --metrics "${OUT}/${name}.jsonl" \
        --out "${OUT}/${name}" --overwrite >"${OUT}/${name}.log" 2>&1 \
        || { echo "${name} failed:"; tail -5 "${OUT}/${name}.log"; exit 1; }
    files+=("${OUT}/${name}.jsonl")
    weights+=("${OUT}/${name}")
done
"${BIN}" compare "${files[@]}" --weights "${weights[@]}" --plot "${OUT}/curves.png"
