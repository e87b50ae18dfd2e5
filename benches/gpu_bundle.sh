#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything a GPU session runs, into one compressed bundle
# small enough to carry to the device machine (the device tool carries at most 64 MiB, the
# working tree included):
#
#   bash benches/gpu_bundle.sh            # -> target/gpu-bundle.tar.xz
#
# The bundle holds the `meshgrad` binary built with --features cuda (and nccl when it builds),
# every meshgrad-tensor test binary built with --features cuda (their CUDA variants run on the
# GPU with MESHGRAD_REQUIRE_CUDA=1), all stripped, plus COMMIT and FEATURES. It is a .tar.xz:
# the GPU machine's Python reads xz with no extra program (tarfile), while zstd there is not
# known to exist. benches/gpu_session.sh unpacks and runs it (see benches/README.md, "GPU session"):
#
#   run(command="bash benches/gpu_session.sh", carry=["target/gpu-bundle.tar.xz"], timeout_s=480)
#
# Fails when the bundle is over 60 MiB, or the bundle and the working tree together over 63 MiB.
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
if ! git diff --quiet HEAD 2>/dev/null; then
    echo "note: the working tree has uncommitted changes; COMMIT names HEAD only" >&2
fi
rm -f target/gpu-bundle.tar.zst  # the old format: never carry a stale one
tar -C target -cf - gpu-bundle | xz -9 -T0 >target/gpu-bundle.tar.xz.tmp
mv target/gpu-bundle.tar.xz.tmp target/gpu-bundle.tar.xz
echo "unpacked: $(du -sb "$STAGE" | cut -f1) bytes in $(find "$STAGE" -type f | wc -l) files"
ls -l target/gpu-bundle.tar.xz
size=$(stat -c %s target/gpu-bundle.tar.xz)
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "bundle is $size bytes: over the 60 MiB budget (the device tool carries at most 64 MiB)" >&2
    exit 1
fi
# What else travels: tracked files and untracked files git does not ignore.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
echo "working tree that travels: $tree bytes; with the bundle: $((tree + size)) bytes (limit 64 MiB = $((64 * 1024 * 1024)))"
if [ $((tree + size)) -gt $((63 * 1024 * 1024)) ]; then
    echo "the bundle and the working tree are over 63 MiB together" >&2
    exit 1
fi
