// unary_backward.cu: the fused backward passes of the unary ops SiLU and clamp.
//
// CPU reference: kernels/src/cpu/unary_backward.rs (`unary_backward`, UnaryGrad::Silu / Clamp).
// Layout: every buffer contiguous and of the same length `n` (elementwise; any shape).
// Computed in f32 (expf: equal to the CPU to a few ulp, not bitwise). A sigmoid whose exp
// overflows gives 0, as on the CPU.

// op 0: SiLU, dx = dy s (1 + x (1 - s)); op 1: clamp to [lo, hi], dx = dy where lo <= x <= hi
// (bounds included; NaN x gives 0).
template <typename T>
__device__ void unary_bwd_impl(const T *x, const T *dy, T *dx, i64 n, int op, double lo, double hi) {
    const float flo = (float)lo, fhi = (float)hi;
    MG_GRID_STRIDE(i, n) {
        const float v = load(x, i), g = load(dy, i);
        float d;
        if (op == 0) {
            const float s = sigmoidf_(v);
            d = g * (s * (1.0f + v * (1.0f - s)));
        } else {
            d = (flo <= v && v <= fhi) ? g : 0.0f;
        }
        store(dx, i, d);
    }
}

#define UNARY_BWD_ENTRIES(sfx, T)                                                                \
    extern "C" __global__ void unary_bwd_##sfx(const T *x, const T *dy, T *dx, i64 n, int op, double lo, \
                                               double hi) {                                      \
        unary_bwd_impl<T>(x, dy, dx, n, op, lo, hi);                                             \
    }
MG_FOR_FLOAT_TYPES(UNARY_BWD_ENTRIES)
