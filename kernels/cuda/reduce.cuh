// reduce.cuh: the reductions over the middle dim of `[outer, red, inner]` that reduce.cu (sum,
// mean, max) and logsumexp.cu share, one template per kernel shape with `KIND` choosing the
// reduction (0 sum, 1 mean, 2 max, 3 logsumexp). Layout, precision, order and semantics: see
// reduce.cu's header.

// ---- one thread per output (increasing r) ----
template <typename T, int KIND> // 0 sum, 1 mean, 2 max, 3 logsumexp
__device__ void reduce_strided_impl(const T *x, T *out, i64 outer, i64 red, i64 inner) {
    MG_GRID_STRIDE(idx, outer * inner) {
        const i64 o = idx / inner, in = idx % inner;
        const T *base = x + o * red * inner + in;
        typedef typename Acc<T>::type C;
        C acc;
        if (KIND == 0 || KIND == 1) {
            acc = red > 0 ? load(base, 0) : (C)0;
            for (i64 r = 1; r < red; ++r) acc = mg_add_rn(acc, load(base, r * inner));
            if (KIND == 1) acc = red > 0 ? acc / (C)red : (C)MG_NAN;
        } else if (KIND == 2) {
            acc = red > 0 ? load(base, 0) : (C)MG_NAN;
            for (i64 r = 1; r < red; ++r) {
                const C v = load(base, r * inner);
                if (v > acc || isnan(v)) acc = v;
            }
        } else {
            C m = (C)MG_NEG_INF;
            for (i64 r = 0; r < red; ++r) m = mg_max(m, load(base, r * inner));
            const C shift = isinf(m) ? (C)0 : m;
            C s = 0;
            for (i64 r = 0; r < red; ++r) s += mg_exp(load(base, r * inner) - shift);
            acc = red > 0 ? shift + mg_log(s) : (C)MG_NEG_INF;
        }
        store(out, idx, acc);
    }
}

// ---- one block per output row (inner == 1) ----
template <typename T, int KIND>
__device__ void reduce_lastdim_impl(const T *x, T *out, i64 rows, i64 red) {
    typedef typename Acc<T>::type C;
    __shared__ C scratch[32];
    for (i64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T *base = x + row * red;
        C res;
        if (KIND == 0 || KIND == 1) {
            C acc = 0;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) acc += load(base, r);
            res = block_sum(acc, scratch);
            if (KIND == 1) res = red > 0 ? res / (C)red : (C)MG_NAN;
        } else if (KIND == 2) {
            C acc = (C)MG_NEG_INF;
            int nan = 0;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) {
                const C v = load(base, r);
                nan |= isnan(v);
                acc = mg_max(acc, v);
            }
            const int any_nan = __syncthreads_or(nan);
            res = block_max(acc, scratch);
            if (any_nan || red == 0) res = (C)MG_NAN;
        } else {
            C m = (C)MG_NEG_INF;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) m = mg_max(m, load(base, r));
            m = block_max(m, scratch);
            const C shift = isinf(m) ? (C)0 : m;
            C s = 0;
            for (i64 r = threadIdx.x; r < red; r += blockDim.x) s += mg_exp(load(base, r) - shift);
            s = block_sum(s, scratch);
            res = red > 0 ? shift + mg_log(s) : (C)MG_NEG_INF;
        }
        if (threadIdx.x == 0) store(out, row, res);
        __syncthreads();
    }
}
