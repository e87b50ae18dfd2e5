// sgd.cu: the SGD-with-momentum update over flat f32 buffers.
//
// CPU reference: kernels/src/cpu/sgd.rs (`sgd_step`).
// Layout: `param`, `buf` flat f32 `[n]` (f32 master weights and optimizer state for
// every model dtype); `grad` `[n]` in f32, bf16 or f16 (suffix = grad type, widened exactly to
// f32); optional `param_bf16` `[n]` (null to skip): the updated parameter rounded to bf16, the
// copy a bf16 model computes with.
// Per element, in f32: `g += wd p`; `buf = g` on the first step else `buf = momentum buf + g`;
// `p -= lr buf`.
// Every multiply and add is an explicit round-to-nearest intrinsic (no fused multiply-add), in
// the CPU's order, so for f32 grads the results are bitwise those of the CPU reference (by
// construction; not yet checked on a GPU). Elementwise: deterministic.

template <typename G>
__device__ void sgd_impl(float *param, const G *grad, float *buf, __nv_bfloat16 *param_bf16, i64 n, float lr,
                         float momentum, float weight_decay, int first_step) {
    MG_GRID_STRIDE(i, n) {
        float p = param[i];
        const float g = __fadd_rn(load(grad, i), __fmul_rn(weight_decay, p));
        const float nb = first_step ? g : __fadd_rn(__fmul_rn(momentum, buf[i]), g);
        buf[i] = nb;
        p = __fsub_rn(p, __fmul_rn(lr, nb));
        param[i] = p;
        if (param_bf16) param_bf16[i] = __float2bfloat16_rn(p);
    }
}

#define SGD_ENTRIES(sfx, G)                                                                      \
    extern "C" __global__ void sgd_grad_##sfx(float *param, const G *grad, float *buf, __nv_bfloat16 *param_bf16, \
                                              i64 n, float lr, float momentum, float weight_decay, int first_step) { \
        sgd_impl<G>(param, grad, buf, param_bf16, n, lr, momentum, weight_decay, first_step);    \
    }
MG_FOR_FLOAT_TYPES(SGD_ENTRIES)
