// random.cu: counter-based random fills (Philox4x32-10): uniform, normal, randint, dropout.
//
// CPU reference: kernels/src/rng.rs (`philox4x32_10`, `uniform`, `normal`, `below`,
// `fill_uniform`, `fill_normal`, `fill_randint`) and the dropout mask of
// tensor/src/ops/dropout.rs (`dropout_mask`: keep where the f32 uniform is >= p, value 1/(1-p)).
// Element `i` of a fill uses the Philox block with counter `[lo32(start+i), hi32(start+i), 0, 0]`
// and key `[lo32(seed), hi32(seed)]`, words w0..w3 (w2, w3 unused). Output buffers contiguous
// `[n]`, element i being stream index `start + i`, so shards built with their global `start`
// match the whole tensor.
// - uniform: `u = (w0 >> 8) 2^-24` (f32, exact); value `low + width u` in f64 without fused
//   multiply-add, rounded once to T: bitwise the CPU's (integer ops and exact/IEEE-rounded f64).
// - normal (f64, as the CPU): `u1 = (w0 + 1) 2^-32`, `u2 = w1 2^-32`,
//   `n = sqrt(-2 ln u1) cos(2π u2)`, value `mean + std n` rounded once to T. CUDA's double log
//   and cos are accurate to about 1 ulp but are not the CPU's libm, so `n` can differ from the
//   CPU's in its last f64 bit; after rounding to f32/bf16/f16 the values agree except in rare
//   rounding ties. Not guaranteed bitwise.
// - randint: `x = w1 2^32 + w0`, value `low + floor(x width / 2^64)` (mulhi), i64 wrapping as the
//   CPU's i128 -> i64 cast: bitwise the CPU's.
// - dropout: `keep = uniform(start + i) >= p` (p rounded to f32 by the host, as the CPU compares
//   in f32); mask value `scale = 1/(1-p)` (host f64, rounded to T) or 0; the fused
//   `dropout_apply_<t>` writes `x * scale` or 0 and optionally the u8 keep mask.

#define PH_M0 0xD2511F53u
#define PH_M1 0xCD9E8D57u
#define PH_W0 0x9E3779B9u
#define PH_W1 0xBB67AE85u

struct Philox4 {
    u32 w[4];
};

__device__ __forceinline__ Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PH_W0;
            k1 += PH_W1;
        }
        const u32 hi0 = __umulhi(PH_M0, c0), lo0 = PH_M0 * c0;
        const u32 hi1 = __umulhi(PH_M1, c2), lo1 = PH_M1 * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    Philox4 out = {{c0, c1, c2, c3}};
    return out;
}

__device__ __forceinline__ Philox4 philox_block(u64 seed, u64 index) {
    return philox4x32_10((u32)index, (u32)(index >> 32), 0u, 0u, (u32)seed, (u32)(seed >> 32));
}

__device__ __forceinline__ float philox_uniform(u64 seed, u64 index) {
    return (float)(philox_block(seed, index).w[0] >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ double philox_normal(u64 seed, u64 index) {
    const Philox4 b = philox_block(seed, index);
    const double two_m32 = 1.0 / 4294967296.0;
    const double u1 = __dmul_rn(__dadd_rn((double)b.w[0], 1.0), two_m32);
    const double u2 = __dmul_rn((double)b.w[1], two_m32);
    const double tau = 6.283185307179586; // std::f64::consts::TAU
    return __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(tau, u2)));
}

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

#define RANDOM_ENTRIES(sfx, T)                                                                   \
    extern "C" __global__ void uniform_##sfx(T *out, i64 n, u64 seed, u64 start, double low, double width) { \
        uniform_impl<T>(out, n, seed, start, low, width);                                        \
    }                                                                                            \
    extern "C" __global__ void normal_##sfx(T *out, i64 n, u64 seed, u64 start, double mean, double std) { \
        normal_impl<T>(out, n, seed, start, mean, std);                                          \
    }                                                                                            \
    extern "C" __global__ void dropout_mask_##sfx(T *out, i64 n, u64 seed, u64 start, float p, double scale) { \
        dropout_mask_impl<T>(out, n, seed, start, p, scale);                                     \
    }                                                                                            \
    extern "C" __global__ void dropout_apply_##sfx(const T *x, T *y, u8 *keep, i64 n, u64 seed, u64 start, float p, \
                                                   double scale) {                               \
        dropout_apply_impl<T>(x, y, keep, n, seed, start, p, scale);                             \
    }
MG_FOR_FLOAT_TYPES(RANDOM_ENTRIES)
extern "C" __global__ void uniform_f64(double *out, i64 n, u64 seed, u64 start, double low, double width) {
    uniform_impl<double>(out, n, seed, start, low, width);
}
extern "C" __global__ void normal_f64(double *out, i64 n, u64 seed, u64 start, double mean, double std) {
    normal_impl<double>(out, n, seed, start, mean, std);
}
