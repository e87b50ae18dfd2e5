//! What the CUDA paths of the fused ops (`ops/fused/<op>/cuda.rs`) share: `activations.rs` (the
//! launch of activations.cu), `norm_partials.rs` (the norms' weight-gradient partial sums and the helpers every norm of norms.cu shares). `args.rs` describes
//! launches as plain data (tested against the kernels' signatures without a GPU), `operand.rs`
//! prepares operands (contiguous copies, dtype conversions); `every_launch.rs` (tests) lists one
//! launch of every entry point.
//!
//! `Ok(None)` means "not provided" (the tensor op falls back to a composition of basic ops): f64
//! data everywhere (the kernels are instantiated for f32, bf16 and f16 only).

pub(crate) mod activations;
pub(crate) mod args;
#[cfg(test)]
pub(super) mod every_launch;
pub(crate) mod norm_partials;
pub(crate) mod operand;
