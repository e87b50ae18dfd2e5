#!/usr/bin/env bash
# Side-by-side CPU training-step benchmark: meshgrad vs PyTorch, run alternately.
#
#   bash benches/compare_pytorch.sh [ROUNDS] [MODELS...]
#   e.g. bash benches/compare_pytorch.sh 3 tiny-gpt small-gpt   (the default)
#
# Environment: STEPS (timed steps per run, default 10), THREADS (default 2), AVX512 (0 skips the
# opt-in avx512 build, which otherwise runs too when rustc >= 1.89 and the CPU has AVX-512),
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
# The opt-in `avx512` feature (gemm's AVX-512 micro-kernels) needs Rust 1.89+; when the toolchain
# has it, that build runs too, as "meshgrad-avx512", in its own target directory.
PROGRAMS="meshgrad pytorch"
RUSTC_MINOR="$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')"
if [ "${AVX512:-1}" != 0 ] && [ "$RUSTC_MINOR" -ge 89 ] && grep -q avx512f /proc/cpuinfo; then
    (cd "$ROOT" && CARGO_TARGET_DIR="$TARGET-avx512" cargo build --release --quiet --bin meshgrad --features avx512)
    MESHGRAD_AVX512="$TARGET-avx512/release/meshgrad"
    PROGRAMS="meshgrad pytorch meshgrad-avx512"
fi

echo "== machine: $(nproc) cores; $(uptime) =="
RESULTS="$(mktemp)"
for model in "${MODELS[@]}"; do
    for round in $(seq 1 "$ROUNDS"); do
        # Rotate which program goes first, so none always runs on the warmer machine.
        order="$(echo $PROGRAMS | tr ' ' '\n' | awk -v r="$round" '{a[NR]=$0} END {for (i=0;i<NR;i++) print a[(i+r-1)%NR+1]}')"
        for who in $order; do
            case "$who" in
                meshgrad) line="$("$MESHGRAD" bench --model "$model" --steps "$STEPS" --threads "$THREADS" | tail -n 1)" ;;
                meshgrad-avx512) line="$("$MESHGRAD_AVX512" bench --model "$model" --steps "$STEPS" --threads "$THREADS" | tail -n 1)" ;;
                *) line="$("$VENV/bin/python" "$ROOT/benches/pytorch_gpt.py" --model "$model" --steps "$STEPS" --threads "$THREADS" | tail -n 1)" ;;
            esac
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
print("== summary (tokens/s; ratio = meshgrad / pytorch of the same round) ==")
for model, rounds in rows.items():
    names = [w for w in ("meshgrad", "meshgrad-avx512") if all(w in r for r in rounds.values())]
    pt = [rounds[r]["pytorch"] for r in sorted(rounds)]
    for rnd in sorted(rounds):
        r = rounds[rnd]
        parts = "  ".join(f"{w} {r[w]:.0f} (x{r[w] / r['pytorch']:.3f})" for w in names)
        print(f"{model} round {rnd}: pytorch {r['pytorch']:.0f}  {parts}")
    for w in names:
        mg = [rounds[r][w] for r in sorted(rounds)]
        ratios = [rounds[r][w] / rounds[r]["pytorch"] for r in sorted(rounds)]
        print(f"{model}: {w}: median {statistics.median(mg):.0f} tok/s vs pytorch median "
              f"{statistics.median(pt):.0f} tok/s; median ratio {statistics.median(ratios):.3f}x")
EOF
rm -f "$RESULTS"
