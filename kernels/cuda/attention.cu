// attention.cu: fused scaled dot-product attention, flash style, forward and backward.
//
// CPU reference: kernels/src/cpu/attention/ (`attention_forward_strided`,
// `attention_backward_strided`; mask semantics of `ScoreMask` in mask.rs, key padding only —
// the additive bias is not implemented here).
// Layout: every operand is addressed through a `HeadLayout` as on the CPU: element c of row t of
// batch-head bh = b * heads + h is at `offset + b batch_stride + h head_stride + t row_stride + c`
// (so q, k, v can be read straight from a fused [B, T, 3C] projection). `lse` and `delta` are
// contiguous f32 [batch_heads, seq_q]. `key_padding` (null = none) is u8 [batch, seq_k] with
// batch = bh / mask_heads: nonzero = the key may be attended to.
// Scores `z_ij = scale q_i·k_j` for visible keys (causal: j <= i + seq_k - seq_q, bottom-right
// aligned; and not padded), -inf otherwise. A row with no visible key gets out 0, lse -inf and
// zero gradients, as on the CPU.
// Forward (`attn_fwd_d<D>_<t>`): grid (ceil(seq_q / BQ), batch_heads) (batch_heads <= 65535),
// 128 threads (4 warps). A block keeps BQ query rows in shared memory and streams key/value tiles
// of 32 rows through shared memory; per query row, lane j scores key j of the tile, the warp keeps
// the online-softmax running max m and sum l, and each lane accumulates D/32 output columns
// (rescaled by exp(m_old - m_new) when the max grows). Key tiles past the causal limit of the
// block's last row are skipped. Writes out = acc / l and lse = m + ln l. No [T, T] matrix exists.
// Backward (FlashAttention-2 recomputation, no atomics, deterministic):
//   `attn_bwd_delta_<t>`: delta_i = dout_i · out_i (one warp per row).
//   `attn_bwd_dq_d<D>_<t>`: grid (ceil(seq_q / BQ), batch_heads), 128 threads; per query row,
//     P_ij = exp(z_ij - lse_i), dS_ij = scale P_ij (dout_i·v_j - delta_i), dq_i = Σ_j dS_ij k_j.
//   `attn_bwd_dkdv_d<D>_<t>`: grid (ceil(seq_k / BKB), batch_heads), 128 threads; each warp owns
//     BKB/4 keys and streams query tiles of 32 rows: dv_j = Σ_i P_ij dout_i, dk_j = Σ_i dS_ij q_i.
//   dq, dk, dv are overwritten (layouts 5, 6, 7). Each gradient element is summed by one thread in
//   a fixed order, so results are identical run to run; the order differs from the CPU's.
// Arithmetic: inputs widened to f32 in shared memory, all accumulation in f32 (expf, fused
// multiply-adds): equal to the CPU reference to rounding, not bitwise.
// Head dims 64 and 128. This is a straightforward CUDA-core (FMA) version without tensor-core
// MMA, far from peak (about 6 TFLOP/s on an H200: benches/README.md). Its logic is also checked
// on the CPU under the host emulation in kernels/cuda/emu (t_attn.cpp).

struct HeadLayout {
    i64 offset, batch_stride, head_stride, row_stride;
};
// Mirrored by `AttnParams` in kernels/src/cuda/abi.rs.
struct AttnParams {
    HeadLayout layouts[8]; // q, k, v, out, dout, dq, dk, dv
    i64 batch_heads, seq_q, seq_k;
    int heads, mask_heads, causal;
    float scale;
};

__device__ __forceinline__ i64 head_row(const HeadLayout &L, int heads, i64 bh, i64 t) {
    return L.offset + (bh / heads) * L.batch_stride + (bh % heads) * L.head_stride + t * L.row_stride;
}

#define ATT_NW 4
#define ATT_BK 32

