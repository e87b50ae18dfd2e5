//! The fused ops of the CUDA backend not yet moved to `ops/fused/<op>/`, and what the CUDA paths
//! there share: `attention.rs` (flash attention, with `attention/params.rs` building the kernels'
//! layouts), `optimizer.rs` (AdamW, SGD), `activations.rs` (the launch of activations.cu), `norms.rs` (the helpers of every norm of norms.cu). `args.rs`
//! describes launches as plain data (tested against the kernels' signatures without a GPU),
//! `operand.rs` prepares operands (contiguous copies, dtype conversions).
//!
//! Ops moved to `ops/fused/<op>/` keep their CUDA path there (`cuda.rs`, over `args.rs`,
//! `operand.rs` and the shared helpers here); nothing here names them.
//!
//! `Ok(None)` means "not provided" (the tensor op falls back to a composition of basic ops, or
//! the dispatch reports the op not implemented on CUDA): f64 data everywhere (the kernels are
//! instantiated for f32, bf16 and f16 only) and, for attention, what its kernels do not cover
//! (see `attention.rs`).

pub(crate) mod activations;
pub(crate) mod args;
mod attention;
#[cfg(test)]
pub(super) mod launch_table;
pub(crate) mod norms;
pub(crate) mod operand;
mod optimizer;

pub(super) use attention::{attention, attention_backward, attention_qkv, attention_qkv_backward};
pub(super) use optimizer::{adamw, sgd};
