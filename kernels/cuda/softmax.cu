// softmax.cu: softmax and log-softmax over the last dimension, forward and backward.
//
// CPU reference: kernels/src/cpu/softmax.rs (`softmax_forward`, `log_softmax_forward`,
// `softmax_backward`, `log_softmax_backward`).
// Layout: contiguous row-major `[rows, cols]`; the softmax runs along `cols`. One block per row
// (grid-stride over rows), any blockDim that is a multiple of 32 (256 intended).
// Forward: `y = exp(x - m) / Σ exp(x - m)` with `m` the row max; log-softmax
// `y = x - m - ln Σ exp(x - m)`. Backward: `dx = y (dy - Σ dy·y)`; log-softmax
// `dx = dy - exp(y) Σ dy`. Sums in f32 over a per-thread strided pass then a block tree (a
// fixed order for a given blockDim, not the CPU's lane order: equal to rounding, not bitwise).
// A row of all -inf gives NaN, as the CPU's max-subtracted form does.

template <typename T, bool LOG>
__device__ void softmax_fwd_impl(const T *x, T *y, i64 rows, i64 cols) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = x + r * cols;
        T *yr = y + r * cols;
        float m = MG_NEG_INF;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, load(xr, c));
        m = block_max(m, scratch);
        float s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) s += expf(load(xr, c) - m);
        s = block_sum(s, scratch);
        if (LOG) {
            const float ls = logf(s);
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) store(yr, c, load(xr, c) - m - ls);
        } else {
            const float inv = 1.0f / s;
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) store(yr, c, expf(load(xr, c) - m) * inv);
        }
    }
}

template <typename T, bool LOG>
__device__ void softmax_bwd_impl(const T *y, const T *dy, T *dx, i64 rows, i64 cols) {
    __shared__ float scratch[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *yr = y + r * cols, *dyr = dy + r * cols;
        T *dxr = dx + r * cols;
        float d = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x)
            d += LOG ? load(dyr, c) : load(yr, c) * load(dyr, c);
        d = block_sum(d, scratch);
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float yv = load(yr, c), g = load(dyr, c);
            store(dxr, c, LOG ? g - expf(yv) * d : yv * (g - d));
        }
    }
}

#define SOFTMAX_ENTRIES(sfx, T)                                                                  \
    extern "C" __global__ void softmax_fwd_##sfx(const T *x, T *y, i64 rows, i64 cols) {         \
        softmax_fwd_impl<T, false>(x, y, rows, cols);                                            \
    }                                                                                            \
    extern "C" __global__ void log_softmax_fwd_##sfx(const T *x, T *y, i64 rows, i64 cols) {     \
        softmax_fwd_impl<T, true>(x, y, rows, cols);                                             \
    }                                                                                            \
    extern "C" __global__ void softmax_bwd_##sfx(const T *y, const T *dy, T *dx, i64 rows, i64 cols) { \
        softmax_bwd_impl<T, false>(y, dy, dx, rows, cols);                                       \
    }                                                                                            \
    extern "C" __global__ void log_softmax_bwd_##sfx(const T *y, const T *dy, T *dx, i64 rows, i64 cols) { \
        softmax_bwd_impl<T, true>(y, dy, dx, rows, cols);                                        \
    }
MG_FOR_FLOAT_TYPES(SOFTMAX_ENTRIES)
