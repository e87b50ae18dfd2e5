// adamw.cu: the AdamW update over flat f32 buffers.
//
// CPU reference: kernels/src/cpu/adamw.rs (`adamw_step`).
// Layout: `param`, `m`, `v` flat f32 `[n]` (f32 master weights and optimizer state for
// every model dtype); `grad` `[n]` in f32, bf16 or f16 (suffix = grad type, widened exactly to
// f32); optional `param_bf16` `[n]` (null to skip): the updated parameter rounded to bf16, the
// copy a bf16 model computes with.
// The host computes the step constants in f64 and rounds them to f32 exactly as
// `adamw_step` does (decay = 1 - lr wd, b1, b2, 1 - b1, 1 - b2, step_size = lr / (1 - b1^t),
// bc2_sqrt = sqrt(1 - b2^t), eps); per element, in f32: `p *= decay` (if apply_decay),
// `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g g`, `p -= step_size m / (sqrt(v) / bc2_sqrt + eps)`.
// Every multiply and add is an explicit round-to-nearest intrinsic (no fused multiply-add) and
// sqrt/division are IEEE, in
// the CPU's order, so for f32 grads the results are bitwise those of the CPU reference (by
// construction; not yet checked on a GPU). Elementwise: deterministic.

template <typename G>
__device__ void adamw_impl(float *param, const G *grad, float *m, float *v, __nv_bfloat16 *param_bf16, i64 n,
                           float decay, float b1, float b2, float one_minus_b1, float one_minus_b2, float step_size,
                           float bc2_sqrt, float eps, int apply_decay) {
    MG_GRID_STRIDE(i, n) {
        const float g = load(grad, i);
        float p = param[i];
        if (apply_decay) p = __fmul_rn(p, decay);
        const float mv = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(one_minus_b1, g));
        const float vv = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
        m[i] = mv;
        v[i] = vv;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vv), bc2_sqrt), eps);
        p = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, mv), denom));
        param[i] = p;
        if (param_bf16) param_bf16[i] = __float2bfloat16_rn(p);
    }
}

#define ADAMW_ENTRIES(sfx, G)                                                                    \
    extern "C" __global__ void adamw_grad_##sfx(float *param, const G *grad, float *m, float *v,  \
                                                __nv_bfloat16 *param_bf16, i64 n, float decay, float b1, float b2, \
                                                float one_minus_b1, float one_minus_b2, float step_size, \
                                                float bc2_sqrt, float eps, int apply_decay) {    \
        adamw_impl<G>(param, grad, m, v, param_bf16, n, decay, b1, b2, one_minus_b1, one_minus_b2, step_size, \
                      bc2_sqrt, eps, apply_decay);                                               \
    }
MG_FOR_FLOAT_TYPES(ADAMW_ENTRIES)
