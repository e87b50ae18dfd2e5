//! The fused ops of the CUDA backend, one file per family: `softmax.rs` (softmax, log-softmax,
//! log-sum-exp), `classifier.rs` (cross-entropy), `norms.rs` (layer norm, RMSNorm),
//! `attention.rs` (flash attention, with `attention/params.rs` building the kernels' layouts),
//! `optimizer.rs` (AdamW, SGD) and `misc.rs` (GELU / SiLU / clamp backward, SwiGLU, rotary
//! embedding). `args.rs` describes launches as plain data (tested against the kernels'
//! signatures without a GPU), `operand.rs` prepares operands (contiguous copies, dtype
//! conversions).
//!
//! `Ok(None)` means "not provided" (the tensor op falls back to a composition of basic ops, or
//! the dispatch reports the op not implemented on CUDA): f64 data everywhere (the kernels are
//! instantiated for f32, bf16 and f16 only) and, for attention, what its kernels do not cover
//! (see `attention.rs`).
//!
//! Status: compiled, not run on a GPU.
#![allow(clippy::too_many_arguments, clippy::type_complexity)]

mod args;
mod attention;
mod classifier;
#[cfg(test)]
pub(super) mod launch_table;
mod misc;
mod norms;
mod operand;
mod optimizer;
mod softmax;

pub(super) use attention::{attention, attention_backward, attention_qkv, attention_qkv_backward};
pub(super) use classifier::{cross_entropy, cross_entropy_backward};
pub(super) use misc::{gelu_backward, rotary_embedding, swiglu, swiglu_backward, unary_backward};
pub(super) use norms::{layer_norm, layer_norm_backward, rms_norm, rms_norm_backward};
pub(super) use optimizer::{adamw, sgd};
pub(super) use softmax::{logsumexp, softmax, softmax_backward};
