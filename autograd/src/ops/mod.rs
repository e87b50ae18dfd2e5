//! Differentiable ops on [`crate::Var`]: each computes its value with a tensor op and records
//! its backward rule beside it.

mod arith;
mod attention;
mod aux_loss;
mod cross_entropy;
mod dropout;
mod embedding;
mod indexing;
mod layer_norm;
mod linear;
mod math;
mod matmul;
mod overload;
mod reduce;
mod rms_norm;
mod rotary;
mod shape;
mod softmax;
mod swiglu;

pub use dropout::DropoutSpec;
