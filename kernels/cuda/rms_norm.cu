// rms_norm.cu: fused RMSNorm over the last dimension, forward and backward (the row kernels of
// norm.cuh with RMS = true: layout, formulas and the weight gradient partials there).
//
// CPU reference: kernels/src/cpu/rms_norm.rs (`rms_norm_forward`, `rms_norm_backward`).

#include "norm.cuh"

#define RMS_NORM_ENTRIES(sfx, T)                                                                 \
    extern "C" __global__ void rms_norm_fwd_##sfx(const T *x, const T *w, T *y, float *rstd, i64 rows, i64 cols, \
                                                  float eps) {                                   \
        norm_fwd_impl<T, true>(x, w, nullptr, y, nullptr, rstd, rows, cols, eps);                \
    }                                                                                            \
    extern "C" __global__ void rms_norm_bwd_##sfx(const T *x, const T *w, const float *rstd, const T *dy, T *dx, \
                                                  float *dw_partial, i64 rows, i64 cols) {       \
        norm_bwd_impl<T, true>(x, w, nullptr, rstd, dy, dx, dw_partial, nullptr, rows, cols);    \
    }
MG_FOR_FLOAT_TYPES(RMS_NORM_ENTRIES)
