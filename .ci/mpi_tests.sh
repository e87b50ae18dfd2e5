#!/usr/bin/env bash
# The MPI backend on real processes (needs Open MPI, gcc and libclang: see .ci/run and README.md):
# * builds with `--features mpi`, runs the MPI test binary under `mpirun -np 4` (every collective
#   on 4 ranks and on sub-groups, p2p, bf16/f16 sums, all-to-alls with uneven splits, one of them
#   against its result written out by hand) and checks that a panicking rank aborts it;
# * the launcher's MPI failure tests (tests/cli_launch.rs built with the mpi feature): under
#   `meshgrad launch --backend mpi`, a rank killed by SIGKILL and a rank that panics, both while
#   the others wait in MPI collectives, end the job within 30 s naming the rank, no rank left;
# * trains the GPT under `mpirun -np 4` with dp=4, fsdp=4, dp=2,tp=2 and pp=2,dp=2, and under
#   `mpirun -np 2` with pp=2 and cp=2 (ring attention), and a tiny Mixtral under `mpirun -np 2`
#   with ep=2 (all-to-alls with uneven splits) and with dp=1,cp=2,ep=2 and a capacity, comparing every logged loss with the thread
#   backend's run of the same layout: relative difference at most 1e-6, because MPI chooses its own reduction order
#   (Open MPI: recursive doubling, rings...) where the in-process backend adds in rank order,
#   so sums over more than two ranks may differ in the last bits (the script says when a layout
#   is bit for bit);
# * the same through `meshgrad launch --nproc-per-node 4 --backend mpi` for dp=4 and pp=2,dp=2,
#   checking that every output line carries its rank and that rank 0 alone prints losses;
# * a rank SIGKILLed in the middle of a launched training run: the launcher exits non-zero within
#   30 s naming the rank, and none of the job's processes is left running;
# * a checkpoint saved under mpirun (fsdp=4, `--save-every`) resumes under the thread backend
#   and continues with the thread run's losses (rank 0 wrote the index, every rank its shards);
# * reference mode (`--reference`) under `mpirun -np 4` (hsdp=2x2; BERT dp=2,tp=2 with sequence
#   parallelism; GPT (with dropout) and Mixtral (with a capacity factor) dp=2,cp=2 in the folded
#   position order) and `meshgrad launch` (fsdp=4):
#   metrics and weight bytes identical to the one-device reference run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v ssh >/dev/null 2>&1 || export OMPI_MCA_plm=isolated
MPIRUN=(mpirun --timeout 300)
BIN=target/release/meshgrad

