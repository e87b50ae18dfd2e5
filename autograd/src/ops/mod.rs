//! Differentiable ops on [`crate::Var`]: each computes its value with a tensor op and records
//! its backward rule beside it.

mod arith;
mod indexing;
mod math;
mod nn;
mod overload;
mod reduce;
mod shape;

pub use nn::DropoutSpec;
