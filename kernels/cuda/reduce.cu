// reduce.cu: sum, mean, max, argmax and logsumexp over one dimension.
//
// CPU references: kernels/src/cpu/reduce.rs (`sum`, `max`, `argmax`; mean is the tensor crate's
// sum / reduce) and kernels/src/cpu/logsumexp.rs (`logsumexp`).
// Layout: the input is contiguous `[outer, reduce, inner]` (row-major), the output contiguous
// `[outer, inner]`. Two instances of every reduction:
// - `*_strided_<t>` (any inner; meant for inner > 1): one thread per output element, adding in
//   increasing r exactly as the CPU does. With f32 data the accumulation is in f32 like the CPU's,
//   so sum/max/argmax agree bit for bit with the CPU reference (up to fused multiply-add, which
//   these loops do not use).
// - `*_lastdim_<t>` (inner == 1): one block per output row, a strided per-thread pass then a tree
//   over the block: a fixed order for a given blockDim (deterministic run to run), but not the
//   CPU's order, so sums agree to rounding only. Max/argmax are exact whatever the order.
// bf16/f16 inputs accumulate in f32 and round the result once. Semantics as the CPU: max
// propagates NaN; argmax returns the smallest index of the maximum, NaN counting as larger than
// everything (first NaN wins); logsumexp shifts by the NaN-ignoring max (0 when it is infinite),
// gives -inf for reduce == 0 or all -inf; sum gives 0 for reduce == 0.
// Compiled by NVRTC in CI; not run on a GPU.

struct ArgMax {
    float v;
    i64 i;
};
// Whether candidate `b` beats the current `a` (NaN largest; ties and equal NaNs: smaller index).
__device__ __forceinline__ bool argmax_better(ArgMax a, ArgMax b) {
    const bool an = isnan(a.v), bn = isnan(b.v);
    if (an || bn) {
        if (an && bn) return b.i < a.i;
        return bn;
    }
    if (b.v > a.v) return true;
    if (b.v < a.v) return false;
    return b.i < a.i;
}

// ---- one thread per output (increasing r) ----
template <typename T, int KIND> // 0 sum, 1 mean, 2 max, 3 logsumexp
__device__ void reduce_strided_impl(const T *x, T *out, i64 outer, i64 red, i64 inner) {
    MG_GRID_STRIDE(idx, outer * inner) {
        const i64 o = idx / inner, in = idx % inner;
        const T *base = x + o * red * inner + in;
        float acc;
        if (KIND == 0 || KIND == 1) {
            acc = red > 0 ? load(base, 0) : 0.0f;
            for (i64 r = 1; r < red; ++r) acc = __fadd_rn(acc, load(base, r * inner));
            if (KIND == 1) acc = red > 0 ? acc / (float)red : MG_NAN;
        } else if (KIND == 2) {
            acc = red > 0 ? load(base, 0) : MG_NAN;
            for (i64 r = 1; r < red; ++r) {
                const float v = load(base, r * inner);
                if (v > acc || isnan(v)) acc = v;
            }
        } else {
            float m = MG_NEG_INF;
            for (i64 r = 0; r < red; ++r) m = fmaxf(m, load(base, r * inner));
            const float shift = isinf(m) ? 0.0f : m;
            float s = 0.0f;
            for (i64 r = 0; r < red; ++r) s += expf(load(base, r * inner) - shift);
            acc = red > 0 ? shift + logf(s) : MG_NEG_INF;
        }
        store(out, idx, acc);
    }
}

template <typename T>
__device__ void argmax_strided_impl(const T *x, i64 *out, i64 outer, i64 red, i64 inner) {
    MG_GRID_STRIDE(idx, outer * inner) {
        const i64 o = idx / inner, in = idx % inner;
        const T *base = x + o * red * inner + in;
        ArgMax best = {red > 0 ? load(base, 0) : MG_NAN, 0};
        for (i64 r = 1; r < red; ++r) {
            ArgMax c = {load(base, r * inner), r};
            if (argmax_better(best, c)) best = c;
        }
        out[idx] = best.i;
    }
}

