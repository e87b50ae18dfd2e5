// reduce.cu: sum, mean, max and argmax over one dimension (log-sum-exp: logsumexp.cu; both use
// the kernels of reduce.cuh).
//
// CPU references: kernels/src/cpu/reduce.rs (`sum`, `max`, `argmax`; mean is the tensor crate's
// sum / reduce) and kernels/src/cpu/logsumexp.rs (`logsumexp`).
// Layout: the input is contiguous `[outer, reduce, inner]` (row-major), the output contiguous
// `[outer, inner]`. Two instances of every reduction (and a third of sum, `sum_cols_<t>`, below):
// - `*_strided_<t>` (any inner; meant for inner > 1): one thread per output element, adding in
//   increasing r exactly as the CPU does. With f32 data the accumulation is in f32 like the CPU's,
//   so sum/max/argmax agree bit for bit with the CPU reference (up to fused multiply-add, which
//   these loops do not use).
// - `*_lastdim_<t>` (inner == 1): one block per output row, a strided per-thread pass then a tree
//   over the block: a fixed order for a given blockDim (deterministic run to run), but not the
//   CPU's order, so sums agree to rounding only. Max/argmax are exact whatever the order.
// bf16/f16 inputs accumulate in f32 and round the result once; f64 inputs accumulate in f64.
// Semantics as the CPU: max
// propagates NaN; argmax returns the smallest index of the maximum, NaN counting as larger than
// everything (first NaN wins); logsumexp shifts by the NaN-ignoring max (0 when it is infinite),
// gives -inf for reduce == 0 or all -inf; sum gives 0 for reduce == 0.

#include "reduce.cuh"

template <typename C> struct ArgMax {
    C v;
    i64 i;
};
// Whether candidate `b` beats the current `a` (NaN largest; ties and equal NaNs: smaller index).
template <typename C> __device__ __forceinline__ bool argmax_better(ArgMax<C> a, ArgMax<C> b) {
    const bool an = isnan(a.v), bn = isnan(b.v);
    if (an || bn) {
        if (an && bn) return b.i < a.i;
        return bn;
    }
    if (b.v > a.v) return true;
    if (b.v < a.v) return false;
    return b.i < a.i;
}

template <typename T>
__device__ void argmax_strided_impl(const T *x, i64 *out, i64 outer, i64 red, i64 inner) {
    MG_GRID_STRIDE(idx, outer * inner) {
        const i64 o = idx / inner, in = idx % inner;
        const T *base = x + o * red * inner + in;
        typedef typename Acc<T>::type C;
        ArgMax<C> best = {red > 0 ? load(base, 0) : (C)MG_NAN, 0};
        for (i64 r = 1; r < red; ++r) {
            ArgMax<C> c = {load(base, r * inner), r};
            if (argmax_better(best, c)) best = c;
        }
        out[idx] = best.i;
    }
}

template <typename T>
__device__ void argmax_lastdim_impl(const T *x, i64 *out, i64 rows, i64 red) {
    typedef typename Acc<T>::type C;
    __shared__ C sv[32];
    __shared__ i64 si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *base = x + row * red;
        ArgMax<C> best = {(C)MG_NEG_INF, red}; // index `red`: loses every tie against a real element
        for (i64 r = threadIdx.x; r < red; r += blockDim.x) {
            ArgMax<C> c = {load(base, r), r};
            if (argmax_better(best, c)) best = c;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ArgMax<C> c = {__shfl_xor_sync(0xffffffffu, best.v, o), __shfl_xor_sync(0xffffffffu, best.i, o)};
            if (argmax_better(best, c)) best = c;
        }
        if (lane == 0) {
            sv[warp] = best.v;
            si[warp] = best.i;
        }
        __syncthreads();
        if (warp == 0) {
            ArgMax<C> b = {lane < nwarps ? sv[lane] : (C)MG_NEG_INF, lane < nwarps ? si[lane] : red};
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                ArgMax<C> c = {__shfl_xor_sync(0xffffffffu, b.v, o), __shfl_xor_sync(0xffffffffu, b.i, o)};
                if (argmax_better(b, c)) b = c;
            }
            if (lane == 0) out[row] = b.i < red ? b.i : 0;
        }
        __syncthreads();
    }
}

// ---- column tiles (inner > 1, long reductions): one block per 32 adjacent outputs ----
// `sum_cols_<t>`: for reductions whose outputs are too few to keep the GPU busy one thread each
// (a bias gradient: a column sum of [rows, out]). Warp w of the block's nw warps sums rows
// r = w, w + nw, ... (increasing r) of the 32 columns of its tile, lane by lane (each warp reads
// 32 adjacent elements of a row at a time); then warp 0 adds the nw partial sums in increasing w.
// A fixed order for a given blockDim: deterministic run to run, equal to the CPU's to rounding.
template <typename T>
__device__ void sum_cols_impl(const T *x, T *out, i64 outer, i64 red, i64 inner) {
    typedef typename Acc<T>::type C;
    __shared__ C part[32][33];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 tiles = (inner + 31) / 32;
    for (i64 t = blockIdx.x; t < outer * tiles; t += gridDim.x) {
        const i64 o = t / tiles, c = (t % tiles) * 32 + lane;
        C acc = 0;
        if (c < inner) {
            const T *base = x + o * red * inner + c;
            for (i64 r = w; r < red; r += nw) acc += load(base, r * inner);
        }
        part[w][lane] = acc;
        __syncthreads();
        if (w == 0 && c < inner) {
            C total = part[0][lane];
            for (int k = 1; k < nw; ++k) total += part[k][lane];
            store(out, o * inner + c, total);
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
    extern "C" __global__ void argmax_lastdim_##sfx(const T *x, i64 *out, i64 rows, i64 red) {   \
        argmax_lastdim_impl<T>(x, out, rows, red);                                               \
    }                                                                                            \
    extern "C" __global__ void sum_cols_##sfx(const T *x, T *out, i64 outer, i64 red, i64 inner) { \
        sum_cols_impl<T>(x, out, outer, red, inner);                                             \
    }
MG_FOR_BASIC_TYPES(REDUCE_ENTRIES)
