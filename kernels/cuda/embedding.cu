// embedding.cu: embedding lookup (gather rows of a table) and its backward (scatter-add rows).
//
// CPU reference: kernels/src/cpu/embedding.rs (`embedding_forward`, `embedding_backward`).
// Layout: `weight` contiguous `[vocab, dim]`, `ids` i64 `[n]`, `out` / `dout` `[n, dim]`.
// Forward: `out[i] = weight[ids[i]]`, one thread per output element. An id outside `0..vocab`
// writes a zero row and records its position with atomicMin in `*bad` (the launcher sets it to
// ~0 before and raises the error after; the CPU checks before writing anything).
// Backward, two instances, both accumulating into a `dweight` of the compute type (not zeroed
// first; f32, or f64 for f64 data):
// - `embedding_bwd_det_<t>`: deterministic and sort-free. One warp per (id range of `range` ids,
//   tile of 32 columns): its lanes own the tile's columns of the range's rows of `dweight`; the
//   warp scans every position `i` in increasing order (the ids staged through shared memory a
//   block at a time) and adds `dout[i, c]` into `dweight[ids[i], c]` when `ids[i]` is in its
//   range. No two warps write one element, and each element's sum runs in the CPU's order
//   exactly, so with f32 data the sums are bitwise the CPU's. The launcher picks `range` so
//   that there are a few thousand warps (a one-thread-per-column loop over 8192 positions took
//   4.6 ms for GPT-2 124M's two tables per step on an H200). Each warp reads all `n` ids: for
//   very long token batches the atomic instance below is faster.
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

#define EMB_IDS_CHUNK 1024
template <typename T, typename A>
__device__ void embedding_bwd_det_impl(const i64 *ids, const T *dout, A *dweight, i64 n, i64 vocab, i64 dim,
                                       i64 range, u64 *bad) {
    __shared__ i64 chunk[EMB_IDS_CHUNK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const i64 tiles = (dim + 31) / 32, ranges = (vocab + range - 1) / range, work = tiles * ranges;
    // The block's warps take consecutive work items together, so that all of them reach every
    // barrier (a warp past the end still helps stage the ids).
    for (i64 base = (i64)blockIdx.x * nwarps; base < work; base += (i64)gridDim.x * nwarps) {
        const i64 w = base + warp;
        const bool live = w < work;
        const i64 lo = live ? (w / tiles) * range : 0;
        const i64 hi = lo + range < vocab ? lo + range : vocab;
        const i64 c = live ? (w % tiles) * 32 + lane : dim;
        const bool flags = live && w == 0 && lane == 0; // one lane reports out-of-range ids
        for (i64 start = 0; start < n; start += EMB_IDS_CHUNK) {
            const i64 len = n - start < EMB_IDS_CHUNK ? n - start : EMB_IDS_CHUNK;
            __syncthreads();
            for (i64 k = threadIdx.x; k < len; k += blockDim.x) chunk[k] = ids[start + k];
            __syncthreads();
            for (i64 k = 0; k < len; ++k) {
                const i64 id = chunk[k];
                if (id < 0 || id >= vocab) {
                    if (flags) flag_bad(bad, start + k);
                    continue;
                }
                if (id < lo || id >= hi || c >= dim) continue;
                dweight[id * dim + c] += load(dout, (start + k) * dim + c);
            }
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
                                                       i64 vocab, i64 dim, i64 range, u64 *bad) { \
        embedding_bwd_det_impl<T, A>(ids, dout, dweight, n, vocab, dim, range, bad);             \
    }                                                                                            \
    extern "C" __global__ void embedding_bwd_atomic_##sfx(const i64 *ids, const T *dout, A *dweight, i64 n, \
                                                          i64 vocab, i64 dim, u64 *bad) {        \
        embedding_bwd_atomic_impl<T, A>(ids, dout, dweight, n, vocab, dim, bad);                 \
    }
EMB_ENTRIES(f32, float, float)
EMB_ENTRIES(bf16, __nv_bfloat16, float)
EMB_ENTRIES(f16, __half, float)
EMB_ENTRIES(f64, double, double)
