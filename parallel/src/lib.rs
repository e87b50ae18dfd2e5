//! Parallel training for meshgrad.
//!
//! * [`comm`]: the [`Communicator`] trait (all_reduce, reduce_scatter, all_gather, broadcast,
//!   send/recv, barrier, sub-groups), each operation returning an asynchronous [`Work`] handle;
//!   the in-process backend (every rank a thread) and its one-call launcher [`run_ranks`].
//! * [`mesh`]: [`DeviceMesh`], named mesh dimensions and the process group along each.

pub mod comm;
pub mod mesh;

pub use comm::{run_ranks, run_ranks_each, Communicator, RankCtx, ReduceOp, RunOptions, Work};
pub use mesh::DeviceMesh;
