//! What the CUDA paths of the fused ops (`ops/fused/<op>/cuda.rs`) share: `activations.rs` (the
//! launch of activations.cu), `norms.rs` (the helpers of every norm of norms.cu). `args.rs` describes
//! launches as plain data (tested against the kernels' signatures without a GPU), `operand.rs`
//! prepares operands (contiguous copies, dtype conversions); `launch_table.rs` (tests) lists one
//! launch of every entry point.
//!
//! `Ok(None)` means "not provided" (the tensor op falls back to a composition of basic ops): f64
//! data everywhere (the kernels are instantiated for f32, bf16 and f16 only).

pub(crate) mod activations;
pub(crate) mod args;
#[cfg(test)]
pub(super) mod launch_table;
pub(crate) mod norms;
pub(crate) mod operand;
