//! Parallel training for meshgrad.
//!
//! * [`comm`]: the [`Communicator`] trait (all_reduce, reduce_scatter, all_gather, broadcast,
//!   send/recv, barrier, sub-groups), each operation returning an asynchronous [`Work`] handle;
//!   the in-process backend (every rank a thread) and its one-call launcher [`run_ranks`].
//! * [`mesh`]: [`DeviceMesh`], named mesh dimensions and the process group along each.
//! * [`ddp`]: data parallelism ([`Ddp`]) with bucketed gradient all-reduce launched from
//!   gradient-ready hooks, `no_sync` gradient accumulation and optional half-precision reduction.
//! * [`sampler`]: which data each data-parallel rank reads.
//! * [`zero`]: sharded data parallelism ([`ShardedDataParallel`]): ZeRO-1, ZeRO-2, ZeRO-3 /
//!   FSDP and hybrid sharding, with a pluggable optimizer (AdamW, SGD or any
//!   `meshgrad_nn::optim::Optimizer`) over each rank's shard, clipping across shards, full state
//!   dicts and a memory report.
//! * [`layout`]: the `--layout` spec ([`ParallelLayout`]: `dp=4`, `zero1=4`, `fsdp=4`,
//!   `hsdp=2x2`, ...).

pub mod comm;
pub mod ddp;
pub mod layout;
pub mod mesh;
pub mod sampler;
pub mod zero;

pub use comm::{
    all_reduce_scalar, run_ranks, run_ranks_each, Communicator, RankCtx, ReduceOp, RunOptions, Work,
};
pub use ddp::{Ddp, DdpConfig};
pub use layout::{ParallelLayout, ZeroStage};
pub use mesh::DeviceMesh;
pub use sampler::{micro_rows, rank_rows, DistributedSampler};
pub use zero::{ShardConfig, ShardTopology, ShardedDataParallel};
