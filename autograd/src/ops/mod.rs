//! Differentiable ops on [`crate::Var`]: each computes its value with a tensor op and records
//! its backward rule beside it.

mod arith;
mod attention;
mod aux_loss;
mod indexing;
mod math;
mod nn;
mod overload;
mod reduce;
mod rms_norm;
mod rotary;
mod shape;
mod swiglu;

pub use nn::DropoutSpec;