// ---------------------------------------------------------------- forward
template <typename T, int D>
__device__ void attn_fwd_impl(const T *q, const T *k, const T *v, T *out, float *lse, const u8 *key_padding,
                              const AttnParams &P) {
    constexpr int BQ = D >= 128 ? 16 : 32, R = BQ / ATT_NW, DPL = D / 32;
    __shared__ float Qs[BQ][D];
    __shared__ float Ks[ATT_BK][D + 1];
    __shared__ float Vs[ATT_BK][D];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 bh = blockIdx.y, q0 = (i64)blockIdx.x * BQ, sq = P.seq_q, sk = P.seq_k;
    if (q0 >= sq) return;
    const HeadLayout Lq = P.layouts[0], Lk = P.layouts[1], Lv = P.layouts[2], Lo = P.layouts[3];
    for (int e = threadIdx.x; e < BQ * D; e += blockDim.x) {
        const int r = e / D, c = e % D;
        const i64 t = q0 + r;
        Qs[r][c] = t < sq ? load(q, head_row(Lq, P.heads, bh, t) + c) : 0.0f;
    }
    float acc[R][DPL], m[R], l[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        m[rr] = MG_NEG_INF;
        l[rr] = 0.0f;
#pragma unroll
        for (int t = 0; t < DPL; ++t) acc[rr][t] = 0.0f;
    }
    const i64 shift = sk - sq;
    const i64 last_q = (q0 + BQ < sq ? q0 + BQ : sq) - 1;
    i64 k_end = sk;
    if (P.causal && last_q + shift + 1 < k_end) k_end = last_q + shift + 1;
    const u8 *kp = key_padding ? key_padding + (bh / P.mask_heads) * sk : nullptr;
    for (i64 k0 = 0; k0 < k_end; k0 += ATT_BK) {
        __syncthreads(); // the previous tile is consumed (first pass: Qs is written)
        for (int e = threadIdx.x; e < ATT_BK * D; e += blockDim.x) {
            const int r = e / D, c = e % D;
            const i64 j = k0 + r;
            Ks[r][c] = j < sk ? load(k, head_row(Lk, P.heads, bh, j) + c) : 0.0f;
            Vs[r][c] = j < sk ? load(v, head_row(Lv, P.heads, bh, j) + c) : 0.0f;
        }
        __syncthreads();
        const i64 j = k0 + lane;
        const bool key_ok = j < sk && (kp == nullptr || kp[j] != 0);
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            const int qr = warp * R + rr;
            const i64 i = q0 + qr;
            if (i >= sq) continue; // uniform over the warp
            const bool vis = key_ok && (!P.causal || j <= i + shift);
            float s = MG_NEG_INF;
            if (vis) {
                float d = 0.0f;
#pragma unroll 16
                for (int c = 0; c < D; ++c) d += Qs[qr][c] * Ks[lane][c];
                s = d * P.scale;
            }
            const float tmax = warp_max(s);
            if (tmax == MG_NEG_INF) continue; // nothing visible in this tile (uniform)
            const float mnew = fmaxf(m[rr], tmax);
            const float alpha = expf(m[rr] - mnew); // 0 when m was -inf
            const float p = vis ? expf(s - mnew) : 0.0f;
            l[rr] = l[rr] * alpha + warp_sum(p);
            m[rr] = mnew;
#pragma unroll
            for (int t = 0; t < DPL; ++t) acc[rr][t] *= alpha;
            for (int jj = 0; jj < ATT_BK; ++jj) {
                const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
                for (int t = 0; t < DPL; ++t) acc[rr][t] += pj * Vs[jj][lane + 32 * t];
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        const i64 i = q0 + warp * R + rr;
        if (i >= sq) continue;
        const i64 o = head_row(Lo, P.heads, bh, i);
        const bool any = l[rr] > 0.0f;
        const float inv = any ? 1.0f / l[rr] : 0.0f;
#pragma unroll
        for (int t = 0; t < DPL; ++t) store(out, o + lane + 32 * t, acc[rr][t] * inv);
        if (lane == 0) lse[bh * sq + i] = any ? m[rr] + logf(l[rr]) : MG_NEG_INF;
    }
}

// ---------------------------------------------------------------- backward: delta
template <typename T>
__device__ void attn_bwd_delta_impl(const T *out, const T *dout, float *delta, const AttnParams &P, i64 head_dim) {
    const int lane = threadIdx.x & 31;
    const i64 warps_total = (i64)gridDim.x * (blockDim.x >> 5);
    const HeadLayout Lo = P.layouts[3], Ld = P.layouts[4];
    for (i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; row < P.batch_heads * P.seq_q;
         row += warps_total) {
        const i64 bh = row / P.seq_q, i = row % P.seq_q;
        const i64 oo = head_row(Lo, P.heads, bh, i), od = head_row(Ld, P.heads, bh, i);
        float s = 0.0f;
        for (i64 c = lane; c < head_dim; c += 32) s += load(out, oo + c) * load(dout, od + c);
        s = warp_sum(s);
        if (lane == 0) delta[row] = s;
    }
}

// ---------------------------------------------------------------- backward: dq
template <typename T, int D>
__device__ void attn_bwd_dq_impl(const T *q, const T *k, const T *v, const T *dout, const float *lse,
                                 const float *delta, T *dq, const u8 *key_padding, const AttnParams &P) {
    constexpr int BQ = D >= 128 ? 8 : 16, R = BQ / ATT_NW, DPL = D / 32;
    __shared__ float Qs[BQ][D];
    __shared__ float dOs[BQ][D];
    __shared__ float Ks[ATT_BK][D + 1];
    __shared__ float Vs[ATT_BK][D + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 bh = blockIdx.y, q0 = (i64)blockIdx.x * BQ, sq = P.seq_q, sk = P.seq_k;
    if (q0 >= sq) return;
    const HeadLayout Lq = P.layouts[0], Lk = P.layouts[1], Lv = P.layouts[2], Ld = P.layouts[4], Ldq = P.layouts[5];
    for (int e = threadIdx.x; e < BQ * D; e += blockDim.x) {
        const int r = e / D, c = e % D;
        const i64 t = q0 + r;
        Qs[r][c] = t < sq ? load(q, head_row(Lq, P.heads, bh, t) + c) : 0.0f;
        dOs[r][c] = t < sq ? load(dout, head_row(Ld, P.heads, bh, t) + c) : 0.0f;
    }
    float acc[R][DPL], rl[R], rd[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        const i64 i = q0 + warp * R + rr;
        rl[rr] = i < sq ? lse[bh * sq + i] : MG_NEG_INF;
        rd[rr] = i < sq ? delta[bh * sq + i] : 0.0f;
#pragma unroll
        for (int t = 0; t < DPL; ++t) acc[rr][t] = 0.0f;
    }
    const i64 shift = sk - sq;
    const i64 last_q = (q0 + BQ < sq ? q0 + BQ : sq) - 1;
    i64 k_end = sk;
    if (P.causal && last_q + shift + 1 < k_end) k_end = last_q + shift + 1;
    const u8 *kp = key_padding ? key_padding + (bh / P.mask_heads) * sk : nullptr;
    for (i64 k0 = 0; k0 < k_end; k0 += ATT_BK) {
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_BK * D; e += blockDim.x) {
            const int r = e / D, c = e % D;
            const i64 j = k0 + r;
            Ks[r][c] = j < sk ? load(k, head_row(Lk, P.heads, bh, j) + c) : 0.0f;
            Vs[r][c] = j < sk ? load(v, head_row(Lv, P.heads, bh, j) + c) : 0.0f;
        }
        __syncthreads();
        const i64 j = k0 + lane;
        const bool key_ok = j < sk && (kp == nullptr || kp[j] != 0);
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            const int qr = warp * R + rr;
            const i64 i = q0 + qr;
            if (i >= sq || rl[rr] == MG_NEG_INF) continue; // uniform over the warp
            const bool vis = key_ok && (!P.causal || j <= i + shift);
            float ds = 0.0f;
            if (vis) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll 16
                for (int c = 0; c < D; ++c) {
                    s += Qs[qr][c] * Ks[lane][c];
                    dp += dOs[qr][c] * Vs[lane][c];
                }
                const float p = expf(s * P.scale - rl[rr]);
                ds = P.scale * p * (dp - rd[rr]);
            }
            for (int jj = 0; jj < ATT_BK; ++jj) {
                const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
                for (int t = 0; t < DPL; ++t) acc[rr][t] += dsj * Ks[jj][lane + 32 * t];
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        const i64 i = q0 + warp * R + rr;
        if (i >= sq) continue;
        const i64 o = head_row(Ldq, P.heads, bh, i);
#pragma unroll
        for (int t = 0; t < DPL; ++t) store(dq, o + lane + 32 * t, acc[rr][t]);
    }
}

// ---------------------------------------------------------------- backward: dk, dv
template <typename T, int D>
__device__ void attn_bwd_dkdv_impl(const T *q, const T *k, const T *v, const T *dout, const float *lse,
                                   const float *delta, T *dk, T *dv, const u8 *key_padding, const AttnParams &P) {
    constexpr int RK = D >= 128 ? 2 : 4, BKB = RK * ATT_NW, DPL = D / 32, BQ = 32;
    __shared__ float Kb[BKB][D];
    __shared__ float Vb[BKB][D];
    __shared__ float Qs[BQ][D + 1];
    __shared__ float dOs[BQ][D + 1];
    __shared__ float ls[BQ], dl[BQ];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 bh = blockIdx.y, kb0 = (i64)blockIdx.x * BKB, sq = P.seq_q, sk = P.seq_k;
    if (kb0 >= sk) return;
    const HeadLayout Lq = P.layouts[0], Lk = P.layouts[1], Lv = P.layouts[2], Ld = P.layouts[4];
    const HeadLayout Ldk = P.layouts[6], Ldv = P.layouts[7];
    for (int e = threadIdx.x; e < BKB * D; e += blockDim.x) {
        const int r = e / D, c = e % D;
        const i64 j = kb0 + r;
        Kb[r][c] = j < sk ? load(k, head_row(Lk, P.heads, bh, j) + c) : 0.0f;
        Vb[r][c] = j < sk ? load(v, head_row(Lv, P.heads, bh, j) + c) : 0.0f;
    }
    const u8 *kp = key_padding ? key_padding + (bh / P.mask_heads) * sk : nullptr;
    float gk[RK][DPL], gv[RK][DPL];
#pragma unroll
    for (int rk = 0; rk < RK; ++rk)
#pragma unroll
        for (int t = 0; t < DPL; ++t) gk[rk][t] = gv[rk][t] = 0.0f;
    const i64 shift = sk - sq;
    // Causal: key j is seen by queries i >= j - shift; the block's first key bounds the start.
    i64 q_start = 0;
    if (P.causal && kb0 - shift > 0) q_start = ((kb0 - shift) / BQ) * BQ;
    for (i64 q0 = q_start; q0 < sq; q0 += BQ) {
        __syncthreads(); // previous tile consumed (first pass: Kb/Vb written)
        for (int e = threadIdx.x; e < BQ * D; e += blockDim.x) {
            const int r = e / D, c = e % D;
            const i64 i = q0 + r;
            Qs[r][c] = i < sq ? load(q, head_row(Lq, P.heads, bh, i) + c) : 0.0f;
            dOs[r][c] = i < sq ? load(dout, head_row(Ld, P.heads, bh, i) + c) : 0.0f;
        }
        if (threadIdx.x < BQ) {
            const i64 i = q0 + threadIdx.x;
            ls[threadIdx.x] = i < sq ? lse[bh * sq + i] : MG_NEG_INF;
            dl[threadIdx.x] = i < sq ? delta[bh * sq + i] : 0.0f;
        }
        __syncthreads();
        const i64 i = q0 + lane;
        const float li = ls[lane], di = dl[lane];
#pragma unroll
        for (int rk = 0; rk < RK; ++rk) {
            const int kr = warp * RK + rk;
            const i64 j = kb0 + kr;
            if (j >= sk || (kp != nullptr && kp[j] == 0)) continue; // uniform over the warp
            const bool vis = i < sq && li != MG_NEG_INF && (!P.causal || j <= i + shift);
            float p = 0.0f, ds = 0.0f;
            if (vis) {
                float s = 0.0f, dp = 0.0f;
#pragma unroll 16
                for (int c = 0; c < D; ++c) {
                    s += Qs[lane][c] * Kb[kr][c];
                    dp += dOs[lane][c] * Vb[kr][c];
                }
                p = expf(s * P.scale - li);
                ds = P.scale * p * (dp - di);
            }
            for (int ii = 0; ii < BQ; ++ii) {
                const float pi = __shfl_sync(0xffffffffu, p, ii);
                const float dsi = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
                for (int t = 0; t < DPL; ++t) {
                    gv[rk][t] += pi * dOs[ii][lane + 32 * t];
                    gk[rk][t] += dsi * Qs[ii][lane + 32 * t];
                }
            }
        }
    }
#pragma unroll
    for (int rk = 0; rk < RK; ++rk) {
        const i64 j = kb0 + warp * RK + rk;
        if (j >= sk) continue;
        const i64 ok = head_row(Ldk, P.heads, bh, j), ov = head_row(Ldv, P.heads, bh, j);
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
            store(dk, ok + lane + 32 * t, gk[rk][t]);
            store(dv, ov + lane + 32 * t, gv[rk][t]);
        }
    }
}

