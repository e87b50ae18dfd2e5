// rotary.cu: rotary position embedding (RoPE), "rotate half" convention (Hugging Face Llama).
//
// CPU reference: kernels/src/cpu/rotary.rs (`rotary_embedding`, `inv_frequencies`).
// Layout: `x`, `out` contiguous `[batch, seq, heads, head_dim]`; `positions` i64 `[seq]`.
// Element `i < D/2` of a head pairs with `i + D/2`; the angle is `a = p · theta^(-2i/D)`, computed
// in f64 as the CPU does (pow, cos and sin in double, each rounded once to f32; CUDA's double
// cos/sin are within 1 ulp of the CPU's libm, so after rounding to f32 they agree except in rare
// ties), then `y_i = x_i cos a - x_{i+D/2} sin a`, `y_{i+D/2} = x_{i+D/2} cos a + x_i sin a` in
// f32 without fused multiply-add (so for f32 data the same roundings as the CPU). `inverse`
// rotates by -a (the backward pass, applied to the output gradient).
// One thread per (row, pair): `head_dim` must be even. `out` may alias `x` (each thread reads
// its pair before writing it).

template <typename T>
__device__ void rotary_impl(const T *x, const i64 *positions, T *out, i64 batch, i64 seq, i64 heads, i64 head_dim,
                            double theta, int inverse) {
    const i64 half = head_dim / 2;
    const i64 pairs = batch * seq * heads * half;
    MG_GRID_STRIDE(idx, pairs) {
        const i64 i = idx % half;
        const i64 row = idx / half; // (b, t, h)
        const i64 t = (row / heads) % seq;
        const double inv = pow(theta, -(double)(2 * i) / (double)head_dim);
        const double a = (double)positions[t] * inv;
        const float c = (float)cos(a);
        const float s = (float)((inverse ? -1.0 : 1.0) * sin(a));
        const i64 base = row * head_dim;
        const float x1 = load(x, base + i), x2 = load(x, base + i + half);
        // Explicit round-to-nearest ops: no fused multiply-add, the same roundings as the CPU.
        store(out, base + i, __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        store(out, base + i + half, __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
}

#define ROTARY_ENTRIES(sfx, T)                                                                   \
    extern "C" __global__ void rotary_##sfx(const T *x, const i64 *positions, T *out, i64 batch, i64 seq, \
                                            i64 heads, i64 head_dim, double theta, int inverse) { \
        rotary_impl<T>(x, positions, out, batch, seq, heads, head_dim, theta, inverse);          \
    }
MG_FOR_FLOAT_TYPES(ROTARY_ENTRIES)
