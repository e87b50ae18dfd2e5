// embedding.cu: embedding lookup (gather rows of a table) and its backward (scatter-add rows).
//
// CPU reference: kernels/src/cpu/embedding.rs (`embedding_forward`, `embedding_backward`).
// Layout: `weight` contiguous `[vocab, dim]`, `ids` i64 `[n]`, `out` / `dout` `[n, dim]`.
// Forward: `out[i] = weight[ids[i]]`, one thread per output element. An id outside `0..vocab`
// writes a zero row and records its position with atomicMin in `*bad` (the launcher sets it to
// ~0 before and raises the error after; the CPU checks before writing anything).
// Backward, two instances, both accumulating into a `dweight` of the compute type (not zeroed
// first; f32, or f64 for f64 data):
// - `embedding_bwd_det_<t>`: deterministic and sort-free. One thread per column `c`, looping over
//   the positions `i` in increasing order and adding `dout[i, c]` into `dweight[ids[i], c]` —
//   the CPU's order exactly, so with f32 data the sums are bitwise the CPU's. Its parallelism is
//   only `dim` threads; fine for moderate `n`, slow for very long token batches.
// - `embedding_bwd_atomic_<t>`: one thread per `dout` element with atomicAdd: fast, but the
//   order of additions (and so the rounding) varies from run to run: NOT deterministic.
// Out-of-range ids are skipped and flagged as in the forward.

template <typename T>
__device__ void embedding_fwd_impl(const i64 *ids, const T *weight, T *out, i64 n, i64 vocab, i64 dim, u64 *bad) {
    MG_GRID_STRIDE(idx, n * dim) {
        const i64 i = idx / dim, c = idx % dim;
        const i64 id = ids[i];
        if (id < 0 || id >= vocab) {
            if (c == 0) flag_bad(bad, i);
            out[idx] = from_float<T>(0.0f);
        } else {
            out[idx] = weight[id * dim + c];
        }
    }
}

template <typename T, typename A>
__device__ void embedding_bwd_det_impl(const i64 *ids, const T *dout, A *dweight, i64 n, i64 vocab, i64 dim,
                                       u64 *bad) {
    MG_GRID_STRIDE(c, dim) {
        for (i64 i = 0; i < n; ++i) {
            const i64 id = ids[i];
            if (id < 0 || id >= vocab) {
                if (c == 0) flag_bad(bad, i);
                continue;
            }
            dweight[id * dim + c] += load(dout, i * dim + c);
        }
    }
}

template <typename T, typename A>
__device__ void embedding_bwd_atomic_impl(const i64 *ids, const T *dout, A *dweight, i64 n, i64 vocab, i64 dim,
                                          u64 *bad) {
    MG_GRID_STRIDE(idx, n * dim) {
        const i64 i = idx / dim, c = idx % dim;
        const i64 id = ids[i];
        if (id < 0 || id >= vocab) {
            if (c == 0) flag_bad(bad, i);
        } else {
            atomicAdd(dweight + id * dim + c, load(dout, idx));
        }
    }
}

// A: the backward's accumulator type (Acc<T>::type), written out for the entry points' signatures.
#define EMB_ENTRIES(sfx, T, A)                                                                   \
    extern "C" __global__ void embedding_fwd_##sfx(const i64 *ids, const T *weight, T *out, i64 n, i64 vocab, \
                                                   i64 dim, u64 *bad) {                          \
        embedding_fwd_impl<T>(ids, weight, out, n, vocab, dim, bad);                             \
    }                                                                                            \
    extern "C" __global__ void embedding_bwd_det_##sfx(const i64 *ids, const T *dout, A *dweight, i64 n, \
                                                       i64 vocab, i64 dim, u64 *bad) {           \
        embedding_bwd_det_impl<T, A>(ids, dout, dweight, n, vocab, dim, bad);                    \
    }                                                                                            \
    extern "C" __global__ void embedding_bwd_atomic_##sfx(const i64 *ids, const T *dout, A *dweight, i64 n, \
                                                          i64 vocab, i64 dim, u64 *bad) {        \
        embedding_bwd_atomic_impl<T, A>(ids, dout, dweight, n, vocab, dim, bad);                 \
    }
EMB_ENTRIES(f32, float, float)
EMB_ENTRIES(bf16, __nv_bfloat16, float)
EMB_ENTRIES(f16, __half, float)
EMB_ENTRIES(f64, double, double)
