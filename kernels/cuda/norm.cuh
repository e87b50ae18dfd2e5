// norm.cuh: the row kernels layer norm (layer_norm.cu) and RMSNorm (rms_norm.cu) share, one
// template each for the forward and the backward with `RMS` choosing the norm. Included by those
// two files (kernels/build.rs lists it with each; NVRTC and the emulation get it inlined).
//
// Layout: `x`, `y`, `dy`, `dx` contiguous row-major `[rows, cols]`; `weight`, `bias` `[cols]`
// (null = absent: 1 and 0); the saved statistics `mean`, `rstd` are f32 `[rows]` for every data
// type (the CPU stores them in T; for f32 this is the same).
// Forward (one block per row, grid-stride over rows): layer norm computes the mean, then the mean
// of squared deviations (two passes, biased variance, as the CPU), `rstd = 1/sqrt(var + eps)`,
// `y = (x - mean) rstd w + b`; RMSNorm `rstd = 1/sqrt(mean(x²) + eps)`, `y = x rstd w`.
// Backward: with `xhat = (x - mean) rstd` (RMS: `x rstd`) and `g = w dy`:
//   layer norm `dx = rstd (g - mean(g) - xhat mean(g xhat))`, RMS `dx = rstd (g - xhat mean(g xhat))`.
// `dweight = Σ_rows dy xhat`, `dbias = Σ_rows dy` are written as per-block partials: block `b`
// handles rows b, b + gridDim.x, ... in increasing order and writes its column sums to row `b` of
// `dw_partial` / `db_partial` (f32 `[gridDim.x, cols]`, fully overwritten; null to skip); then
// `norm_partials_reduce_<t>` (norm_partials.cu) sums the partials over blocks in increasing block
// order. Both are deterministic for a given grid size (no atomics), but the order differs from
// the CPU's increasing-row order, so the sums agree to rounding.
// Row sums: per-thread strided pass then a block tree, in f32.

template <typename T, bool RMS>
__device__ void norm_fwd_impl(const T *x, const T *w, const T *b, T *y, float *mean_out, float *rstd_out,
                              i64 rows, i64 cols, float eps) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols;
        T *yr = y + r * cols;
        float mean = 0.0f, var;
        if (!RMS) {
            float s = 0.0f;
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += load(xr, c);
            mean = block_sum(s, scratch) / (float)cols;
        }
        float s2 = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float d = load(xr, c) - mean;
            s2 += d * d;
        }
        var = block_sum(s2, scratch) / (float)cols;
        const float rstd = 1.0f / sqrtf(var + eps);
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = (load(xr, c) - mean) * rstd;
            if (w) v *= load(w, c);
            if (!RMS && b) v += load(b, c);
            store(yr, c, v);
        }
        if (threadIdx.x == 0) {
            if (!RMS && mean_out) mean_out[r] = mean;
            if (rstd_out) rstd_out[r] = rstd;
        }
    }
}

template <typename T, bool RMS>
__device__ void norm_bwd_impl(const T *x, const T *w, const float *mean_in, const float *rstd_in, const T *dy,
                              T *dx, float *dw_partial, float *db_partial, i64 rows, i64 cols) {
    __shared__ float scratch[32];
    // Each thread owns columns threadIdx.x + k * blockDim.x of this block's partial rows.
    float *dwp = dw_partial ? dw_partial + (i64)blockIdx.x * cols : nullptr;
    float *dbp = (!RMS && db_partial) ? db_partial + (i64)blockIdx.x * cols : nullptr;
    for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
        if (dwp) dwp[c] = 0.0f;
        if (dbp) dbp[c] = 0.0f;
    }
    const float inv_cols = 1.0f / (float)cols;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols, *dyr = dy + r * cols;
        T *dxr = dx + r * cols;
        const float mean = RMS ? 0.0f : mean_in[r], rstd = rstd_in[r];
        float sg = 0.0f, sgx = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float xhat = (load(xr, c) - mean) * rstd, d = load(dyr, c);
            const float g = w ? load(w, c) * d : d;
            sg += g;
            sgx += g * xhat;
            if (dwp) dwp[c] += d * xhat;
            if (dbp) dbp[c] += d;
        }
        const float mg = RMS ? 0.0f : block_sum(sg, scratch) * inv_cols;
        const float mgx = block_sum(sgx, scratch) * inv_cols;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float xhat = (load(xr, c) - mean) * rstd, d = load(dyr, c);
            const float g = w ? load(w, c) * d : d;
            store(dxr, c, rstd * (g - mg - xhat * mgx));
        }
    }
}
