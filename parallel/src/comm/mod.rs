//! Communicators: collectives and point-to-point messages between ranks, each returning an
//! asynchronous [`Work`] handle so communication overlaps compute.
//!
//! # Semantics (every backend)
//!
//! * **Ranks and groups.** A communicator is one rank's handle on a group of ranks. `rank()` is
//!   this rank's index in the group (`0..world_size()`), and `ranks()` lists the members' global
//!   ranks in group order. [`Communicator::new_group`] makes a sub-group over some members.
//! * **Matching.** Collectives on one group match by call order: the k-th collective a rank
//!   launches on a group meets the k-th collective of every other member. Every member must issue
//!   the same collectives in the same order; a different op, shape, dtype, reduce op or root at the
//!   same position is an error naming both calls. Collectives on different groups proceed
//!   independently. Point-to-point messages match per ordered pair (sender, receiver) in send
//!   order.
//! * **Reductions** ([`ReduceOp`]) combine contributions elementwise in increasing group-rank
//!   order, `((x0 + x1) + x2) + x3`, and every rank receives the same bits, so a run is
//!   bit-for-bit repeatable. f32 and f64 accumulate in their own type; bf16 and f16 accumulate in
//!   f32 and are rounded (to nearest even) once at the end; integers add with wrap-around.
//!   [`ReduceOp::Avg`] is that sum divided by the group size (one correctly rounded division per
//!   element, which equals multiplying by `1/world` when the size is a power of two); it needs a
//!   float dtype. [`ReduceOp::Max`] propagates NaN.
//! * **Shapes.** `reduce_scatter` takes a tensor whose leading dimension is divisible by the
//!   group size (a flat 1-D buffer of length divisible by it is the common case) and returns this
//!   rank's block of the reduced tensor: rows `[r * n / w, (r + 1) * n / w)` of dimension 0.
//!   `all_gather` concatenates the members' tensors (all of one shape) along dimension 0 in rank
//!   order (a 0-d tensor gathers to shape `[w]`). `broadcast` takes a tensor of the same shape
//!   and dtype on every rank (only the root's values are used) and returns the root's values.
//! * **Ownership.** Inputs are copied at launch, so the caller may reuse or modify them while the
//!   operation is in flight; results are fresh tensors owned by the receiving rank (charged to
//!   the allocation tracker active on the thread that calls [`Work::wait`]).
//! * **Failures.** An operation fails, instead of hanging, when a peer does not join within the
//!   backend's timeout, when a peer failed or exited, or on a mismatch. Messages name the rank,
//!   the call, its sequence number and the group, e.g.
//!   `rank 2: all_reduce #17 on group [0,1,2,3]: rank 3 did not join within 2s`.
//!
//! # Multi-process jobs
//!
//! [`env`](mod@env) reads a process's rank, world size and local rank from the variables of torchrun (and
//! `meshgrad launch`), Open MPI or Slurm ([`RankEnv`]); [`store`] is the TCP key-value store rank
//! 0 serves at `MASTER_ADDR:MASTER_PORT` for the ranks to rendezvous before a communicator exists.

pub mod env;
mod in_process;
mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;
mod reduce;
pub mod store;
mod work;

pub use env::{EnvSource, RankEnv};
pub use in_process::InProcessComm;
pub use launcher::{run_ranks, run_ranks_each, RankCtx, RunOptions};
pub use work::{Pending, Work};

use std::sync::Arc;

use meshgrad_tensor::{Result, Tensor};

/// How contributions are combined (see the module docs for the exact order and rounding).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum in increasing rank order.
    Sum,
    /// The sum divided by the group size (float dtypes only).
    Avg,
    /// Elementwise maximum (NaN propagates).
    Max,
}

impl ReduceOp {
    /// The lowercase name used in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One rank's handle on a group of ranks: collectives, point-to-point messages and sub-groups.
/// Object safe; strategies hold an `Arc<dyn Communicator>`. See the [module docs](self) for the
/// matching, ordering and failure rules every implementation follows.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// The members' global ranks, in group-rank order.
    fn ranks(&self) -> &[usize];

    /// This rank's global rank.
    fn global_rank(&self) -> usize {
        self.ranks()[self.rank()]
    }

    /// Combines `tensor` across the group with `op`; every rank gets the same result.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work>;

    /// Combines `tensor` across the group with `op` and returns this rank's block of dimension 0
    /// (the leading dimension must be divisible by the group size).
    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work>;

    /// Concatenates every rank's `tensor` along dimension 0 in rank order.
    fn all_gather(&self, tensor: &Tensor) -> Result<Work>;

    /// The values of `root`'s `tensor` (group rank), on every rank. Every rank passes a tensor of
    /// the same shape and dtype; copy the result into it for an in-place broadcast.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work>;

    /// Sends a copy of `tensor` to group rank `dst`. The in-process backend buffers sends by
    /// default (the handle completes at once and the message waits for the matching
    /// [`Communicator::recv`]); with [`RunOptions::rendezvous_sends`] the handle completes only
    /// when the receiver has taken the message, as a large send on NCCL or MPI does.
    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>>;

    /// Receives the next message from group rank `src` (messages from one sender arrive in the
    /// order they were sent).
    fn recv(&self, src: usize) -> Result<Work>;

    /// Completes once every rank of the group has entered the barrier.
    fn barrier(&self) -> Result<Work<()>>;

    /// A communicator over the members `ranks` (group ranks of this communicator, in the order
    /// that defines the new group's ranks). Called by exactly those members, not collectively:
    /// members that call it with the same `ranks` and `tag` the same number of times get the same
    /// groups (the n-th call of each member joins the same group). `tag` distinguishes groups
    /// that have the same members but different purposes.
    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>>;

    /// A short description of the group for messages, e.g. `[0,1,2,3]` (global ranks).
    fn describe(&self) -> String {
        format_ranks(self.ranks())
    }
}

/// Formats global ranks as `[0,1,2,3]`.
pub fn format_ranks(ranks: &[usize]) -> String {
    let parts: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    format!("[{}]", parts.join(","))
}

impl std::fmt::Debug for dyn Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(rank {} of group {})",
            self.rank(),
            self.describe()
        )
    }
}

/// All-reduces one f64 value (a loss, a squared norm, a count) across the group and returns the
/// result (the same on every rank).
pub fn all_reduce_scalar(comm: &dyn Communicator, value: f64, op: ReduceOp) -> Result<f64> {
    let t = Tensor::from_vec(vec![value], 1, meshgrad_tensor::Device::Cpu)?;
    Ok(comm.all_reduce(&t, op)?.wait()?.to_vec::<f64>()?[0])
}
