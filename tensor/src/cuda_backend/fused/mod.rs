//! What the CUDA paths of the fused ops (`ops/fused/<op>/cuda.rs`) share: `elementwise.rs` (the
//! launch and run of the elementwise fused kernels: GELU's backward, SwiGLU, the unary
//! backward), `norm_partials.rs` (the norms' weight-gradient partial sums and the helpers every
//! norm of layer_norm.cu and rms_norm.cu shares). `args.rs` describes
//! launches as plain data (tested against the kernels' signatures without a GPU), `operand.rs`
//! prepares operands (contiguous copies, dtype conversions); `every_launch.rs` (tests) lists one
//! launch of every entry point.
//!
//! `Ok(None)` means "not provided" (the tensor op falls back to a composition of basic ops): f64
//! data everywhere (the kernels are instantiated for f32, bf16 and f16 only).

pub(crate) mod args;
pub(crate) mod elementwise;
#[cfg(test)]
pub(super) mod every_launch;
pub(crate) mod norm_partials;
pub(crate) mod operand;
