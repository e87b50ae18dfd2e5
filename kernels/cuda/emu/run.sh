#!/usr/bin/env bash
# Runs kernels/cuda/*.cu on the CPU under the host SIMT emulation of simt.h and compares with
# naive double-precision references: attention forward/backward (t_attn.cpp: causal, key padding,
# fully masked rows, seq_k > seq_q, fused strided layouts, head dims 64 and 128); the row kernels
# layer norm, RMSNorm, softmax, cross-entropy, the reductions and log-sum-exp (t_rows.cpp); and
# one test per file for elementwise (t_elementwise.cpp: strided broadcast binary), the integer
# casts, gather, index_select, embedding, rotary, AdamW, SGD, the Philox fills and dropout
# (t_<file>.cpp). Needs g++ >= 12 (C++20 <barrier>); no CUDA. This is evidence about the
# kernels' logic, not a GPU test.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$(mktemp -d)}"
mkdir -p "${out}"
gen() { # gen OUTPUT FILES...: simt.h + common.cuh (without the CUDA includes) + the sources
    # (shared .cuh headers listed before the .cu files that include them; their #include lines
    # are dropped, as NVRTC's source has them inlined)
    local dst="$1"
    shift
    {
        echo '#include "simt.h"'
        grep -v '#include <cuda_' "${here}/../common.cuh"
        for f in "$@"; do grep -v '^#include "' "${here}/../${f}"; done
    } >"${out}/${dst}"
}
cp "${here}/simt.h" "${out}/"
gen attention.inc attention.cu
gen rows.inc norm.cuh layer_norm.cu rms_norm.cu norm_partials.cu softmax.cu cross_entropy.cu reduce.cuh reduce.cu logsumexp.cu
for k in elementwise cast gather index_select embedding rotary adamw sgd; do
    gen "${k}.inc" "${k}.cu"
done
gen random.inc philox.cuh random.cu
gen dropout.inc philox.cuh random.cu dropout.cu
cp "${here}/check.h" "${out}/"
for t in t_attn t_rows t_elementwise t_cast t_gather t_index_select t_embedding t_rotary t_adamw t_sgd t_random t_dropout; do
    g++ -std=c++20 -O1 -g -w -pthread -fsanitize=address -I "${out}" "${here}/${t}.cpp" -o "${out}/${t}"
    "${out}/${t}"
done
