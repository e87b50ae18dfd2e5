#!/usr/bin/env python3
"""The planner against measurement on this machine (issue 29's CPU acceptance).

For each layout of the default GPT (`meshgrad train` with no model flags), runs
`meshgrad train --dry-run` (the planner's line for that run on the calibrated CPU) and then the
run itself, and sets side by side:

* tokens/s per device: predicted (`tokens_per_s_per_device` of the plan line) against measured
  (the median of the run's per-step `tokens_per_s` in its metrics file, over all ranks, divided by
  the layout's ranks);
* memory per rank: predicted (`predicted_memory_per_rank_mib`, the plan line's
  `memory_per_device_gib` to the MiB) against measured
  (`peak_memory_per_rank_mib`, the largest rank's peak).

Prints the table, the Spearman rank correlation of the throughputs, the median relative error of
the throughputs and the largest relative memory error. Usage, from the repository root after
`cargo build --release`:

    python3 benches/plan_vs_measured.py [--steps N] [--rounds R] [--keep-cache]
                                        [--bin target/release/meshgrad]

The CPU calibration and the per-layer profile are measured at the start, in a cache of this run
(`--keep-cache`: those in ~/.cache/meshgrad), so prediction and measurement see the same machine.
The runs go in `R` rounds (default 3), each starting one layout later; a layout's measured
throughput is the median over its rounds. Timings still depend on whatever else runs on the
machine; run it on a quiet one.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# (name, extra flags). The default batch is 16 rows; every layout of up to 4 ranks.
LAYOUTS = [
    ("single", []),
    ("dp=2", ["--layout", "dp=2"]),
    ("zero1=2", ["--layout", "zero1=2"]),
    ("fsdp=2", ["--layout", "fsdp=2"]),
    ("tp=2", ["--layout", "tp=2"]),
    ("tp=2 +sp", ["--layout", "tp=2", "--sequence-parallel"]),
    ("pp=2 1f1b", ["--layout", "pp=2", "--microbatches", "4"]),
    ("pp=2 zb", ["--layout", "pp=2", "--microbatches", "4", "--schedule", "zb"]),
    ("dp=4", ["--layout", "dp=4"]),
    ("dp=2,tp=2", ["--layout", "dp=2,tp=2"]),
    ("dp=2,pp=2", ["--layout", "dp=2,pp=2", "--microbatches", "2"]),
    ("tp=2,pp=2", ["--layout", "tp=2,pp=2", "--microbatches", "4"]),
]


def ranks_of(flags):
    if "--layout" not in flags:
        return 1
    spec = flags[flags.index("--layout") + 1]
    n = 1
    for part in spec.split(","):
        value = part.split("=")[1]
        for x in value.split("x"):
            n *= int(x)
    return n


def fields(line):
    return dict(kv.split("=", 1) for kv in line[len("plan: "):].split())


def run(cmd, env):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    return p.stdout


def ranks_list(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    r = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0
        i = j + 1
    return r


def spearman(a, b):
    ra, rb = ranks_list(a), ranks_list(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--bin", default="target/release/meshgrad")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--keep-cache",
        action="store_true",
        help="use the calibration and profiles cached in ~/.cache/meshgrad instead of measuring "
        "them in this run",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        if not args.keep_cache:
            # Calibrate and profile now, under the load the runs will see.
            env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        predicted = {}
        for name, flags in LAYOUTS:
            out = Path(tmp) / re.sub(r"[^a-z0-9]+", "_", name)
            base = [args.bin, "train", "--steps", str(args.steps), "--out", str(out)]
            dry = run(base + flags + ["--dry-run"], env).strip().splitlines()
            predicted[name] = (fields(dry[-1]), float(dry[-2].split("=")[1]))
        # Rounds of every layout, each round starting one layout later, so that load from other
        # processes falls on all layouts alike; a layout's figure is the median of its rounds.
        measured = {name: [] for name, _ in LAYOUTS}
        peaks = {}
        for r in range(args.rounds):
            for i in range(len(LAYOUTS)):
                name, flags = LAYOUTS[(i + r) % len(LAYOUTS)]
                out = Path(tmp) / re.sub(r"[^a-z0-9]+", "_", name)
                base = [args.bin, "train", "--steps", str(args.steps), "--out", str(out)]
                metrics = Path(tmp) / (out.name + ".jsonl")
                stdout = run(base + flags + ["--overwrite", "--metrics", str(metrics)], env)
                peak = re.search(r"peak_memory_per_rank_mib=([0-9.]+)", stdout).group(1)
                peaks[name] = max(peaks.get(name, 0.0), float(peak))
                steps = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
                # Skip the first steps (warm-up: allocator, caches).
                tps = [s["tokens_per_s"] for s in steps[2:] if "tokens_per_s" in s]
                measured[name].append(statistics.median(tps) / ranks_of(flags))
                print(f"round {r + 1}: {name:>12} {measured[name][-1]:9.1f} tok/s/dev", flush=True)
    rows = [
        (
            name,
            float(predicted[name][0]["tokens_per_s_per_device"]),
            statistics.median(measured[name]),
            predicted[name][1],
            peaks[name],
        )
        for name, _ in LAYOUTS
    ]
    print()
    print("| layout | predicted tok/s/dev | measured | error | predicted MiB/rank | measured | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    errors, mem_errors = [], []
    for name, p, m, pm, mm in rows:
        e = (p - m) / m
        me = (pm - mm) / mm
        errors.append(abs(e))
        mem_errors.append(abs(me))
        print(f"| {name} | {p:.1f} | {m:.1f} | {e:+.0%} | {pm:.1f} | {mm:.1f} | {me:+.0%} |")
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    print()
    print(
        f"spearman={rho:.3f} median_relative_error={statistics.median(errors):.3f} "
        f"max_memory_relative_error={max(mem_errors):.3f} layouts={len(rows)}"
    )


if __name__ == "__main__":
    main()
