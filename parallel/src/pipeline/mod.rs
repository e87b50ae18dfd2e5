//! Pipeline parallelism: splitting a model into stages that run on successive ranks.
//!
//! * [`partition`]: where to cut a model into pipeline stages — a dynamic program over per-layer
//!   costs minimising the slowest stage's time or the largest stage's memory (under an optional
//!   per-stage memory limit), even splits, explicit boundaries and the `--partition` spec.

pub mod partition;
