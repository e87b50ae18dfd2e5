//! meshgrad: a deep-learning framework written from scratch in Rust, with parallel training
//! built in. This crate re-exports the workspace crates and holds the `meshgrad` CLI's logic
//! (training, evaluation, generation), so it can be driven from code and tests too.

pub mod bench;
pub mod config;
pub mod corpus;
pub mod eval;
pub mod generate;
pub mod train;
pub mod train_parallel;

pub use meshgrad_autograd as autograd;
pub use meshgrad_nn as nn;
pub use meshgrad_parallel as parallel;
pub use meshgrad_tensor as tensor;
