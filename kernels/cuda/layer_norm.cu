// layer_norm.cu: fused layer norm over the last dimension, forward and backward (the row kernels
// of norm.cuh with RMS = false: layout, formulas and the weight/bias gradient partials there).
//
// CPU reference: kernels/src/cpu/layer_norm.rs (`layer_norm_forward`, `layer_norm_backward`).

#include "norm.cuh"

#define LAYER_NORM_ENTRIES(sfx, T)                                                               \
    extern "C" __global__ void layer_norm_fwd_##sfx(const T *x, const T *w, const T *b, T *y, float *mean, \
                                                    float *rstd, i64 rows, i64 cols, float eps) { \
        norm_fwd_impl<T, false>(x, w, b, y, mean, rstd, rows, cols, eps);                        \
    }                                                                                            \
    extern "C" __global__ void layer_norm_bwd_##sfx(const T *x, const T *w, const float *mean, const float *rstd, \
                                                    const T *dy, T *dx, float *dw_partial, float *db_partial, \
                                                    i64 rows, i64 cols) {                        \
        norm_bwd_impl<T, false>(x, w, mean, rstd, dy, dx, dw_partial, db_partial, rows, cols);   \
    }
MG_FOR_FLOAT_TYPES(LAYER_NORM_ENTRIES)
