//! Communicators: collectives and point-to-point messages between ranks, each returning an
//! asynchronous [`Work`] handle so communication overlaps compute.
//!
//! # Guarantees of every backend
//!
//! These hold for the in-process backend, the TCP backend, the MPI backend (feature `mpi`), the
//! NCCL backend (feature `nccl`) and any backend added later; code that uses a [`Communicator`] may rely on them and on nothing more.
//!
//! * **Ranks and groups.** A communicator is one rank's handle on a group of ranks. `rank()` is
//!   this rank's index in the group (`0..world_size()`), and `ranks()` lists the members' global
//!   ranks in group order. [`Communicator::new_group`] makes a sub-group over some members; the
//!   members must create the groups they share in the same order.
//! * **Matching.** Collectives on one group match by call order: the k-th collective a rank
//!   launches on a group meets the k-th collective of every other member (its *sequence number*
//!   k, counted from 0, which errors quote). Every member must issue the same collectives in the
//!   same order, with the same shape, dtype, reduce op and root. Collectives on different groups
//!   proceed independently. Point-to-point messages match per ordered pair (sender, receiver) in
//!   send order; [`Communicator::batch_p2p`] posts several at once (a group, for pipelines).
//! * **Results.** Every rank of an all-reduce, all-gather or broadcast receives the same values
//!   up to the reduction's rounding (see *per-backend behaviour* for when the bits are equal).
//!   f32 and f64 accumulate in their own type, integers add with wrap-around, and
//!   [`ReduceOp::Avg`] is the sum divided by the group size (float dtypes only; integers are an
//!   error on every backend). All-gather, broadcast and all-to-all move values unchanged, bit
//!   for bit, on every backend.
//! * **Shapes.** `reduce_scatter` takes a tensor whose leading dimension is divisible by the
//!   group size (a flat 1-D buffer of length divisible by it is the common case) and returns this
//!   rank's block of the reduced tensor: rows `[r * n / w, (r + 1) * n / w)` of dimension 0.
//!   `all_gather` concatenates the members' tensors (all of one shape) along dimension 0 in rank
//!   order (a 0-d tensor gathers to shape `[w]`). `broadcast` takes a tensor of the same shape
//!   and dtype on every rank (only the root's values are used) and returns the root's values.
//!   `all_to_all` splits each rank's tensor along dimension 0 into one block per rank (uneven
//!   and empty blocks allowed: `send_splits[j]` rows go to rank `j`) and returns the blocks the
//!   members sent this rank, concatenated along dimension 0 in rank order (`recv_splits[i]`
//!   rows from rank `i`); the other dimensions and the dtype are the same on every rank, and
//!   rank `i`'s `send_splits[j]` must equal rank `j`'s `recv_splits[i]`
//!   ([`all_to_all_splits`] computes the receive splits from the send splits).
//! * **Ownership.** Inputs are copied at launch, so the caller may reuse or modify them while the
//!   operation is in flight; results are fresh tensors owned by the receiving rank (charged to
//!   the allocation tracker active on the thread that calls [`Work::wait`]).
//! * **Sends may rendezvous.** A send's handle may complete only once the receiver has posted the
//!   matching receive (MPI and NCCL do this for large messages). A schedule must not wait for a
//!   send before posting the receives its peer waits for; post both in one
//!   [`Communicator::batch_p2p`] instead.
//! * **Failures are errors, not hangs.** An operation fails when a peer does not join within the
//!   backend's timeout (the watchdog; `--collective-timeout`, default 300 s), when a peer failed
//!   or exited (where the backend can know), or on an invalid argument. The error is an
//!   [`Error::Comm`](meshgrad_tensor::Error::Comm) whose [`CommError`](meshgrad_tensor::CommError)
//!   names the reporting rank, the group (global ranks), the call and its sequence number, and
//!   the kind ([`CommErrorKind`](meshgrad_tensor::CommErrorKind)): `Timeout` with the missing
//!   ranks, `PeerFailed`, `PeerExited`, `Mismatch`, `Invalid`, `Backend`. Its text reads
//!   `rank 0: all_reduce #17 on group [0,1,2,3]: rank 3 did not join within 5s (it is at
//!   all_reduce #16)`. After a failure the run is over: a backend need not be usable afterwards
//!   (the MPI backend stops and ends the job; see its docs).
//! * **Asynchronous handles.** Launching returns a [`Work`] at once; [`Work::wait`] blocks until
//!   the result is ready, [`Work::is_completed`] polls. The contract a device backend (NCCL) must
//!   meet through [`Pending`]: launching enqueues the operation on a communication stream after
//!   an event recorded on the caller's compute stream (so it reads inputs the compute stream
//!   produced), and completion may be *stream-ordered*: `wait` records an event on the
//!   communication stream and makes the caller's compute stream wait on it, returning a tensor
//!   whose later uses are ordered after the collective without blocking the host; errors found
//!   later (a watchdog timeout, an aborted communicator) surface on the next call or `wait`.
//!   `is_completed` answers whether that event has completed. The input buffer must stay alive
//!   until the operation has finished on the stream (the backend holds a reference).
//!
//! # Per-backend behaviour
//!
//! * **In-process** ([`InProcessComm`], ranks are threads): reductions combine contributions in
//!   increasing group-rank order, `((x0 + x1) + x2) + x3`, and every rank receives the same
//!   bits, so a run is bit-for-bit repeatable; bf16 and f16 accumulate in f32 and are rounded (to
//!   nearest even) once at the end; [`ReduceOp::Avg`] is one correctly rounded division per
//!   element; [`ReduceOp::Max`] propagates NaN. Mismatched collectives (a different op, shape,
//!   dtype, reduce op or root at the same position; two all-to-alls whose ranks disagree on the
//!   rows one sends the other, the rows' trailing shape or the dtype) are detected and name both
//!   calls, and every member's wait fails. Sends are
//!   buffered by default; [`RunOptions::rendezvous_sends`] makes them rendezvous like a real
//!   backend's. A failed, panicked or returned rank fails its peers' operations at once.
//! * **TCP** ([`tcp::TcpCommunicator`], one rank per process, on the CPU): the in-process
//!   backend's order and arithmetic (each rank combines one block of every all-reduce in rank
//!   order), so the same bits on every rank and as with threads; mismatched collectives are
//!   detected and name both calls (for an all-to-all, by the two ranks that disagree: each
//!   message carries what its pair of ranks must agree on); sends are buffered (a reader thread
//!   per connection takes every message as it arrives); a peer whose process exits fails the
//!   waits on it at once.
//! * **MPI** (`mpi::MpiCommunicator`, feature `mpi`, one rank per process): MPI chooses the
//!   reduction algorithm (Open MPI: recursive doubling, rings, ... by message size), so sums are
//!   not combined in rank order and differ in the last bits from the in-process backend's. The
//!   MPI standard treats the predefined operations as associative and commutative, fixes no
//!   order, and only *recommends* (advice to implementors, not a requirement) that the same
//!   arguments in the same order give the same result: equal bits on every rank are not a
//!   promise of the standard, so do not rely on them. bf16 and f16 sums round after every
//!   pairwise addition. Mismatches are not detected (MPI may fail with a truncation error or hang
//!   until the watchdog; an all-to-all whose splits disagree may complete with rows left zero,
//!   fail with MPI's truncation error or break a later collective: see the MPI backend's docs).
//!   The watchdog asks the peers for their progress and names the missing ranks; a rank that
//!   panics ends the job (`MPI_Abort`).
//! * **NCCL** (`nccl::NcclCommunicator`, feature `nccl`, one rank per process and GPU; its
//!   status is in README's Status): ring and tree algorithms reduce in an order that depends on the
//!   topology, the message size, the number of channels and the NCCL version; NCCL documents
//!   neither rank-order reduction nor bit-equal results across ranks or runs, so neither may be
//!   relied on (results equal the in-process backend's only to rounding). bf16 and f16 sums
//!   round after every pairwise addition; `Max` does not promise to propagate NaN. Completion is
//!   stream-ordered as described above; the watchdog aborts the communicator (`ncclCommAbort`)
//!   on timeout but cannot name the missing ranks; groups get their own unique ids through the
//!   store (`ncclCommSplit` would need every rank of the parent, and the trait's `new_group` is
//!   called by the members only). Mismatches are not detected (an all-to-all whose splits
//!   disagree may hang until the watchdog or leave rows unwritten). Operations of one communicator
//!   run in issue order on one stream, so a receive issued before a collective holds the
//!   collective back until its message arrives.
//!
//! # Multi-process jobs
//!
//! [`env`](mod@env) reads a process's rank, world size and local rank from the variables of torchrun (and
//! `meshgrad launch`), Open MPI or Slurm ([`RankEnv`]); [`store`] is the TCP key-value store rank
//! 0 serves at `MASTER_ADDR:MASTER_PORT` for the ranks to rendezvous before a communicator exists
//! ([`rendezvous`]: NCCL's unique ids and message headers travel there). [`backend`] names the
//! backends and picks the default one from the device and the environment.
//!
//! # Debugging hangs
//!
//! [`flight`] is the flight recorder every backend's calls go through: each rank keeps its last
//! calls and dumps them on a watchdog timeout (and when the caller asks: SIGUSR1, a failed rank),
//! and [`flight::analyse`] names the rank that is behind and the first call the ranks disagree on.

