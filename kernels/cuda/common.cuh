// common.cuh: prepended (by kernels/src/cuda/mod.rs, followed by a `#line 1 "<file>.cu"`) to every
// kernels/cuda/*.cu source before NVRTC compiles it. Not a kernel file of its own.
//
// Conventions shared by every file:
// - Buffers are row-major and contiguous unless a kernel takes strides; sizes and indices are
//   `long long` (i64) so that buffers above 2^31 elements work.
// - Element types: `float` (suffix f32), `__nv_bfloat16` (bf16), `__half` (f16); some kernels also
//   `double` (f64). Arithmetic on bf16/f16 data is done in f32 (`load` widens, `store` rounds to
//   nearest even once), as the CPU crate does for half-precision tensors.
// - Entry points are `extern "C" __global__ void` with explicit names `<kernel>_<dtype>`, declared
//   directly or through function-like macros (no #if/#ifdef around them): kernels/build.rs reads
//   each file's list from the source (kernels/src/cuda/parse.rs) and kernels/tests/nvrtc_compile.rs
//   checks it against the PTX.
// - Block-level reductions assume blockDim.x is a multiple of 32 and at most 1024.
// These kernels are compiled by NVRTC in CI; they have not been run on a GPU.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned char u8;

#define MG_INF __int_as_float(0x7f800000)
#define MG_NEG_INF __int_as_float(0xff800000)
#define MG_NAN __int_as_float(0x7fffffff)

// ---- loads and stores through f32 ----
__device__ __forceinline__ float load(const float *p, i64 i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float load(const __half *p, i64 i) { return __half2float(p[i]); }
__device__ __forceinline__ void store(float *p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store(__half *p, i64 i, float v) { p[i] = __float2half_rn(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Round an f64 value once to the element type (as the CPU `T::from_f64` / `to_dtype` do).
template <typename T> __device__ __forceinline__ T from_double(double v);
template <> __device__ __forceinline__ double from_double<double>(double v) { return v; }
template <> __device__ __forceinline__ float from_double<float>(double v) { return __double2float_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v) { return __double2bfloat16(v); }
template <> __device__ __forceinline__ __half from_double<__half>(double v) { return __double2half(v); }

// ---- grid-stride loop over [0, n) ----
#define MG_GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// ---- warp and block reductions (blockDim.x a multiple of 32, at most 1024) ----
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of `v` over the block, returned to every thread. `scratch` holds at least 32 floats; the
// function synchronises before returning, so the same scratch can be reused by the next call.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}
// Maximum of `v` over the block (fmaxf: NaN-ignoring), returned to every thread.
__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? scratch[lane] : MG_NEG_INF;
    r = warp_max(r);
    return r;
}

// Records the smallest bad position seen (for index validation): the launcher initialises
// `*bad` to ~0ull and, after the kernel, reports the position if it changed.
__device__ __forceinline__ void flag_bad(u64 *bad, i64 pos) {
    if (bad) atomicMin(bad, (u64)pos);
}

// Instantiation helper: M(suffix, type) for the three floating element types.
#define MG_FOR_FLOAT_TYPES(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half)
