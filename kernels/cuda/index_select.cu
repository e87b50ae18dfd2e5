// index_select.cu: index_select along one dim, with its deterministic backward pass.
//
// CPU reference: kernels/src/cpu/gather.rs (`index_select`, `index_select_backward`).
// `x [outer, x_n, inner]`, `ids [m]` (i64), `out [outer, m, inner]`, all contiguous;
// `out[o, j, i] = x[o, ids[j], i]`; backward `dx[o, ids[j], i] += dout[o, j, i]`, one thread per
// (o, i), j increasing (deterministic, the CPU's order). The backward output `dx` is an
// accumulator (not zeroed first) of the compute type: f32 for f32, bf16 and f16, f64 for f64. An
// id out of range is skipped (forward: writes 0) and its position recorded in `*bad` with
// atomicMin (the launcher sets ~0 before, checks after; the CPU checks before writing).

template <typename T>
__device__ void index_select_impl(const T *x, const i64 *ids, T *out, i64 outer, i64 xn, i64 inner, i64 m, u64 *bad) {
    MG_GRID_STRIDE(p, outer * m * inner) {
        const i64 i = p % inner, j = (p / inner) % m, o = p / (inner * m);
        const i64 id = ids[j];
        if (id < 0 || id >= xn) {
            if (o == 0 && i == 0) flag_bad(bad, j);
            out[p] = from_float<T>(0.0f);
        } else {
            out[p] = x[(o * xn + id) * inner + i];
        }
    }
}

template <typename T, typename A>
__device__ void index_select_bwd_impl(const T *dout, const i64 *ids, A *dx, i64 outer, i64 xn, i64 inner, i64 m,
                                      u64 *bad) {
    MG_GRID_STRIDE(q, outer * inner) {
        const i64 o = q / inner, i = q % inner;
        for (i64 j = 0; j < m; ++j) {
            const i64 id = ids[j];
            if (id < 0 || id >= xn) {
                if (q == 0) flag_bad(bad, j);
                continue;
            }
            dx[(o * xn + id) * inner + i] += load(dout, (o * m + j) * inner + i);
        }
    }
}

// A: the backward's accumulator type (Acc<T>::type), written out for the entry points' signatures.
#define INDEX_SELECT_ENTRIES(sfx, T, A)                                                          \
    extern "C" __global__ void index_select_##sfx(const T *x, const i64 *ids, T *out, i64 outer, i64 xn, i64 inner, \
                                                  i64 m, u64 *bad) {                             \
        index_select_impl<T>(x, ids, out, outer, xn, inner, m, bad);                             \
    }                                                                                            \
    extern "C" __global__ void index_select_bwd_##sfx(const T *dout, const i64 *ids, A *dx, i64 outer, i64 xn, \
                                                      i64 inner, i64 m, u64 *bad) {              \
        index_select_bwd_impl<T, A>(dout, ids, dx, outer, xn, inner, m, bad);                    \
    }
INDEX_SELECT_ENTRIES(f32, float, float)
INDEX_SELECT_ENTRIES(bf16, __nv_bfloat16, float)
INDEX_SELECT_ENTRIES(f16, __half, float)
INDEX_SELECT_ENTRIES(f64, double, double)