pub mod backend;
mod call;
pub mod env;
pub mod flight;
mod in_process;
mod launcher;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod reduce;
pub mod rendezvous;
pub mod store;
pub mod tcp;
pub mod tree;
mod work;

pub use backend::{default_backend, Backend};
pub use env::{EnvSource, RankEnv};
pub use in_process::InProcessComm;
pub use launcher::{run_ranks, run_ranks_each, RankCtx, RunOptions};
pub use tree::TreeReduce;
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

    /// Exchanges rows of dimension 0 between every pair of ranks: `tensor`'s rows are split in
    /// rank order into blocks of `send_splits[j]` rows, block `j` going to group rank `j` (this
    /// rank's own block included), and the result concatenates along dimension 0 the blocks
    /// received from ranks `0..world_size()` in rank order, `recv_splits[i]` rows from rank `i`
    /// (shape `[sum(recv_splits), ...]`, the input's other dimensions). Splits may be uneven
    /// or zero. Every rank passes a tensor of the same dtype and trailing dimensions, and rank
    /// `i`'s `send_splits[j]` equals rank `j`'s `recv_splits[i]` ([`all_to_all_splits`]
    /// exchanges the send splits to get them). Invalid arguments fail at once with
    /// [`CommErrorKind::Invalid`](meshgrad_tensor::CommErrorKind::Invalid): a 0-d tensor, split
    /// lists whose length is not the group size, send splits that do not add up to the
    /// leading dimension. Ranks that disagree fail with a
    /// [`Mismatch`](meshgrad_tensor::CommErrorKind::Mismatch) naming both, where the backend
    /// detects it (see the [module docs](self)).
    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work>;

    /// Completes once every rank of the group has entered the barrier.
    fn barrier(&self) -> Result<Work<()>>;

    /// Posts the sends and receives `ops` as one group, like NCCL's `ncclGroupStart` /
    /// `ncclGroupEnd` or a set of `MPI_Isend` / `MPI_Irecv` posted together, and returns their
    /// handles in the order of `ops`. Every operation is posted before the caller waits for any,
    /// so a batch whose sends and receives pair up with other ranks' batches in any order does
    /// not deadlock even when sends rendezvous (two ranks that send to each other in the same
    /// step, as pipeline schedules do). Messages to one peer, inside and around batches, still
    /// arrive in the order they were posted. The default posts
    /// each operation in order with [`Communicator::send`] and [`Communicator::recv`] (an
    /// invalid operation fails the call after the ones before it were posted); the MPI backend
    /// checks them all, then launches them together.
    fn batch_p2p(&self, ops: Vec<P2pOp>) -> Result<Vec<P2pWork>> {
        ops.into_iter()
            .map(|op| match op {
                P2pOp::Send { tensor, peer } => self.send(&tensor, peer).map(P2pWork::Send),
                P2pOp::Recv { peer } => self.recv(peer).map(P2pWork::Recv),
            })
            .collect()
    }

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

