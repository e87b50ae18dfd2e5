// swiglu.cu: SwiGLU forward and backward.
//
// CPU reference: kernels/src/cpu/swiglu.rs (`swiglu_forward`, `swiglu_backward`).
// Layout: every buffer contiguous and of the same length `n` (elementwise; any shape).
// Formulas as the CPU: `y = g σ(g) u`, `dup = dy g σ(g)`, `dgate = dy u σ(g)(1 + g(1 - σ(g)))`.
// Computed in f32 (expf: equal to the CPU to a few ulp, not bitwise). A sigmoid whose exp
// overflows gives 0, as on the CPU.

template <typename T>
__device__ void swiglu_fwd_impl(const T *gate, const T *up, T *out, i64 n) {
    MG_GRID_STRIDE(i, n) {
        const float g = load(gate, i);
        store(out, i, g * sigmoidf_(g) * load(up, i));
    }
}

template <typename T>
__device__ void swiglu_bwd_impl(const T *gate, const T *up, const T *dy, T *dgate, T *dup, i64 n) {
    MG_GRID_STRIDE(i, n) {
        const float g = load(gate, i), u = load(up, i), d = load(dy, i);
        const float s = sigmoidf_(g);
        store(dup, i, d * (g * s));
        store(dgate, i, d * u * (s * (1.0f + g * (1.0f - s))));
    }
}

#define SWIGLU_ENTRIES(sfx, T)                                                                   \
    extern "C" __global__ void swiglu_fwd_##sfx(const T *gate, const T *up, T *out, i64 n) {     \
        swiglu_fwd_impl<T>(gate, up, out, n);                                                    \
    }                                                                                            \
    extern "C" __global__ void swiglu_bwd_##sfx(const T *gate, const T *up, const T *dy, T *dgate, T *dup, i64 n) { \
        swiglu_bwd_impl<T>(gate, up, dy, dgate, dup, n);                                         \
    }
MG_FOR_FLOAT_TYPES(SWIGLU_ENTRIES)
