// philox.cuh: the counter-based generator Philox4x32-10 and the uniform and normal values drawn
// from it, shared by random.cu (the fills) and dropout.cu (the dropout masks).
//
// CPU reference: kernels/src/rng.rs (`philox4x32_10`, `uniform`, `normal`). Element `i` of a
// stream uses the Philox block with counter `[lo32(start+i), hi32(start+i), 0, 0]` and key
// `[lo32(seed), hi32(seed)]`, words w0..w3 (w2, w3 unused).
// - uniform: `u = (w0 >> 8) 2^-24` (f32, exact): bitwise the CPU's.
// - normal (f64, as the CPU): `u1 = (w0 + 1) 2^-32`, `u2 = w1 2^-32`,
//   `n = sqrt(-2 ln u1) cos(2π u2)`. CUDA's double log and cos are accurate to about 1 ulp but
//   are not the CPU's libm, so `n` can differ from the CPU's in its last f64 bit.

#define PH_M0 0xD2511F53u
#define PH_M1 0xCD9E8D57u
#define PH_W0 0x9E3779B9u
#define PH_W1 0xBB67AE85u

struct Philox4 {
    u32 w[4];
};

__device__ __forceinline__ Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PH_W0;
            k1 += PH_W1;
        }
        const u32 hi0 = __umulhi(PH_M0, c0), lo0 = PH_M0 * c0;
        const u32 hi1 = __umulhi(PH_M1, c2), lo1 = PH_M1 * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n1 = lo1, n2 = hi0 ^ c3 ^ k1, n3 = lo0;
        c0 = n0;
        c1 = n1;
        c2 = n2;
        c3 = n3;
    }
    Philox4 out = {{c0, c1, c2, c3}};
    return out;
}

__device__ __forceinline__ Philox4 philox_block(u64 seed, u64 index) {
    return philox4x32_10((u32)index, (u32)(index >> 32), 0u, 0u, (u32)seed, (u32)(seed >> 32));
}

__device__ __forceinline__ float philox_uniform(u64 seed, u64 index) {
    return (float)(philox_block(seed, index).w[0] >> 8) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ double philox_normal(u64 seed, u64 index) {
    const Philox4 b = philox_block(seed, index);
    const double two_m32 = 1.0 / 4294967296.0;
    const double u1 = __dmul_rn(__dadd_rn((double)b.w[0], 1.0), two_m32);
    const double u2 = __dmul_rn((double)b.w[1], two_m32);
    const double tau = 6.283185307179586; // std::f64::consts::TAU
    return __dmul_rn(sqrt(__dmul_rn(-2.0, log(u1))), cos(__dmul_rn(tau, u2)));
}
