#!/usr/bin/env bash
# The CUDA build without a GPU: installs NVRTC 13.0 and the CUDA headers from NVIDIA's pip wheels
# (about 250 MB, no driver, no GPU), builds the workspace with `--features cuda`, lints the
# kernels crate with it, and runs kernels/tests/nvrtc_compile.rs with MESHGRAD_REQUIRE_NVRTC=1:
# every kernels/cuda/*.cu must compile for sm_80 and sm_90 (NVRTC runs ptxas for sm_*) and define
# exactly the entry points that kernels/build.rs reads from the sources (the generated SOURCES table
# of kernels/src/cuda/entries.rs); a missing NVRTC fails the test.
# Nothing here runs a kernel.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

WHEELS="${MESHGRAD_CUDA_WHEELS:-/tmp/meshgrad-cuda-wheels}"
NV="${WHEELS}/nvidia/cu13"
# Keep NVRTC at 13.0: 13.5 emits PTX 9.5, which the GPU machines' driver 580 rejects.
if [ ! -e "${NV}/lib/libnvrtc.so.13" ] || [ ! -e "${NV}/include/cuda_bf16.h" ]; then
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --no-deps --no-cache-dir \
        --target "${WHEELS}" \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
fi
export LD_LIBRARY_PATH="${NV}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
export CUDA_INCLUDE_DIRS="${NV}/include:${NV}/include/cccl"
export MESHGRAD_REQUIRE_NVRTC=1

# One feature set for every step below (`nccl` implies `cuda`), so each crate is compiled once
# and every later step reuses it.
echo "==> cargo build --workspace --release --features nccl (and so cuda)"
cargo build --workspace --release --features nccl

echo "==> cargo clippy (kernels, tensor, parallel, meshgrad) --all-targets --features nccl -- -D warnings"
cargo clippy -p meshgrad-kernels -p meshgrad-tensor -p meshgrad-parallel -p meshgrad --all-targets \
    --features meshgrad/nccl -- -D warnings

# The CUDA backend's host-side tests (launch arguments against the kernel declarations parsed from
# the sources, the cuBLASLt layout mapping against a host GEMM emulator, the caching allocator's
# bookkeeping): the library's unit tests. The device-parameterised integration tests of
# tensor/tests/ are not built here: without a GPU their CUDA variants only skip, their CPU variants
# ran in the test step, and clippy --all-targets above compiled them with the CUDA code; the GPU
# session script (benches/gpu_session.sh) runs them with MESHGRAD_REQUIRE_CUDA=1.
echo "==> cargo test -p meshgrad-tensor --features cuda --lib (host-side CUDA tests; GPU variants skip)"
cargo test --release -p meshgrad-tensor --features cuda --lib

echo "==> meshgrad selftest --device cuda in a CUDA build without a GPU: skipped with its reason, exit 0"
out=$(./target/release/meshgrad selftest --device cuda)
echo "$out"
case "$out" in "selftest: device=cuda:0 skipped: "*) ;; *) echo "unexpected selftest output"; exit 1;; esac

# The NCCL backend (compiled only: no GPU here; linted above): its host-side tests (unique-id exchange and
# message headers through the store, the type and op tables, default_backend) and the one-line
# refusal of --backend nccl without a GPU; the GPU tests skip with their reason.
echo "==> cargo test -p meshgrad-parallel --features nccl --lib comm:: and --test nccl (skips: no GPU)"
cargo test --release -p meshgrad-parallel --features nccl --lib comm::
cargo test --release -p meshgrad-parallel --features nccl --test nccl
echo "==> cargo test --features nccl --test cli_launch (--backend nccl refused in one line: no GPU)"
cargo test --release --features nccl --test cli_launch nccl

echo "==> NVRTC compile check (sm_80, sm_90), MESHGRAD_REQUIRE_NVRTC=1"
cargo test --release -p meshgrad-kernels --features cuda --test nvrtc_compile