cargo build --release --features mpi
TEST_BIN=$(cargo test --release -p meshgrad-parallel --features mpi --test mpi --no-run \
    --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "mpi":
        print(m["executable"])')
echo "MPI test binary: ${TEST_BIN}"
"${MPIRUN[@]}" -np 4 "${TEST_BIN}"

echo "a panicking rank must end the job with a non-zero status"
start=$(date +%s)
if MESHGRAD_MPI_TEST_PANIC=2 "${MPIRUN[@]}" -np 4 "${TEST_BIN}" >/tmp/meshgrad-mpi-panic.log 2>&1; then
    echo "FAIL: the job with a panicking rank exited 0"
    exit 1
fi
echo "ok: non-zero exit after $(( $(date +%s) - start )) s"

# The watchdog: rank 3 stops calling collectives (2 s timeout); the waiting ranks must fail naming
# it and the call, and the job must end with a non-zero status well before mpirun's timeout.
echo "a stalled rank must be named by the watchdog of every waiting rank"
start=$(date +%s)
if MESHGRAD_MPI_TEST_STALL=3 "${MPIRUN[@]}" -np 4 "${TEST_BIN}" >/tmp/meshgrad-mpi-stall.log 2>&1; then
    echo "FAIL: the job with a stalled rank exited 0"; cat /tmp/meshgrad-mpi-stall.log; exit 1
fi
took=$(( $(date +%s) - start ))
ok=$(grep -c '^watchdog ok: rank [0-2]: ' /tmp/meshgrad-mpi-stall.log || true)
if [ "${took}" -gt 30 ] || [ "${ok}" -ne 3 ] \
    || ! grep -q 'all_reduce #1 on group \[0,1,2,3\]: ranks 2, 3 did not join within 2s' /tmp/meshgrad-mpi-stall.log \
    || ! grep -q 'recv #0 from rank 3 on group \[0,1,2,3\]: rank 3 did not send within 2s' /tmp/meshgrad-mpi-stall.log; then
    echo "FAIL: watchdog (${took} s, ${ok} of 3 ranks reported):"; cat /tmp/meshgrad-mpi-stall.log; exit 1
fi
echo "ok: 3 ranks named rank 3 and the call; non-zero exit after ${took} s"
start=$(date +%s)
if MESHGRAD_MPI_TEST_STALL_GROUP=3 "${MPIRUN[@]}" -np 4 "${TEST_BIN}" >/tmp/meshgrad-mpi-stall-group.log 2>&1; then
    echo "FAIL: the job with a rank missing from a group creation exited 0"; exit 1
fi
took=$(( $(date +%s) - start ))
ok=$(grep -c '^watchdog ok: rank [0-2]: new_group #0 on group \[0,1,2,3\]: rank 3 did not join within 2s' \
    /tmp/meshgrad-mpi-stall-group.log || true)
if [ "${took}" -gt 30 ] || [ "${ok}" -ne 3 ]; then
    echo "FAIL: group creation watchdog (${took} s, ${ok} of 3 ranks reported):"
    cat /tmp/meshgrad-mpi-stall-group.log; exit 1
fi
echo "ok: a rank missing from new_group is named by 3 ranks; non-zero exit after ${took} s"

echo "the launcher under --backend mpi: killed and panicking ranks (tests/cli_launch.rs)"
timeout 600 cargo test --release --features mpi --test cli_launch

WORK=$(mktemp -d)
trap 'rm -rf "${WORK}"' EXIT
status=0

# compare LABEL A B: every loss of metrics file A equals B's at the same step within 1e-6
# relative (B may have more steps: A resumed from a checkpoint).
compare() {
    python3 .ci/compare_losses.py "$@"
}

# The thread backend's run of LAYOUT into thr_NAME (once per layout).
thread_run() {
    local layout=$1 name=${1//[=,]/_}
    [ -f "${WORK}/thr_${name}.jsonl" ] && return 0
    "${BIN}" train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/thr_${name}.jsonl" --out "${WORK}/thr_${name}" >"${WORK}/thr_${name}.log" 2>&1 \
        || { cat "${WORK}/thr_${name}.log"; exit 1; }
}

for spec in 4:dp=4 4:fsdp=4 4:dp=2,tp=2 4:pp=2,dp=2 2:pp=2; do
    np=${spec%%:*} layout=${spec#*:}
    name=${layout//[=,]/_}
    "${MPIRUN[@]}" -np "${np}" "${BIN}" train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/mpi_${name}.jsonl" --out "${WORK}/mpi_${name}" >"${WORK}/mpi_${name}.log" 2>&1 \
        || { cat "${WORK}/mpi_${name}.log"; exit 1; }
    thread_run "${layout}"
    compare "mpirun -np ${np} ${layout}" "${WORK}/mpi_${name}.jsonl" "${WORK}/thr_${name}.jsonl" || status=1
done

# mpi_vs_threads NAME LAYOUT ARGS...: 4 steps under `mpirun -np 2` and on the thread backend, the
# same losses within 1e-6 relative.
mpi_vs_threads() {
    local name=$1 layout=$2
    shift 2
    "${MPIRUN[@]}" -np 2 "${BIN}" train --layout "${layout}" --steps 4 "$@" \
        --metrics "${WORK}/mpi_${name}.jsonl" --out "${WORK}/mpi_${name}" >"${WORK}/mpi_${name}.log" 2>&1 \
        || { cat "${WORK}/mpi_${name}.log"; exit 1; }
    "${BIN}" train --layout "${layout}" --steps 4 "$@" \
        --metrics "${WORK}/thr_${name}.jsonl" --out "${WORK}/thr_${name}" >"${WORK}/thr_${name}.log" 2>&1 \
        || { cat "${WORK}/thr_${name}.log"; exit 1; }
    compare "mpirun -np 2 ${layout} $*" "${WORK}/mpi_${name}.jsonl" "${WORK}/thr_${name}.jsonl" || status=1
}
echo "expert parallelism (all-to-alls) and context parallelism (ring attention) under mpirun"
mpi_vs_threads moe_ep_2 ep=2 --model mixtral --set model.n_layer=2 --set model.n_embd=32 \
    --set model.n_head=4 --set model.n_kv_head=2 --set model.block_size=16 \
    --set model.intermediate_size=16 --set model.n_experts=4 --set model.experts_per_token=2 \
    --set model.dropout=0 --set train.batch_size=8
mpi_vs_threads gpt_cp_2 cp=2 --set model.n_layer=2 --set model.dropout=0 --set train.batch_size=8
# A Mixtral under cp with ep over the cp pair and a capacity: the routed counts' all-reduce, the
# capacity's all-gather and the all-to-alls between the chunks' ranks.
mpi_vs_threads moe_cp_2 dp=1,cp=2,ep=2 --model mixtral --set model.n_layer=2 --set model.n_embd=32 \
    --set model.n_head=4 --set model.n_kv_head=2 --set model.block_size=16 \
    --set model.intermediate_size=16 --set model.n_experts=4 --set model.experts_per_token=2 \
    --set model.dropout=0 --set train.batch_size=8 --set model.expert_capacity_factor=0.75

echo "meshgrad launch --nproc-per-node 4 --backend mpi"
for layout in dp=4 pp=2,dp=2; do
    name=${layout//[=,]/_}
    timeout 300 "${BIN}" launch --nproc-per-node 4 --backend mpi -- train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/launch_${name}.jsonl" --out "${WORK}/launch_${name}" \
        >"${WORK}/launch_${name}.out" 2>"${WORK}/launch_${name}.err" \
        || { cat "${WORK}/launch_${name}.out" "${WORK}/launch_${name}.err"; exit 1; }
    thread_run "${layout}"
    compare "launch --backend mpi ${layout}" "${WORK}/launch_${name}.jsonl" "${WORK}/thr_${name}.jsonl" || status=1
    if grep -v '^\[rank [0-9]*\] ' "${WORK}/launch_${name}.out"; then
        echo "FAIL: launch ${layout}: stdout lines above have no rank prefix"
        status=1
    fi
    if grep -v '^\[rank 0\] ' "${WORK}/launch_${name}.out" | grep 'loss'; then
        echo "FAIL: launch ${layout}: ranks other than 0 printed losses (above)"
        status=1
    fi
    grep -q '^\[rank 0\] done: 5 steps' "${WORK}/launch_${name}.out" \
        || { echo "FAIL: launch ${layout}: no 'done' line from rank 0"; status=1; }
done

echo "a rank killed in the middle of a launched training run"
kill_out="${WORK}/kill"
"${BIN}" launch --nproc-per-node 4 --backend mpi -- train --layout dp=4 --steps 100000 \
    --out "${kill_out}" >"${WORK}/kill.out" 2>"${WORK}/kill.err" &
launcher=$!
ranks=""
for _ in $(seq 600); do
    if grep -q 'step 0: val_loss' "${WORK}/kill.out" 2>/dev/null; then
        mpirun_pid=$(pgrep -P "${launcher}" -x mpirun || true)
        ranks=$(pgrep -P "${mpirun_pid:-0}" -x meshgrad | tr '\n' ' ' || true)
        break
    fi
    sleep 0.2
done
# Rank 2's process (its rank from its environment).
victim=""
for pid in ${ranks}; do
    if tr '\0' '\n' <"/proc/${pid}/environ" | grep -qx 'OMPI_COMM_WORLD_RANK=2'; then
        victim=${pid}
    fi
done
if [ -z "${victim}" ] || [ "$(echo "${ranks}" | wc -w)" != 4 ]; then
    echo "FAIL: could not find the 4 training ranks (found: ${ranks})"
    cat "${WORK}/kill.out" "${WORK}/kill.err"
    kill "${launcher}" 2>/dev/null || true
    exit 1
fi
start=$(date +%s.%N)
kill -KILL "${victim}"
rc=0
wait "${launcher}" || rc=$?
elapsed=$(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "${start}")
last=$(tail -n 1 "${WORK}/kill.err")
echo "launcher: exit ${rc} after ${elapsed} s: ${last}"
if [ "${rc}" = 0 ] || ! python3 -c "import sys; sys.exit(float(sys.argv[1]) >= 30)" "${elapsed}" \
    || [[ "${last}" != "error: rank 2 was killed by signal 9 (SIGKILL)"* ]]; then
    echo "FAIL: the killed rank must end the launcher non-zero within 30 s, naming rank 2"
    status=1
fi
# Killed ranks may stay zombies for a moment until init reaps them; none may still run.
left=""
for _ in $(seq 50); do
    left=""
    for pid in ${ranks} ${mpirun_pid}; do
        state=$(sed 's/.*) //' "/proc/${pid}/stat" 2>/dev/null | cut -c1 || true)
        if [ -n "${state}" ] && [ "${state}" != Z ]; then left="${left} ${pid}"; fi
    done
    [ -z "${left}" ] && break
    sleep 0.2
done
if [ -n "${left}" ]; then
    echo "FAIL: processes of the killed job still run:${left}"
    status=1
else
    echo "ok: no rank or mpirun left running"
fi

echo "a checkpoint saved under mpirun resumes under the thread backend"
"${MPIRUN[@]}" -np 4 "${BIN}" train --layout fsdp=4 --steps 5 --save-every 3 \
    --metrics "${WORK}/ck_mpi.jsonl" --out "${WORK}/ck_mpi" >"${WORK}/ck_mpi.log" 2>&1 \
    || { cat "${WORK}/ck_mpi.log"; exit 1; }
compare "mpirun fsdp=4 --save-every 3" "${WORK}/ck_mpi.jsonl" "${WORK}/thr_fsdp_4.jsonl" || status=1
"${BIN}" train --layout fsdp=4 --steps 5 --resume "${WORK}/ck_mpi/checkpoints/step-000003" \
    --metrics "${WORK}/ck_thr.jsonl" --out "${WORK}/ck_thr" >"${WORK}/ck_thr.log" 2>&1 \
    || { cat "${WORK}/ck_thr.log"; exit 1; }
compare "resumed under threads from the MPI checkpoint" "${WORK}/ck_thr.jsonl" "${WORK}/thr_fsdp_4.jsonl" || status=1

echo "reference mode across processes: bit for bit with one device"
REF=(train --reference --steps 3 --set model.n_layer=2 --batch-size 8 --set train.eval_interval=2
     --set train.eval_batches=2 --set train.sample_tokens=0)
"${BIN}" "${REF[@]}" --metrics "${WORK}/ref_one.jsonl" --out "${WORK}/ref_one" >"${WORK}/ref_one.log" 2>&1 \
    || { cat "${WORK}/ref_one.log"; exit 1; }
"${MPIRUN[@]}" -np 4 "${BIN}" "${REF[@]}" --layout hsdp=2x2 --metrics "${WORK}/ref_mpi.jsonl" \
    --out "${WORK}/ref_mpi" >"${WORK}/ref_mpi.log" 2>&1 || { cat "${WORK}/ref_mpi.log"; exit 1; }
timeout 300 "${BIN}" launch --nproc-per-node 4 --backend mpi -- "${REF[@]}" --layout fsdp=4 \
    --metrics "${WORK}/ref_launch.jsonl" --out "${WORK}/ref_launch" >"${WORK}/ref_launch.log" 2>&1 \
    || { cat "${WORK}/ref_launch.log"; exit 1; }
# BERT under tensor parallelism with sequence parallelism across processes (its vocabulary padded
# to 264, so 4 reference chunks).
REFB=(train --reference --model bert --steps 3 --set model.n_layer=2 --set model.vocab_multiple=8
      --batch-size 8 --set train.eval_interval=2 --set train.eval_batches=2)
"${BIN}" "${REFB[@]}" --metrics "${WORK}/refb_one.jsonl" --out "${WORK}/refb_one" \
    >"${WORK}/refb_one.log" 2>&1 || { cat "${WORK}/refb_one.log"; exit 1; }
"${MPIRUN[@]}" -np 4 "${BIN}" "${REFB[@]}" --layout dp=2,tp=2 --sequence-parallel \
    --metrics "${WORK}/refb_mpi.jsonl" --out "${WORK}/refb_mpi" >"${WORK}/refb_mpi.log" 2>&1 \
    || { cat "${WORK}/refb_mpi.log"; exit 1; }
# GPT under context parallelism in reference mode's folded position order (dp=2,cp=2, 4
# processes), with dropout (each position's mask is its global position's).
REFC=(train --reference --set train.reference_positions=folded --steps 3 --set model.n_layer=2
      --set model.dropout=0.1 --batch-size 8 --set train.eval_interval=2 --set train.eval_batches=2
      --set train.sample_tokens=0)
"${BIN}" "${REFC[@]}" --metrics "${WORK}/refc_one.jsonl" --out "${WORK}/refc_one" \
    >"${WORK}/refc_one.log" 2>&1 || { cat "${WORK}/refc_one.log"; exit 1; }
"${MPIRUN[@]}" -np 4 "${BIN}" "${REFC[@]}" --layout dp=2,cp=2 \
    --metrics "${WORK}/refc_mpi.jsonl" --out "${WORK}/refc_mpi" >"${WORK}/refc_mpi.log" 2>&1 \
    || { cat "${WORK}/refc_mpi.log"; exit 1; }
# The Mixtral the same way (its layers once per position leaf), with a capacity factor (each
# leaf's chunks start from the copies routed before them, all-gathered over the cp group).
REFM=("${REFC[@]}" --model mixtral --set model.dropout=0 --set model.n_embd=32
      --set model.n_head=4 --set model.n_kv_head=2 --set model.block_size=16
      --set model.intermediate_size=16 --set model.n_experts=4 --set model.experts_per_token=2
      --set model.expert_capacity_factor=0.75)
"${BIN}" "${REFM[@]}" --metrics "${WORK}/refm_one.jsonl" --out "${WORK}/refm_one" \
    >"${WORK}/refm_one.log" 2>&1 || { cat "${WORK}/refm_one.log"; exit 1; }
"${MPIRUN[@]}" -np 4 "${BIN}" "${REFM[@]}" --layout dp=2,cp=2 \
    --metrics "${WORK}/refm_mpi.jsonl" --out "${WORK}/refm_mpi" >"${WORK}/refm_mpi.log" 2>&1 \
    || { cat "${WORK}/refm_mpi.log"; exit 1; }
# Whether run RUN equals run ONE bit for bit: metrics strings and weight bytes.
same_as_one() {
    local one=$1 run=$2
    if "${BIN}" compare "${WORK}/${one}.jsonl" "${WORK}/${run}.jsonl" --max-relative-difference 0 \
        && cmp -s "${WORK}/${one}/model.safetensors" "${WORK}/${run}/model.safetensors"; then
        echo "ok: ${run}: metrics and weights identical to one device"
    else
        echo "FAIL: ${run}: reference mode differs from one device"
        status=1
    fi
}
same_as_one ref_one ref_mpi
same_as_one ref_one ref_launch
same_as_one refb_one refb_mpi
same_as_one refc_one refc_mpi
same_as_one refm_one refm_mpi
exit "${status}"
