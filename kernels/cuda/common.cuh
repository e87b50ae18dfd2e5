// common.cuh: prepended (by kernels/src/cuda/mod.rs, followed by a `#line 1 "<file>.cu"`) to every
// kernels/cuda/*.cu source before NVRTC compiles it. Not a kernel file of its own.
//
// Conventions shared by every file:
// - Buffers are row-major and contiguous unless a kernel takes strides; sizes and indices are
//   `long long` (i64) so that buffers above 2^31 elements work.
// - Element types: `float` (suffix f32), `__nv_bfloat16` (bf16), `__half` (f16); the basic kernels
//   (elementwise maps, comparisons, reductions, gather and index_select) also `double` (f64).
//   Arithmetic on bf16/f16 data is done in f32 (`load` widens, `store` rounds to nearest even
//   once), as the CPU crate does for half-precision tensors; f64 data is computed in f64.
//   `Acc<T>::type` names that compute type (float, or double for double), and the `mg_*` math
//   helpers below pick the f32 or f64 function by overload.
// - Entry points are `extern "C" __global__ void` with explicit names `<kernel>_<dtype>`, declared
//   directly or through function-like macros (no #if/#ifdef around them): kernels/build.rs reads
//   each file's list from the source (kernels/src/cuda/parse.rs) and kernels/tests/nvrtc_compile.rs
//   checks it against the PTX.
// - Block-level reductions assume blockDim.x is a multiple of 32 and at most 1024.
// These kernels are compiled by NVRTC in CI and run on a GPU in the GPU session
// (benches/gpu_session.sh; README's Status says what ran where).

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
// f64 data stays f64.
__device__ __forceinline__ double load(const double *p, i64 i) { return p[i]; }
__device__ __forceinline__ void store(double *p, i64 i, double v) { p[i] = v; }

// The type a kernel computes in for element type T: f32, except f64 for f64.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

// Math by overload on the compute type (float: the f-suffixed functions, double: the plain ones).
__device__ __forceinline__ float mg_exp(float v) { return expf(v); }
__device__ __forceinline__ double mg_exp(double v) { return exp(v); }
__device__ __forceinline__ float mg_log(float v) { return logf(v); }
__device__ __forceinline__ double mg_log(double v) { return log(v); }
__device__ __forceinline__ float mg_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double mg_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float mg_tanh(float v) { return tanhf(v); }
__device__ __forceinline__ double mg_tanh(double v) { return tanh(v); }
__device__ __forceinline__ float mg_erf(float v) { return erff(v); }
__device__ __forceinline__ double mg_erf(double v) { return erf(v); }
__device__ __forceinline__ float mg_abs(float v) { return fabsf(v); }
__device__ __forceinline__ double mg_abs(double v) { return fabs(v); }
__device__ __forceinline__ float mg_pow(float v, float p) { return powf(v, p); }
__device__ __forceinline__ double mg_pow(double v, double p) { return pow(v, p); }
__device__ __forceinline__ float mg_sin(float v) { return sinf(v); }
__device__ __forceinline__ double mg_sin(double v) { return sin(v); }
__device__ __forceinline__ float mg_cos(float v) { return cosf(v); }
__device__ __forceinline__ double mg_cos(double v) { return cos(v); }
__device__ __forceinline__ float mg_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double mg_max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float mg_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double mg_min(double a, double b) { return fmin(a, b); }
// Addition rounded to nearest, never contracted into a fused multiply-add.
__device__ __forceinline__ float mg_add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double mg_add_rn(double a, double b) { return __dadd_rn(a, b); }
// The logistic sigmoid in f32 (an exp that overflows gives 0, as on the CPU).
__device__ __forceinline__ float sigmoidf_(float v) { return 1.0f / (1.0f + expf(-v)); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ double from_float<double>(float v) { return (double)v; }

// Round an f64 value once to the element type (as the CPU `T::from_f64` / `to_dtype` do).
template <typename T> __device__ __forceinline__ T from_double(double v);
template <> __device__ __forceinline__ double from_double<double>(double v) { return v; }
template <> __device__ __forceinline__ float from_double<float>(double v) { return __double2float_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_double<__nv_bfloat16>(double v) { return __double2bfloat16(v); }
template <> __device__ __forceinline__ __half from_double<__half>(double v) { return __double2half(v); }

// ---- grid-stride loop over [0, n) ----
#define MG_GRID_STRIDE(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// ---- warp and block reductions (blockDim.x a multiple of 32, at most 1024), in f32 or f64 ----
template <typename C> __device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename C> __device__ __forceinline__ C warp_max(C v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = mg_max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of `v` over the block, returned to every thread. `scratch` holds at least 32 values; the
// function synchronises before returning, so the same scratch can be reused by the next call.
template <typename C> __device__ __forceinline__ C block_sum(C v, C *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    C r = lane < nwarps ? scratch[lane] : (C)0;
    r = warp_sum(r);
    return r;
}
// Maximum of `v` over the block (NaN-ignoring, as fmax), returned to every thread.
template <typename C> __device__ __forceinline__ C block_max(C v, C *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    C r = lane < nwarps ? scratch[lane] : (C)MG_NEG_INF;
    r = warp_max(r);
    return r;
}

// Records the smallest bad position seen (for index validation): the launcher initialises
// `*bad` to ~0ull and, after the kernel, reports the position if it changed.
__device__ __forceinline__ void flag_bad(u64 *bad, i64 pos) {
    if (bad) atomicMin(bad, (u64)pos);
}

// Instantiation helpers: M(suffix, type) for the three floating element types computed in f32,
// and for those and f64 (the basic kernels).
#define MG_FOR_FLOAT_TYPES(M) M(f32, float) M(bf16, __nv_bfloat16) M(f16, __half)
#define MG_FOR_BASIC_TYPES(M) MG_FOR_FLOAT_TYPES(M) M(f64, double)
