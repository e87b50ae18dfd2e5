#!/usr/bin/env bash
# Side-by-side CPU training-step benchmark: meshgrad vs PyTorch, run alternately.
#
#   bash benches/compare_pytorch.sh [ROUNDS] [MODELS...]
#   e.g. bash benches/compare_pytorch.sh 3 tiny-gpt small-gpt   (the default)
#
# Environment: STEPS (timed steps per run, default 10), THREADS (default 2),
# TORCH_VERSION (default 2.11.0), VENV (default /tmp/meshgrad-torch-venv),
# CARGO_TARGET_DIR (default ./target).
#
# Installs PyTorch from PyPI into a throwaway virtualenv (once; reused while it imports). The
# PyPI wheel for Linux x86-64 is the CUDA build: libtorch.so links libtorch_cuda.so, which needs
# the CUDA runtime libraries at load time, so `pip install --no-deps torch` fails at `import torch`
# (libcudart.so.13 not found). The script therefore installs torch with its dependencies (the
# nvidia-* wheels, about 4-5 GB unpacked); they are only loaded, never used: everything runs on the
# CPU. Not part of CI. Time only on a quiet machine (check `uptime`: no build or test running).
set -euo pipefail

ROUNDS="${1:-3}"
shift || true
MODELS=("$@")
if [ ${#MODELS[@]} -eq 0 ]; then MODELS=(tiny-gpt small-gpt); fi
STEPS="${STEPS:-10}"
THREADS="${THREADS:-2}"
TORCH_VERSION="${TORCH_VERSION:-2.11.0}"
VENV="${VENV:-/tmp/meshgrad-torch-venv}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"

if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "== installing torch==$TORCH_VERSION into $VENV (PyPI) =="
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" numpy
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, '| MKL', torch.backends.mkl.is_available(), '| oneDNN', torch.backends.mkldnn.is_available())"

echo "== building meshgrad (release) =="
(cd "$ROOT" && CARGO_TARGET_DIR="$TARGET" cargo build --release --quiet --bin meshgrad)
MESHGRAD="$TARGET/release/meshgrad"

echo "== machine: $(nproc) cores; $(uptime) =="
RESULTS="$(mktemp)"
for model in "${MODELS[@]}"; do
    for round in $(seq 1 "$ROUNDS"); do
        # Alternate which program goes first, so neither always runs on the warmer machine.
        if [ $((round % 2)) -eq 1 ]; then order="meshgrad pytorch"; else order="pytorch meshgrad"; fi
        for who in $order; do
            if [ "$who" = meshgrad ]; then
                line="$("$MESHGRAD" bench --model "$model" --steps "$STEPS" --threads "$THREADS" | tail -n 1)"
            else
                line="$("$VENV/bin/python" "$ROOT/benches/pytorch_gpt.py" --model "$model" --steps "$STEPS" --threads "$THREADS" | tail -n 1)"
            fi
            echo "$model round $round $who: $line"
            echo "$model $round $who $line" >>"$RESULTS"
        done
    done
done
echo "== after: $(uptime) =="

"$VENV/bin/python" - "$RESULTS" <<'EOF'
import statistics, sys
rows = {}
for ln in open(sys.argv[1]):
    model, rnd, who, *kv = ln.split()
    d = dict(x.split("=", 1) for x in kv)
    rows.setdefault(model, {}).setdefault(int(rnd), {})[who] = float(d["tokens_per_s"])
print("== summary (tokens/s; ratio = meshgrad / pytorch, per round) ==")
for model, rounds in rows.items():
    ratios, mg, pt = [], [], []
    for rnd in sorted(rounds):
        r = rounds[rnd]
        mg.append(r["meshgrad"]); pt.append(r["pytorch"])
        ratios.append(r["meshgrad"] / r["pytorch"])
        print(f"{model} round {rnd}: meshgrad {r['meshgrad']:.0f}  pytorch {r['pytorch']:.0f}  ratio {ratios[-1]:.3f}")
    print(f"{model}: median meshgrad {statistics.median(mg):.0f} tok/s, median pytorch "
          f"{statistics.median(pt):.0f} tok/s, median ratio {statistics.median(ratios):.3f}x")
EOF
rm -f "$RESULTS"
