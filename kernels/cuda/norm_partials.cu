// norm_partials.cu: the sum over blocks of the norms' per-block weight/bias gradient partials
// (written by layer_norm_bwd_<t> and rms_norm_bwd_<t>, see norm.cuh), in increasing block order.
//
// CPU reference: the row sums of kernels/src/cpu/layer_norm.rs and kernels/src/cpu/rms_norm.rs
// (`dweight`, `dbias`: the same sums in increasing row order, so equal to rounding).

// out[c] = Σ_{b < nparts} partial[b, c] (increasing b), rounded to T; added to the existing
// value of `out` when `accumulate` is nonzero (gradient accumulation), else overwriting it.
template <typename T>
__device__ void partials_reduce_impl(const float *partial, i64 nparts, i64 cols, T *out, int accumulate) {
    MG_GRID_STRIDE(c, cols) {
        float s = 0.0f;
        for (i64 b = 0; b < nparts; ++b) s += partial[b * cols + c];
        if (accumulate) s += load(out, c);
        store(out, c, s);
    }
}

#define NORM_PARTIALS_ENTRIES(sfx, T)                                                            \
    extern "C" __global__ void norm_partials_reduce_##sfx(const float *partial, i64 nparts, i64 cols, T *out, \
                                                          int accumulate) {                      \
        partials_reduce_impl<T>(partial, nparts, cols, out, accumulate);                         \
    }
MG_FOR_FLOAT_TYPES(NORM_PARTIALS_ENTRIES)
