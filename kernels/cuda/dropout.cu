// dropout.cu: the dropout mask and the fused dropout, from the Philox uniform of philox.cuh.
//
// CPU reference: the dropout mask of tensor/src/ops/dropout.rs (`dropout_mask`: keep where the
// f32 uniform is >= p, value 1/(1-p)) over kernels/src/rng.rs (`uniform`).
// Output buffers contiguous `[n]`, element i being stream index `start + i`.
// `keep = uniform(start + i) >= p` (p rounded to f32 by the host, as the CPU compares in f32);
// mask value `scale = 1/(1-p)` (host f64, rounded to T) or 0; the fused `dropout_apply_<t>`
// writes `x * scale` or 0 and optionally the u8 keep mask.

#include "philox.cuh"

template <typename T>
__device__ void dropout_mask_impl(T *out, i64 n, u64 seed, u64 start, float p, double scale) {
    const T s = from_double<T>(scale), z = from_double<T>(0.0);
    MG_GRID_STRIDE(i, n) { out[i] = philox_uniform(seed, start + (u64)i) >= p ? s : z; }
}

// y = x * mask value (the mask value rounded to T first, as multiplying by the CPU's mask tensor).
template <typename T>
__device__ void dropout_apply_impl(const T *x, T *y, u8 *keep_out, i64 n, u64 seed, u64 start, float p, double scale) {
    const T st = from_double<T>(scale);
    const float s = load(&st, 0);
    MG_GRID_STRIDE(i, n) {
        const bool keep = philox_uniform(seed, start + (u64)i) >= p;
        store(y, i, keep ? load(x, i) * s : 0.0f);
        if (keep_out) keep_out[i] = keep;
    }
}

#define DROPOUT_ENTRIES(sfx, T)                                                                  \
    extern "C" __global__ void dropout_mask_##sfx(T *out, i64 n, u64 seed, u64 start, float p, double scale) { \
        dropout_mask_impl<T>(out, n, seed, start, p, scale);                                     \
    }                                                                                            \
    extern "C" __global__ void dropout_apply_##sfx(const T *x, T *y, u8 *keep, i64 n, u64 seed, u64 start, float p, \
                                                   double scale) {                               \
        dropout_apply_impl<T>(x, y, keep, n, seed, start, p, scale);                             \
    }
MG_FOR_FLOAT_TYPES(DROPOUT_ENTRIES)
