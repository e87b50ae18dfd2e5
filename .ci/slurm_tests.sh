#!/usr/bin/env bash
# `meshgrad train` under `srun -n 4` on a one-node Slurm cluster set up here (as root, with
# Debian's slurmctld, slurmd, slurm-client and munge; no systemd, so the daemons are started by
# hand and stopped at the end). srun starts the tasks with PMIx (`--mpi=pmix`), so MPI_Init forms
# one world of them; `--overcommit` lets 4 tasks share the machine's 2 cores. Trains the GPT with
# dp=4 and pp=2,dp=2 and compares every logged loss with the thread backend's run (within 1e-6
# relative, .ci/compare_losses.py). Needs the `--features mpi` build of .ci/mpi_tests.sh and
# Open MPI; every step that could wait has a hard time limit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=target/release/meshgrad

DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q --no-install-recommends \
    slurmctld slurmd slurm-client munge
cargo build --release --features mpi

host=$(hostname -s)
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge
cat >/etc/slurm/slurm.conf <<EOF
ClusterName=ci
SlurmctldHost=${host}
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
NodeName=${host} CPUs=$(nproc) RealMemory=${mem} State=UNKNOWN
PartitionName=ci Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF

WORK=$(mktemp -d)
started=()
cleanup() {
    # Stops the daemons this script started (by their pids), in reverse order, and waits up to
    # 10 s for each to exit.
    for ((i = ${#started[@]} - 1; i >= 0; i--)); do
        kill "${started[i]}" 2>/dev/null || true
        for _ in $(seq 50); do
            kill -0 "${started[i]}" 2>/dev/null || break
            sleep 0.2
        done
    done
    rm -rf "${WORK}"
}
trap cleanup EXIT
if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c /usr/sbin/munged
    started+=("$(cat /run/munge/munged.pid)")
fi
if ! pgrep -x slurmctld >/dev/null; then
    slurmctld
    sleep 1
    started+=("$(cat /run/slurmctld.pid)")
fi
if ! pgrep -x slurmd >/dev/null; then
    slurmd
    sleep 1
    started+=("$(cat /run/slurmd.pid)")
fi
for _ in $(seq 60); do
    [ "$(timeout 10 sinfo -h -o %T 2>/dev/null || true)" = idle ] && break
    sleep 1
done
timeout 10 sinfo
if [ "$(timeout 10 sinfo -h -o %T 2>/dev/null || true)" != idle ]; then
    echo "FAIL: the Slurm node is not idle after 60 s"
    tail -n 20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log || true
    exit 1
fi

status=0
for layout in dp=4 pp=2,dp=2; do
    name=${layout//[=,]/_}
    timeout 300 srun -n 4 --overcommit --mpi=pmix --time=5 "${BIN}" train --layout "${layout}" \
        --steps 5 --metrics "${WORK}/srun_${name}.jsonl" --out "${WORK}/srun_${name}" \
        >"${WORK}/srun_${name}.log" 2>&1 || { cat "${WORK}/srun_${name}.log"; exit 1; }
    "${BIN}" train --layout "${layout}" --steps 5 \
        --metrics "${WORK}/thr_${name}.jsonl" --out "${WORK}/thr_${name}" >"${WORK}/thr_${name}.log" 2>&1 \
        || { cat "${WORK}/thr_${name}.log"; exit 1; }
    python3 .ci/compare_losses.py "srun -n 4 ${layout}" "${WORK}/srun_${name}.jsonl" \
        "${WORK}/thr_${name}.jsonl" || status=1
    # The task of rank 0 alone prints the run's lines.
    if [ "$(grep -c '^done: 5 steps' "${WORK}/srun_${name}.log")" != 1 ]; then
        echo "FAIL: srun ${layout}: expected one 'done' line"
        cat "${WORK}/srun_${name}.log"
        status=1
    fi
done
exit "${status}"
