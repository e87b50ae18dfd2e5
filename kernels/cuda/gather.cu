// gather.cu: torch.gather, with its deterministic backward pass (index_select: index_select.cu).
//
// CPU reference: kernels/src/cpu/gather.rs (`gather`, `gather_backward`).
// gather: `x` contiguous with dims `x_dims`, `index` (i64) and `out` contiguous with dims
// `index_dims` (same rank, no larger than `x_dims` except along `dim`), passed in `GatherArgs`;
// `out[p] = x[p with coordinate dim replaced by index[p]]`. Viewing the index as
// `[outer, n, inner]` around `dim`: the backward has one thread per (o, i) pair, which adds
// `dout[o, j, i]` into `dx[xo, index[o, j, i], xi]` for j increasing. Different (o, i) pairs touch
// disjoint `dx` elements, so there are no atomics and the order is the CPU's (increasing position
// along `dim`): deterministic.
// Backward outputs `dx` are accumulators (not zeroed first) of the compute type: f32 for f32, bf16
// and f16, f64 for f64. An index
// out of range is skipped (forward: writes 0) and its flat position recorded in `*bad` with
// atomicMin (the launcher sets ~0 before, checks after; the CPU checks before writing).

#define G_MAX_DIMS 8
struct GatherArgs {
    i64 x_dims[G_MAX_DIMS];
    i64 index_dims[G_MAX_DIMS];
    int ndim;
    int dim;
};

// Offset in `x` of the element at index coordinates (o, *, i) with coordinate `dim` set to 0,
// plus the stride of `dim` in `x` (returned through `xstride`).
__device__ __forceinline__ i64 gather_x_base(const GatherArgs &g, i64 o, i64 i, i64 *xstride) {
    // inner part: unravel i over index_dims[dim+1..], ravel over x_dims[dim+1..]
    i64 off = 0, mul = 1;
    for (int d = g.ndim - 1; d > g.dim; --d) {
        const i64 c = i % g.index_dims[d];
        i /= g.index_dims[d];
        off += c * mul;
        mul *= g.x_dims[d];
    }
    *xstride = mul;
    mul *= g.x_dims[g.dim];
    for (int d = g.dim - 1; d >= 0; --d) {
        const i64 c = o % g.index_dims[d];
        o /= g.index_dims[d];
        off += c * mul;
        mul *= g.x_dims[d];
    }
    return off;
}

__device__ __forceinline__ void gather_sizes(const GatherArgs &g, i64 *outer, i64 *n, i64 *inner) {
    i64 a = 1, b = 1;
    for (int d = 0; d < g.dim; ++d) a *= g.index_dims[d];
    for (int d = g.dim + 1; d < g.ndim; ++d) b *= g.index_dims[d];
    *outer = a;
    *n = g.index_dims[g.dim];
    *inner = b;
}

template <typename T>
__device__ void gather_impl(GatherArgs g, const T *x, const i64 *index, T *out, u64 *bad) {
    i64 outer, n, inner;
    gather_sizes(g, &outer, &n, &inner);
    const i64 xn = g.x_dims[g.dim];
    MG_GRID_STRIDE(p, outer * n * inner) {
        const i64 i = p % inner, o = p / (n * inner);
        i64 xs;
        const i64 base = gather_x_base(g, o, i, &xs);
        const i64 id = index[p];
        if (id < 0 || id >= xn) {
            flag_bad(bad, p);
            out[p] = from_float<T>(0.0f);
        } else {
            out[p] = x[base + id * xs];
        }
    }
}

template <typename T, typename A>
__device__ void gather_bwd_impl(GatherArgs g, const T *dout, const i64 *index, A *dx, u64 *bad) {
    i64 outer, n, inner;
    gather_sizes(g, &outer, &n, &inner);
    const i64 xn = g.x_dims[g.dim];
    MG_GRID_STRIDE(q, outer * inner) {
        const i64 o = q / inner, i = q % inner;
        i64 xs;
        const i64 base = gather_x_base(g, o, i, &xs);
        for (i64 j = 0; j < n; ++j) {
            const i64 p = (o * n + j) * inner + i;
            const i64 id = index[p];
            if (id < 0 || id >= xn) {
                flag_bad(bad, p);
                continue;
            }
            dx[base + id * xs] += load(dout, p);
        }
    }
}

// A: the backward's accumulator type (Acc<T>::type), written out for the entry points' signatures.
#define GATHER_ENTRIES(sfx, T, A)                                                                \
    extern "C" __global__ void gather_##sfx(GatherArgs g, const T *x, const i64 *index, T *out, u64 *bad) { \
        gather_impl<T>(g, x, index, out, bad);                                                   \
    }                                                                                            \
    extern "C" __global__ void gather_bwd_##sfx(GatherArgs g, const T *dout, const i64 *index, A *dx, u64 *bad) { \
        gather_bwd_impl<T, A>(g, dout, index, dx, bad);                                          \
    }
GATHER_ENTRIES(f32, float, float)
GATHER_ENTRIES(bf16, __nv_bfloat16, float)
GATHER_ENTRIES(f16, __half, float)
GATHER_ENTRIES(f64, double, double)
