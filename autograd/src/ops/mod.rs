//! Differentiable ops on [`crate::Var`]: each computes its value with a tensor op and records
//! its backward rule beside it.

mod arith;
mod attention;
mod llama;
mod nn;
mod reduce;
mod shape;

pub use nn::DropoutSpec;
