#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything a GPU session runs, into one compressed bundle
# small enough to carry to the device machine (the device tool carries at most 64 MiB):
#
#   bash benches/gpu_bundle.sh            # -> target/gpu-bundle.tar.zst
#
# The bundle holds the `meshgrad` binary built with --features cuda (and nccl when it builds),
# every meshgrad-tensor test binary built with --features cuda (their CUDA variants run on the
# GPU with MESHGRAD_REQUIRE_CUDA=1), all stripped. benches/gpu_session.sh unpacks and runs it:
#
#   run(command="bash benches/gpu_session.sh", carry=["target/gpu-bundle.tar.zst"])
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
FEATURES="cuda"
if cargo build --release --quiet --features nccl --bin meshgrad 2>/dev/null; then
    FEATURES="cuda,nccl"
fi
echo "== cargo build --release --features $FEATURES (meshgrad) =="
cargo build --release --quiet --features "$FEATURES" --bin meshgrad
echo "== cargo test --release --features cuda -p meshgrad-tensor --no-run =="
tests_json="$(cargo test --release --quiet --features cuda -p meshgrad-tensor --no-run --message-format=json 2>/dev/null)"
STAGE="target/gpu-bundle"
rm -rf "$STAGE" && mkdir -p "$STAGE/tests"
cp target/release/meshgrad "$STAGE/meshgrad"
echo "$tests_json" | python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        name = m["target"]["name"] + ("-lib" if m["target"]["kind"] == ["lib"] else "")
        shutil.copy(m["executable"], os.path.join(sys.argv[1], name))
' "$STAGE/tests"
strip "$STAGE/meshgrad" "$STAGE"/tests/*
echo "$FEATURES" > "$STAGE/FEATURES"
git rev-parse HEAD > "$STAGE/COMMIT"
tar -C target -cf - gpu-bundle | zstd -q -19 -T0 -f -o target/gpu-bundle.tar.zst
ls -l target/gpu-bundle.tar.zst
size=$(stat -c %s target/gpu-bundle.tar.zst)
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "bundle is $size bytes: over the 60 MiB budget (the device tool carries at most 64 MiB)" >&2
    exit 1
fi
