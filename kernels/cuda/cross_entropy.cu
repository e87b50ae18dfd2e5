// cross_entropy.cu: fused cross-entropy over logits — loss, log-sum-exp and dlogits in one kernel.
//
// CPU reference: kernels/src/cpu/cross_entropy.rs (`cross_entropy_forward`,
// `cross_entropy_backward`).
// Layout: `logits` / `dlogits` contiguous row-major `[rows, cols]` (cols = vocabulary), `targets`
// i64 `[rows]`, `loss` and `lse` f32 `[rows]`. One block per row (grid-stride over rows).
// `cross_entropy_fused_<t>`: pass 1 reads the row once with an online max/sum per thread
// (merged over the block) giving `lse = m + ln Σ exp(x - m)`; `loss = lse - x[target]`. When
// `dlogits` is non-null, pass 2 writes `dlogits = g (exp(x - lse) - onehot(target))` with
// `g = dloss[r]` when `dloss` is non-null, else `dloss_scale` (e.g. 1/valid-count for a mean
// loss). `dlogits` may alias `logits` (pass 2 reads each element before overwriting it, after
// pass 1 has finished for the row). The logits are read twice from memory, no probability matrix
// is stored.
// `cross_entropy_bwd_<t>`: the CPU's separate backward from a saved `lse`.
// Ignore-index semantics as the CPU: when `has_ignore` and `targets[r] == ignore_index`, loss 0,
// `lse` still written, dlogits row 0. A target outside 0..cols (not ignored) records the row in
// `*bad` (atomicMin; the launcher sets ~0 before and raises the CPU's error after) and gets NaN
// loss and a zero dlogits row.
// Sums are in f32 in a per-thread then block-tree order (equal to the CPU to rounding).

// Online (max, sum) merge: the pair represents Σ exp(x - m) = s.
__device__ __forceinline__ void lse_merge(float &m, float &s, float m2, float s2) {
    if (m2 == MG_NEG_INF) return;
    if (m == MG_NEG_INF) {
        m = m2;
        s = s2;
        return;
    }
    const float mn = fmaxf(m, m2);
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

template <typename T>
__device__ void ce_fused_impl(const T *logits, const i64 *targets, float *loss, float *lse_out, T *dlogits,
                              const float *dloss, float dloss_scale, i64 rows, i64 cols, i64 ignore_index,
                              int has_ignore, u64 *bad) {
    __shared__ float sm[32], ss[32];
    __shared__ float row_lse;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const T *xr = logits + r * cols;
        float m = MG_NEG_INF, s = 0.0f;
        for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const float v = load(xr, c);
            if (isnan(v)) {
                m = MG_NAN; // poison: NaN propagates to lse like the CPU's sum
                s = MG_NAN;
            } else if (!isnan(m)) {
                if (v > m) {
                    s = (m == MG_NEG_INF ? 0.0f : s * expf(m - v)) + 1.0f;
                    m = v;
                } else {
                    s += (v == MG_NEG_INF) ? 0.0f : expf(v - m);
                }
            }
        }
        int nan = isnan(m);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            if (!isnan(m) && !isnan(m2)) lse_merge(m, s, m2, s2);
        }
        nan = __syncthreads_or(nan);
        if (lane == 0) {
            sm[warp] = m;
            ss[warp] = s;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float M = MG_NEG_INF, S = 0.0f;
            for (int w = 0; w < nwarps; ++w) lse_merge(M, S, sm[w], ss[w]);
            // all -inf: -inf; some +inf: +inf (s * exp(inf - inf) is NaN, handled by isinf(M))
            float l = nan ? MG_NAN : (isinf(M) ? M : M + logf(S));
            row_lse = l;
            if (lse_out) lse_out[r] = l;
            const i64 t = targets[r];
            if (has_ignore && t == ignore_index) {
                loss[r] = 0.0f;
            } else if (t < 0 || t >= cols) {
                flag_bad(bad, r);
                loss[r] = MG_NAN;
            } else {
                loss[r] = l - load(xr, t);
            }
        }
        __syncthreads();
        if (dlogits) {
            const i64 t = targets[r];
            const bool zero = (has_ignore && t == ignore_index) || t < 0 || t >= cols;
            const float g = dloss ? dloss[r] : dloss_scale;
            const float l = row_lse;
            T *dr = dlogits + r * cols;
            for (i64 c = threadIdx.x; c < cols; c += blockDim.x) {
                float d = 0.0f;
                if (!zero) {
                    d = g * expf(load(xr, c) - l);
                    if (c == t) d -= g;
                }
                store(dr, c, d);
            }
        }
        __syncthreads(); // row_lse is rewritten by the next row
    }
}

template <typename T>
__device__ void ce_bwd_impl(const T *logits, const float *lse, const i64 *targets, const float *dloss,
                            float dloss_scale, T *dlogits, i64 rows, i64 cols, i64 ignore_index, int has_ignore) {
    MG_GRID_STRIDE(idx, rows * cols) {
        const i64 r = idx / cols, c = idx % cols;
        const i64 t = targets[r];
        float d = 0.0f;
        if (!((has_ignore && t == ignore_index) || t < 0 || t >= cols)) {
            const float g = dloss ? dloss[r] : dloss_scale;
            d = g * expf(load(logits, idx) - lse[r]);
            if (c == t) d -= g;
        }
        store(dlogits, idx, d);
    }
}

#define CE_ENTRIES(sfx, T)                                                                       \
    extern "C" __global__ void cross_entropy_fused_##sfx(                                        \
        const T *logits, const i64 *targets, float *loss, float *lse, T *dlogits, const float *dloss, \
        float dloss_scale, i64 rows, i64 cols, i64 ignore_index, int has_ignore, u64 *bad) {     \
        ce_fused_impl<T>(logits, targets, loss, lse, dlogits, dloss, dloss_scale, rows, cols, ignore_index, \
                         has_ignore, bad);                                                       \
    }                                                                                            \
    extern "C" __global__ void cross_entropy_bwd_##sfx(const T *logits, const float *lse, const i64 *targets, \
                                                       const float *dloss, float dloss_scale, T *dlogits, i64 rows, \
                                                       i64 cols, i64 ignore_index, int has_ignore) { \
        ce_bwd_impl<T>(logits, lse, targets, dloss, dloss_scale, dlogits, rows, cols, ignore_index, has_ignore); \
    }
MG_FOR_FLOAT_TYPES(CE_ENTRIES)
