// logsumexp.cu: log-sum-exp over one dimension, `*_strided_<t>` and `*_lastdim_<t>` as the other
// reductions (the kernels of reduce.cuh with KIND 3; layout, precision and order as reduce.cu's
// header says).
//
// CPU reference: kernels/src/cpu/logsumexp.rs (`logsumexp`): shifted by the NaN-ignoring max (0
// when it is infinite), -inf for an empty dim or all -inf, NaN propagates.

#include "reduce.cuh"

#define LOGSUMEXP_ENTRIES(sfx, T)                                                                \
    extern "C" __global__ void logsumexp_strided_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        reduce_strided_impl<T, 3>(x, out, outer, red, inner);                                    \
    }                                                                                            \
    extern "C" __global__ void logsumexp_lastdim_##sfx(const T *x, T *out, i64 rows, i64 red) {  \
        reduce_lastdim_impl<T, 3>(x, out, rows, red);                                            \
    }
MG_FOR_BASIC_TYPES(LOGSUMEXP_ENTRIES)
