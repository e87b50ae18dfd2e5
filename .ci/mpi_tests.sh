#!/usr/bin/env bash
# The MPI backend on real processes (needs Open MPI, gcc and libclang: see .ci/run and README.md):
# builds with `--features mpi`, runs the MPI test binary under `mpirun -np 4` (every collective on
# 4 ranks and on sub-groups, p2p, bf16/f16 sums), checks that a panicking rank aborts the job, and
# trains the GPT under `mpirun -np 4` with dp=4, fsdp=4 and dp=2,tp=2, comparing every logged loss
# with the thread backend's run of the same layout (relative difference at most 1e-6: MPI's
# reduction order differs from the in-process backend's rank order, so bits may differ).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v ssh >/dev/null 2>&1 || export OMPI_MCA_plm=isolated
MPIRUN=(mpirun --timeout 300 -np 4)

cargo build --release --features mpi
TEST_BIN=$(cargo test --release -p meshgrad-parallel --features mpi --test mpi --no-run \
    --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "mpi":
        print(m["executable"])')
echo "MPI test binary: ${TEST_BIN}"
"${MPIRUN[@]}" "${TEST_BIN}"

echo "a panicking rank must end the job with a non-zero status"
start=$(date +%s)
if MESHGRAD_MPI_TEST_PANIC=2 "${MPIRUN[@]}" "${TEST_BIN}" >/tmp/meshgrad-mpi-panic.log 2>&1; then
    echo "FAIL: the job with a panicking rank exited 0"
    exit 1
fi
echo "ok: non-zero exit after $(( $(date +%s) - start )) s"

# The watchdog: rank 3 stops calling collectives (2 s timeout); the waiting ranks must fail naming
# it and the call, and the job must end with a non-zero status well before mpirun's timeout.
echo "a stalled rank must be named by the watchdog of every waiting rank"
start=$(date +%s)
if MESHGRAD_MPI_TEST_STALL=3 "${MPIRUN[@]}" "${TEST_BIN}" >/tmp/meshgrad-mpi-stall.log 2>&1; then
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
if MESHGRAD_MPI_TEST_STALL_GROUP=3 "${MPIRUN[@]}" "${TEST_BIN}" >/tmp/meshgrad-mpi-stall-group.log 2>&1; then
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

WORK=$(mktemp -d)
trap 'rm -rf "${WORK}"' EXIT
status=0
for layout in dp=4 fsdp=4 dp=2,tp=2; do
    name=${layout//[=,]/_}
    "${MPIRUN[@]}" target/release/meshgrad train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/mpi_${name}.jsonl" --out "${WORK}/mpi_${name}" >"${WORK}/mpi_${name}.log" 2>&1 \
        || { cat "${WORK}/mpi_${name}.log"; exit 1; }
    target/release/meshgrad train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/thr_${name}.jsonl" --out "${WORK}/thr_${name}" >"${WORK}/thr_${name}.log" 2>&1 \
        || { cat "${WORK}/thr_${name}.log"; exit 1; }
    python3 - "${layout}" "${WORK}/mpi_${name}.jsonl" "${WORK}/thr_${name}.jsonl" <<'PY' || status=1
import json, sys
layout, a, b = sys.argv[1:]
def losses(p):
    out = []
    for line in open(p):
        r = json.loads(line)
        for k in ("loss", "val_loss"):
            if k in r:
                out.append((k, r.get("step"), float(r[k])))
    return out
x, y = losses(a), losses(b)
if not x or [k[:2] for k in x] != [k[:2] for k in y]:
    sys.exit(f"{layout}: the runs logged different steps: {x} vs {y}")
worst = max(abs(u[2] - v[2]) / max(abs(v[2]), 1e-30) for u, v in zip(x, y))
bits = all(u[2] == v[2] for u, v in zip(x, y))
print(f"{layout}: {len(x)} losses, max relative difference {worst:.2e}" + (" (bit for bit)" if bits else ""))
if worst > 1e-6:
    sys.exit(f"{layout}: MPI and thread losses differ by {worst:.2e} > 1e-6")
PY
done
exit "${status}"
