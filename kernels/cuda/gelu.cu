// gelu.cu: GELU (tanh and erf forms) forward and backward.
//
// CPU reference: kernels/src/cpu/elementwise.rs (`unary` with GeluTanh / GeluErf,
// `gelu_backward`). The forward that runs is the basic `unary_<t>` op (elementwise.cu);
// `gelu_fwd_<t>` is its standalone form.
// Layout: every buffer contiguous and of the same length `n` (elementwise; any shape).
// Formulas as the CPU: tanh GELU evaluated as `x sigmoid(2u)`, `u = sqrt(2/pi)(x + 0.044715 x³)`,
// derivative `s + 2 sqrt(2/pi) x s (1 - s)(1 + 3·0.044715 x²)`; erf GELU `0.5 x (1 + erf(x/√2))`,
// derivative `Φ(x) + x φ(x)`. Computed in f32 (expf/erff: equal to the CPU to a few ulp, not
// bitwise).

#define A_SQRT_2_OVER_PI 0.7978845608028654
#define A_GELU_CUBIC 0.044715
#define A_FRAC_1_SQRT_2 0.7071067811865476
#define A_FRAC_1_SQRT_2PI 0.3989422804014327

template <typename T>
__device__ void gelu_fwd_impl(const T *x, T *y, i64 n, int tanh_form) {
    const float c2 = (float)(-2.0 * A_SQRT_2_OVER_PI), a = (float)A_GELU_CUBIC, r = (float)A_FRAC_1_SQRT_2;
    MG_GRID_STRIDE(i, n) {
        const float v = load(x, i);
        store(y, i, tanh_form ? v / (1.0f + expf(c2 * (v + a * v * v * v))) : 0.5f * v * (1.0f + erff(v * r)));
    }
}

template <typename T>
__device__ void gelu_bwd_impl(const T *x, const T *dy, T *dx, i64 n, int tanh_form) {
    const float c2 = (float)(-2.0 * A_SQRT_2_OVER_PI), two_c = (float)(2.0 * A_SQRT_2_OVER_PI);
    const float a = (float)A_GELU_CUBIC, a3 = (float)(3.0 * A_GELU_CUBIC);
    const float r = (float)A_FRAC_1_SQRT_2, k = (float)A_FRAC_1_SQRT_2PI;
    MG_GRID_STRIDE(i, n) {
        const float v = load(x, i), g = load(dy, i);
        float deriv;
        if (tanh_form) {
            const float v2 = v * v;
            const float s = 1.0f / (1.0f + expf(c2 * (v + a * v2 * v)));
            deriv = s + two_c * v * s * (1.0f - s) * (1.0f + a3 * v2);
        } else {
            const float cdf = 0.5f * (1.0f + erff(v * r));
            const float pdf = k * expf(-0.5f * v * v);
            deriv = cdf + v * pdf;
        }
        store(dx, i, g * deriv);
    }
}

#define GELU_ENTRIES(sfx, T)                                                                     \
    extern "C" __global__ void gelu_fwd_##sfx(const T *x, T *y, i64 n, int tanh_form) {          \
        gelu_fwd_impl<T>(x, y, n, tanh_form);                                                    \
    }                                                                                            \
    extern "C" __global__ void gelu_bwd_##sfx(const T *x, const T *dy, T *dx, i64 n, int tanh_form) { \
        gelu_bwd_impl<T>(x, dy, dx, n, tanh_form);                                               \
    }
MG_FOR_FLOAT_TYPES(GELU_ENTRIES)