// ---- one block per output row (inner == 1) ----
template <typename T, int KIND>
__device__ void reduce_lastdim_impl(const T *x, T *out, i64 rows, i64 red) {
    __shared__ float scratch[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *base = x + row * red;
        float res;
        if (KIND == 0 || KIND == 1) {
            float acc = 0.0f;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) acc += load(base, r);
            res = block_sum(acc, scratch);
            if (KIND == 1) res = red > 0 ? res / (float)red : MG_NAN;
        } else if (KIND == 2) {
            float acc = MG_NEG_INF;
            int nan = 0;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) {
                const float v = load(base, r);
                nan |= isnan(v);
                acc = fmaxf(acc, v);
            }
            const int any_nan = __syncthreads_or(nan);
            res = block_max(acc, scratch);
            if (any_nan || red == 0) res = MG_NAN;
        } else {
            float m = MG_NEG_INF;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) m = fmaxf(m, load(base, r));
            m = block_max(m, scratch);
            const float shift = isinf(m) ? 0.0f : m;
            float s = 0.0f;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) s += expf(load(base, r) - shift);
            s = block_sum(s, scratch);
            res = red > 0 ? shift + logf(s) : MG_NEG_INF;
        }
        if (threadIdx.x == 0) store(out, row, res);
        __syncthreads();
    }
}

template <typename T>
__device__ void argmax_lastdim_impl(const T *x, i64 *out, i64 rows, i64 red) {
    __shared__ float sv[32];
    __shared__ i64 si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *base = x + row * red;
        ArgMax best = {MG_NEG_INF, red}; // index `red`: loses every tie against a real element
        for (i64 r = threadIdx.x; r < red; r += blockDim.x) {
            ArgMax c = {load(base, r), r};
            if (argmax_better(best, c)) best = c;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ArgMax c = {__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
            if (argmax_better(best, c)) best = c;
        }
        if (lane == 0) {
            sv[warp] = best.v;
            si[warp] = best.i;
        }
        __syncthreads();
        if (warp == 0) {
            ArgMax b = {lane < nwarps ? sv[lane] : MG_NEG_INF, lane < nwarps ? si[lane] : red};
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                ArgMax c = {__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
                if (argmax_better(b, c)) b = c;
            }
            if (lane == 0) out[row] = b.i < red ? b.i : 0;
        }
        __syncthreads();
    }
}

#define REDUCE_ENTRIES(sfx, T)                                                                   \
    extern "C" __global__ void sum_strided_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        reduce_strided_impl<T, 0>(x, out, outer, red, inner);                                    \
    }                                                                                            \
    extern "C" __global__ void mean_strided_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        reduce_strided_impl<T, 1>(x, out, outer, red, inner);                                    \
    }                                                                                            \
    extern "C" __global__ void max_strided_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        reduce_strided_impl<T, 2>(x, out, outer, red, inner);                                    \
    }                                                                                            \
    extern "C" __global__ void logsumexp_strided_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        reduce_strided_impl<T, 3>(x, out, outer, red, inner);                                    \
    }                                                                                            \
    extern "C" __global__ void argmax_strided_##sfx(const T *x, i64 *out, i64 outer, i64 red, i64 inner) { \
        argmax_strided_impl<T>(x, out, outer, red, inner);                                       \
    }                                                                                            \
    extern "C" __global__ void sum_lastdim_##sfx(const T *x, T *out, i64 rows, i64 red) {        \
        reduce_lastdim_impl<T, 0>(x, out, rows, red);                                            \
    }                                                                                            \
    extern "C" __global__ void mean_lastdim_##sfx(const T *x, T *out, i64 rows, i64 red) {       \
        reduce_lastdim_impl<T, 1>(x, out, rows, red);                                            \
    }                                                                                            \
    extern "C" __global__ void max_lastdim_##sfx(const T *x, T *out, i64 rows, i64 red) {        \
        reduce_lastdim_impl<T, 2>(x, out, rows, red);                                            \
    }                                                                                            \
    extern "C" __global__ void logsumexp_lastdim_##sfx(const T *x, T *out, i64 rows, i64 red) {  \
        reduce_lastdim_impl<T, 3>(x, out, rows, red);                                            \
    }                                                                                            \
    extern "C" __global__ void argmax_lastdim_##sfx(const T *x, i64 *out, i64 rows, i64 red) {   \
        argmax_lastdim_impl<T>(x, out, rows, red);                                               \
    }
MG_FOR_FLOAT_TYPES(REDUCE_ENTRIES)
