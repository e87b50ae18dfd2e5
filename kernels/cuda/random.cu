// random.cu: counter-based random fills (Philox4x32-10, philox.cuh): uniform, normal, randint.
//
// CPU reference: kernels/src/rng.rs (`below`, `fill_uniform`, `fill_normal`, `fill_randint`).
// Output buffers contiguous `[n]`, element i being stream index `start + i`, so shards built with
// their global `start` match the whole tensor.
// - uniform: value `low + width u` in f64 without fused multiply-add, rounded once to T: bitwise
//   the CPU's (integer ops and exact/IEEE-rounded f64).
// - normal: value `mean + std n` rounded once to T; `n` may differ from the CPU's in its last f64
//   bit (philox.cuh), so after rounding to f32/bf16/f16 the values agree except in rare rounding
//   ties. Not guaranteed bitwise.
// - randint: `x = w1 2^32 + w0`, value `low + floor(x width / 2^64)` (mulhi), i64 wrapping as the
//   CPU's i128 -> i64 cast: bitwise the CPU's.

#include "philox.cuh"

template <typename T>
__device__ void uniform_impl(T *out, i64 n, u64 seed, u64 start, double low, double width) {
    MG_GRID_STRIDE(i, n) {
        const double u = (double)philox_uniform(seed, start + (u64)i);
        out[i] = from_double<T>(__dadd_rn(low, __dmul_rn(width, u)));
    }
}

template <typename T>
__device__ void normal_impl(T *out, i64 n, u64 seed, u64 start, double mean, double std) {
    MG_GRID_STRIDE(i, n) {
        out[i] = from_double<T>(__dadd_rn(mean, __dmul_rn(std, philox_normal(seed, start + (u64)i))));
    }
}

// out[i] = low + below(seed, start + i, width), width = high - low as u64 (computed by the host).
extern "C" __global__ void randint_i64(i64 *out, i64 n, u64 seed, u64 start, i64 low, u64 width) {
    MG_GRID_STRIDE(i, n) {
        const Philox4 b = philox_block(seed, start + (u64)i);
        const u64 x = ((u64)b.w[1] << 32) | (u64)b.w[0];
        out[i] = (i64)((u64)low + __umul64hi(x, width));
    }
}

// The raw Philox words of element i (4 u32 per element): for checking against the CPU.
extern "C" __global__ void philox_words(u32 *out, i64 n, u64 seed, u64 start) {
    MG_GRID_STRIDE(i, n) {
        const Philox4 b = philox_block(seed, start + (u64)i);
        out[4 * i] = b.w[0];
        out[4 * i + 1] = b.w[1];
        out[4 * i + 2] = b.w[2];
        out[4 * i + 3] = b.w[3];
    }
}

#define RANDOM_ENTRIES(sfx, T)                                                                   \
    extern "C" __global__ void uniform_##sfx(T *out, i64 n, u64 seed, u64 start, double low, double width) { \
        uniform_impl<T>(out, n, seed, start, low, width);                                        \
    }                                                                                            \
    extern "C" __global__ void normal_##sfx(T *out, i64 n, u64 seed, u64 start, double mean, double std) { \
        normal_impl<T>(out, n, seed, start, mean, std);                                          \
    }
MG_FOR_FLOAT_TYPES(RANDOM_ENTRIES)
extern "C" __global__ void uniform_f64(double *out, i64 n, u64 seed, u64 start, double low, double width) {
    uniform_impl<double>(out, n, seed, start, low, width);
}
extern "C" __global__ void normal_f64(double *out, i64 n, u64 seed, u64 start, double mean, double std) {
    normal_impl<double>(out, n, seed, start, mean, std);
}