/// One operation of a [`Communicator::batch_p2p`] batch (peers are group ranks).
#[derive(Clone, Debug)]
pub enum P2pOp {
    /// Sends a copy of `tensor` to `peer`.
    Send {
        /// What to send (copied at launch).
        tensor: Tensor,
        /// The receiver's group rank.
        peer: usize,
    },
    /// Receives the next message from `peer`.
    Recv {
        /// The sender's group rank.
        peer: usize,
    },
}

/// The handle of one operation of a [`Communicator::batch_p2p`] batch.
#[derive(Debug)]
pub enum P2pWork {
    /// A send's handle.
    Send(Work<()>),
    /// A receive's handle: the message.
    Recv(Work),
}

/// Checks the members of a group being created by `new_group` on a communicator of `world`
/// ranks, called by group rank `me`: they must be distinct ranks below `world` and include `me`.
/// Returns `me`'s position among them, or the message of the one-line error every backend gives.
pub(crate) fn group_position(
    ranks: &[usize],
    world: usize,
    me: usize,
) -> std::result::Result<usize, String> {
    let mut seen = vec![false; world];
    for &r in ranks {
        if r >= world || std::mem::replace(&mut seen[r], true) {
            return Err(format!(
                "ranks {ranks:?} must be distinct ranks below {world}"
            ));
        }
    }
    ranks.iter().position(|&r| r == me).ok_or_else(|| {
        format!("this rank (group rank {me}) is not among {ranks:?}; only members create a group")
    })
}

