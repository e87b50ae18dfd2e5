//! Parallel training for meshgrad.
//!
//! * [`checkpoint`]: distributed checkpoints: each rank writes its own pieces, one index says
//!   where every piece sits, publication is one atomic rename, and loading reshards to any layout.
//! * [`comm`]: the [`Communicator`] trait (all_reduce, reduce_scatter, all_gather, broadcast,
//!   all_to_all with split sizes, send/recv, barrier, sub-groups), each operation returning an asynchronous [`Work`] handle;
//!   the in-process backend (every rank a thread) and its one-call launcher [`run_ranks`], the
//!   TCP backend (one rank per process, the same bits: [`comm::tcp`]), and MPI and NCCL behind
//!   features.
//! * [`mesh`]: [`DeviceMesh`], named mesh dimensions and the process group along each.
//! * [`ddp`]: data parallelism ([`Ddp`]) with bucketed gradient all-reduce launched from
//!   gradient-ready hooks, `no_sync` gradient accumulation and optional half-precision reduction.
//! * [`sampler`]: which data each data-parallel rank reads.
//! * [`zero`]: sharded data parallelism ([`ShardedDataParallel`]): ZeRO-1, ZeRO-2, ZeRO-3 /
//!   FSDP and hybrid sharding, with a pluggable optimizer (AdamW, SGD or any
//!   `meshgrad_nn::optim::Optimizer`) over each rank's shard, clipping across shards and full
//!   state dicts.
//! * [`tp`]: tensor and sequence parallelism over a communicator (the plans, styles and layers
//!   are in `meshgrad_nn::tp`).
//! * [`layout`]: the `--layout` spec ([`ParallelLayout`]): comma-separated degrees `dp=R`,
//!   `fsdp=S` / `zero1=S` / `zero2=S` / `zero3=S`, `hsdp=RxS` (= `dp=R,fsdp=S`), `tp=T` and
//!   `pp=P` in any combination, e.g. `dp=4`, `fsdp=4`, `hsdp=2x2`, `dp=2,zero1=2`, `dp=2,tp=2`,
//!   `dp=2,tp=2,pp=2`.
//! * [`layout_mesh`]: [`LayoutMesh`], a layout's [`DeviceMesh`] (`["pp", "dp_replicate",
//!   "dp_shard", "tp"]`) on one rank, handing out the data-parallel, tensor-parallel and pipeline
//!   groups and the [`ShardTopology`] of sharded data parallelism.
//! * [`memory_report`]: per-rank peak bytes of parameters, gradients, optimizer state and
//!   activations of a GPT trained under any layout (DDP, ZeRO-1/2/3, tensor and sequence
//!   parallelism and their compositions), beside the theory's figures.
//! * [`pipeline`]: pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved 1F1B,
//!   ZB-H1-style zero bubble), a simulator that checks them (dependencies, grouped rendezvous
//!   transfers, deadlocks) and gives their bubble and peak activations, a per-layer profiler and
//!   [`pipeline::partition`], which cuts a model into stages from the profile
//!   (`--partition auto|speed|memory|even|B0,B1,...`), the executor ([`pipeline::execute()`]) that
//!   runs any schedule on a model's stages over the pipeline group, forward-only evaluation, and
//!   per-rank timelines written as Chrome traces.
//! * [`metrics`] and [`compare`]: a training run's metrics file (one JSON line per step), and
//!   the lockstep check across layouts: runs' losses and final weights against a reference run's.

pub mod checkpoint;
pub mod comm;
pub mod compare;
pub mod ddp;
pub mod expert_dp;
pub mod grad_tree;
pub mod launch;
pub mod layout;
pub mod layout_mesh;
pub mod memory_report;
pub mod mesh;
pub mod metrics;
pub mod pipeline;
pub mod plan;
pub mod sampler;
pub mod strategy;
mod strategy_checkpoint;
pub mod tp;
pub mod zero;

pub use comm::{
    all_reduce_scalar, all_to_all_splits, run_ranks, run_ranks_each, Communicator, RankCtx,
    ReduceOp, RunOptions, Work,
};
pub use ddp::{Ddp, DdpConfig};
pub use expert_dp::ExpertDataParallel;
pub use layout::{ParallelLayout, ZeroStage};
pub use layout_mesh::LayoutMesh;
pub use mesh::DeviceMesh;
pub use sampler::{micro_rows, rank_rows};
pub use strategy::{DataParallel, ScaledStep};
pub use zero::{ShardConfig, ShardTopology, ShardedDataParallel};