#define ATTN_D_ENTRIES(sfx, T, D)                                                                \
    extern "C" __global__ void __launch_bounds__(128) attn_fwd_d##D##_##sfx(                     \
        const T *q, const T *k, const T *v, T *out, float *lse, const u8 *key_padding, AttnParams P) { \
        attn_fwd_impl<T, D>(q, k, v, out, lse, key_padding, P);                                  \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dq_d##D##_##sfx(                  \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, T *dq, \
        const u8 *key_padding, AttnParams P) {                                                   \
        attn_bwd_dq_impl<T, D>(q, k, v, dout, lse, delta, dq, key_padding, P);                   \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(128) attn_bwd_dkdv_d##D##_##sfx(                \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta, T *dk, T *dv, \
        const u8 *key_padding, AttnParams P) {                                                   \
        attn_bwd_dkdv_impl<T, D>(q, k, v, dout, lse, delta, dk, dv, key_padding, P);             \
    }
#define ATTN_ENTRIES(sfx, T)                                                                     \
    ATTN_D_ENTRIES(sfx, T, 64)                                                                   \
    ATTN_D_ENTRIES(sfx, T, 128)                                                                  \
    extern "C" __global__ void attn_bwd_delta_##sfx(const T *out, const T *dout, float *delta, AttnParams P, \
                                                    i64 head_dim) {                              \
        attn_bwd_delta_impl<T>(out, dout, delta, P, head_dim);                                   \
    }
MG_FOR_FLOAT_TYPES(ATTN_ENTRIES)