/// Sets the peer of an [`Error::Comm`](meshgrad_tensor::Error::Comm) (other errors unchanged).
pub(crate) fn with_peer(e: meshgrad_tensor::Error, peer: usize) -> meshgrad_tensor::Error {
    match e {
        meshgrad_tensor::Error::Comm(c) => {
            meshgrad_tensor::Error::Comm(Box::new(c.with_peer(peer)))
        }
        e => e,
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

/// The line a rank of a multi-process job writes to stderr (in one write) before it aborts the
/// job after a panic, e.g. `rank 1: panicked; aborting the MPI job (MPI_Abort with error code
/// 101)`; [`parse_panic_abort_line`] reads it back, so a launcher can name the rank even when the
/// MPI runtime's own report is lost.
pub fn panic_abort_line(rank: usize, code: i32) -> String {
    format!("rank {rank}: panicked; aborting the MPI job (MPI_Abort with error code {code})")
}

/// The (rank, abort code) of a [`panic_abort_line`], or `None` for any other text.
pub fn parse_panic_abort_line(text: &str) -> Option<(usize, i32)> {
    let (rank, rest) = text
        .strip_prefix("rank ")?
        .split_once(": panicked; aborting the MPI job (MPI_Abort with error code ")?;
    Some((rank.parse().ok()?, rest.strip_suffix(')')?.parse().ok()?))
}

/// All-reduces one f64 value (a loss, a squared norm, a count) across the group and returns the
/// result (the same on every rank).
pub fn all_reduce_scalar(comm: &dyn Communicator, value: f64, op: ReduceOp) -> Result<f64> {
    let t = Tensor::from_vec(vec![value], 1, meshgrad_tensor::Device::Cpu)?;
    Ok(comm.all_reduce(&t, op)?.wait()?.to_vec::<f64>()?[0])
}

/// Sends every rank's named tensors to group rank 0, which returns them all, in rank order
/// (the first copy of a name kept: copies of a replicated tensor are equal); `None` on the other
/// ranks. Collective over `comm`: the pipeline stages' parameters meet on the first stage, the
/// expert-parallel ranks' experts on the first of them. Names travel as a tensor of byte values.
pub fn gather_named(
    comm: &dyn Communicator,
    local: Vec<(String, Tensor)>,
) -> Result<Option<Vec<(String, Tensor)>>> {
    use meshgrad_tensor::Device;
    if comm.world_size() == 1 {
        return Ok(Some(local));
    }
    if comm.rank() != 0 {
        let names: Vec<f32> = local
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join("\n")
            .bytes()
            .map(f32::from)
            .collect();
        let len = names.len();
        comm.send(&Tensor::from_vec(names, len, Device::Cpu)?, 0)?
            .wait()?;
        for (_, t) in &local {
            comm.send(t, 0)?.wait()?;
        }
        return Ok(None);
    }
    let mut all = local;
    for src in 1..comm.world_size() {
        let bytes: Vec<u8> = comm
            .recv(src)?
            .wait()?
            .to_vec::<f32>()?
            .into_iter()
            .map(|b| b as u8)
            .collect();
        let names = String::from_utf8(bytes).map_err(|e| {
            meshgrad_tensor::Error::msg(format!(
                "gather_named on {}: the names from rank {src} are not UTF-8: {e}",
                comm.describe()
            ))
        })?;
        for name in names.split('\n') {
            let t = comm.recv(src)?.wait()?;
            if !all.iter().any(|(n, _)| n == name) {
                all.push((name.to_string(), t));
            }
        }
    }
    Ok(Some(all))
}

/// The receive splits of an all-to-all whose send splits are `send_splits` on every rank (one
/// entry per group rank): element `i` of the result is rank `i`'s `send_splits[rank()]`, the
/// number of rows this rank will receive from rank `i`. Collective (every member calls it at
/// the same point, as a collective): it is one all-to-all of `world_size()` 64-bit counts, the
/// exchange a mixture-of-experts layer makes before moving its tokens.
pub fn all_to_all_splits(comm: &dyn Communicator, send_splits: &[usize]) -> Result<Vec<usize>> {
    let w = comm.world_size();
    if send_splits.len() != w {
        return Err(meshgrad_tensor::Error::comm(
            comm.global_rank(),
            comm.ranks(),
            "all_to_all",
            None,
            meshgrad_tensor::CommErrorKind::Invalid(format!(
                "send_splits has {} entries but the group has {w} ranks",
                send_splits.len()
            )),
        ));
    }
    let counts: Vec<i64> = send_splits
        .iter()
        .map(|&n| {
            i64::try_from(n).map_err(|_| {
                meshgrad_tensor::Error::msg(format!("all_to_all_splits: split {n} exceeds i64"))
            })
        })
        .collect::<Result<_>>()?;
    let t = Tensor::from_vec(counts, w, meshgrad_tensor::Device::Cpu)?;
    let ones = vec![1; w];
    let got = comm.all_to_all(&t, &ones, &ones)?.wait()?.to_vec::<i64>()?;
    Ok(got.into_iter().map(|n| n.max(0) as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_abort_lines_round_trip() {
        let line = panic_abort_line(3, 101);
        assert_eq!(
            line,
            "rank 3: panicked; aborting the MPI job (MPI_Abort with error code 101)"
        );
        assert_eq!(parse_panic_abort_line(&line), Some((3, 101)));
        assert_eq!(parse_panic_abort_line("rank 3: panicked at x.rs"), None);
        assert_eq!(parse_panic_abort_line(&line[..line.len() - 1]), None);
    }
}
