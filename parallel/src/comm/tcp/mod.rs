//! The TCP backend: one rank per process on the CPU, over plain TCP connections between every
//! pair of ranks (like PyTorch's gloo), for jobs that `meshgrad launch` or torchrun start without
//! MPI.
//!
//! # How it works
//!
//! * **Rendezvous.** Every rank listens on a free port and publishes `host:port` in the job's
//!   [`TcpStore`] (rank 0's, at `MASTER_ADDR:MASTER_PORT`); each rank connects to the lower ranks
//!   and accepts the higher ones. `host` is `MESHGRAD_TCP_HOST` when set, else the address of
//!   the interface that routes to `MASTER_ADDR`, else `127.0.0.1`.
//! * **Messages.** A reader thread per connection files arriving frames into a mailbox by
//!   group, channel and sender, so a sender never waits for its receiver (sends are buffered).
//! * **Collectives** run on one worker thread per group, in launch order, so a launch returns at
//!   once and collectives of different groups proceed independently. An all-reduce splits the
//!   elements into one block per rank: every rank sends block `r` to rank `r`, which combines
//!   the contributions **in increasing rank order**, `((x0 + x1) + x2) + x3`, with the
//!   in-process backend's arithmetic (bf16 and f16 accumulate in f32 and round once; `Avg` is
//!   one correctly rounded division), then sends the result to everyone. Every rank therefore
//!   receives the same bits, and the bits equal the in-process backend's: a job of processes
//!   trains bit for bit like the same layout run as threads. `reduce_scatter` is the first half;
//!   `all_gather`, `broadcast` and `barrier` send straight to every member. `all_to_all` sends
//!   each member its rows and receives theirs over the same connections (rank `r` sends to
//!   `r + 1, r + 2, ...` and receives from `r - 1, r - 2, ...`, modulo the group size, so the
//!   ranks do not all start with the same peer; sends never wait for the receiver, so no
//!   order deadlocks), on the collective's own channel, apart from point-to-point messages.
//! * **Errors.** Every message carries its sender's description of the call, so mismatched
//!   collectives fail with both calls named ([`CommErrorKind::Mismatch`]); an all-to-all's
//!   messages carry what their pair of ranks must agree on (dtype, trailing shape, rows each way),
//!   so both ranks of a pair that disagree fail naming each other. A wait longer than
//!   the timeout fails naming the ranks whose messages did not come
//!   ([`CommErrorKind::Timeout`]); a peer whose connection closed fails the operations that
//!   wait for it ([`CommErrorKind::PeerExited`]).
//! * **Devices.** Tensors on any device are staged through host memory; results come back on the
//!   input's device (a receive's on the CPU).

mod loopback;
mod net;
mod ops;

pub use loopback::run_loopback_ranks;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshgrad_tensor::{CommErrorKind, Device, Error, Result, Tensor};

use self::net::{Channel, Missing, Net};
use self::ops::{Job, Op, Output};
use super::call::{checks, Kind};
use super::env::RankEnv;
use super::store::TcpStore;
use super::{with_peer, Communicator, Pending, ReduceOp, Work};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// FNV-1a: a group's id from its key, the same in every process.
fn group_id(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// What every group of a process shares: the connections and the timeout.
struct Shared {
    net: Net,
    timeout: Duration,
}

/// One group as this rank sees it.
struct Group {
    id: u64,
    key: String,
    /// Global ranks, in group order.
    members: Arc<[usize]>,
    /// Collectives launched on it.
    collectives: AtomicU64,
    /// Messages sent to and received from each group rank.
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
    /// Sub-groups made, by members and tag (the n-th call joins the n-th group).
    made: Mutex<HashMap<String, u64>>,
    /// The worker that runs this group's collectives in launch order (started on first use).
    worker: Mutex<Option<Sender<Job>>>,
}

impl Group {
    fn new(key: String, members: Vec<usize>) -> Group {
        Group {
            id: group_id(&key),
            key,
            members: members.into(),
            collectives: AtomicU64::new(0),
            sent: Mutex::new(HashMap::new()),
            received: Mutex::new(HashMap::new()),
            made: Mutex::new(HashMap::new()),
            worker: Mutex::new(None),
        }
    }

    fn next(map: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
        let mut m = lock(map);
        let c = m.entry(peer).or_insert(0);
        *c += 1;
        *c - 1
    }
}

/// One rank's handle on a group of processes connected over TCP (see the [module docs](self)).
pub struct TcpCommunicator {
    shared: Arc<Shared>,
    group: Arc<Group>,
    rank: usize,
    /// Keeps rank 0's store serving while the job runs.
    _store: Option<Arc<TcpStore>>,
}

impl std::fmt::Debug for TcpCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TcpCommunicator(rank {} of {})",
            self.rank,
            super::format_ranks(&self.group.members)
        )
    }
}

impl TcpCommunicator {
    /// The world communicator of the job `env` describes (torchrun's variables, as `meshgrad
    /// launch` sets them): the ranks meet through `store` (the job's, rank 0's at
    /// `MASTER_ADDR:MASTER_PORT`) and connect to each other within `timeout`, which is also the
    /// limit of every later wait.
    pub fn world(env: &RankEnv, store: Arc<TcpStore>, timeout: Duration) -> Result<Arc<Self>> {
        let host = net::local_host(env.master_addr.as_deref());
        Self::connect(env.rank, env.world_size, &host, store, timeout)
    }

    /// Rank `rank` of a world of `world` ranks that meet through `store`, reachable at `host`.
    pub fn connect(
        rank: usize,
        world: usize,
        host: &str,
        store: Arc<TcpStore>,
        timeout: Duration,
    ) -> Result<Arc<Self>> {
        if rank >= world {
            return Err(Error::msg(format!(
                "tcp backend: rank {rank} is not below the world size {world}"
            )));
        }
        let net = Net::connect(rank, world, host, &store, timeout)?;
        Ok(Arc::new(TcpCommunicator {
            shared: Arc::new(Shared { net, timeout }),
            group: Arc::new(Group::new("world".into(), (0..world).collect())),
            rank,
            _store: Some(store),
        }))
    }

    /// The timeout of every wait.
    pub fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn err(&self, call: &'static str, seq: Option<u64>, kind: CommErrorKind) -> Error {
        Error::comm(self.global_rank(), &self.group.members, call, seq, kind)
    }

    fn invalid(&self, call: &'static str, msg: String) -> Error {
        self.err(call, None, CommErrorKind::Invalid(msg))
    }

    fn check_peer(&self, call: &'static str, peer: usize, role: &str) -> Result<()> {
        checks::peer(call, peer, self.rank, self.world_size(), role)
            .map_err(|m| self.invalid(call, m))
    }

    /// Queues collective `kind` on the group's worker and returns its handle.
    fn launch(&self, kind: Kind, tensor: Option<&Tensor>) -> Result<Work> {
        let name = kind.name();
        let seq = self.group.collectives.fetch_add(1, Ordering::SeqCst);
        let (data, device) = match tensor {
            Some(t) => (Some(t.to_cpu_storage()?), t.device()),
            None => (None, Device::Cpu),
        };
        let op = Op {
            net: self.shared.clone(),
            group: self.group.id,
            members: self.group.members.clone(),
            rank: self.rank,
            seq,
            call: super::call::Call {
                kind,
                tensor: tensor.map(|t| (t.dtype(), t.shape().clone())),
            },
        };
        let done = Arc::new(Done {
            value: Mutex::new(None),
            ready: Condvar::new(),
            device,
        });
        let job: Job = {
            let done = done.clone();
            Box::new(move || done.set(op.run(data)))
        };
        let mut worker = lock(&self.group.worker);
        if worker.is_none() {
            let (tx, rx) = channel::<Job>();
            std::thread::Builder::new()
                .name(format!("meshgrad-tcp-{}", self.group.key))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| {
                    self.err(
                        name,
                        Some(seq),
                        CommErrorKind::Backend(format!("cannot start a worker thread: {e}")),
                    )
                })?;
            *worker = Some(tx);
        }
        worker
            .as_ref()
            .expect("started above")
            .send(job)
            .map_err(|_| {
                self.err(
                    name,
                    Some(seq),
                    CommErrorKind::Backend("the group's worker thread stopped".into()),
                )
            })?;
        Ok(Work::pending(Box::new(done)))
    }
}

/// A collective's result, set once by the worker; the waiting thread makes it a tensor on
/// `device` (the input's).
struct Done {
    value: Mutex<Option<Result<Output>>>,
    ready: Condvar,
    device: Device,
}

impl Done {
    fn set(&self, r: Result<Output>) {
        *lock(&self.value) = Some(r);
        self.ready.notify_all();
    }
}

impl Pending<Tensor> for Arc<Done> {
    fn is_completed(&self) -> bool {
        lock(&self.value).is_some()
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let mut v = lock(&self.value);
        loop {
            if let Some(r) = v.take() {
                let (data, dims) = r?;
                return Tensor::from_cpu(data, dims, self.device);
            }
            v = self.ready.wait(v).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// A receive: the next message from `src` on the group's point-to-point channel.
struct RecvWait {
    shared: Arc<Shared>,
    group: u64,
    members: Arc<[usize]>,
    rank: usize,
    src: usize,
    seq: u64,
}

impl Pending<Tensor> for RecvWait {
    fn is_completed(&self) -> bool {
        self.shared
            .net
            .mailbox
            .has(self.group, Channel::P2p, self.members[self.src])
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let src = self.members[self.src];
        let deadline = Instant::now() + self.shared.timeout;
        let err = |kind| {
            let e = Error::comm(
                self.members[self.rank],
                &self.members,
                "recv",
                Some(self.seq),
                kind,
            );
            with_peer(e, src)
        };
        match self
            .shared
            .net
            .mailbox
            .take(self.group, Channel::P2p, src, deadline)
        {
            Ok(m) => Tensor::from_cpu(m.data, m.dims, Device::Cpu),
            Err(Missing::Timeout) => Err(err(CommErrorKind::Timeout {
                missing: vec![src],
                after: self.shared.timeout,
                detail: None,
            })),
            Err(Missing::Gone(why)) => Err(err(ops::gone(src, why))),
        }
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.members.len()
    }

    fn ranks(&self) -> &[usize] {
        &self.group.members
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        checks::reduce_op(op, tensor.dtype()).map_err(|m| self.invalid("all_reduce", m))?;
        self.launch(Kind::AllReduce(op), Some(tensor))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        checks::reduce_scatter(tensor.shape(), tensor.dtype(), op, self.world_size())
            .map_err(|m| self.invalid("reduce_scatter", m))?;
        self.launch(Kind::ReduceScatter(op), Some(tensor))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        self.launch(Kind::AllGather, Some(tensor))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        checks::root(root, self.world_size()).map_err(|m| self.invalid("broadcast", m))?;
        self.launch(Kind::Broadcast(root), Some(tensor))
    }

    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work> {
        let kind = Kind::all_to_all(tensor.shape(), send_splits, recv_splits, self.world_size())
            .map_err(|m| self.invalid("all_to_all", m))?;
        self.launch(kind, Some(tensor))
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        self.check_peer("send", dst, "destination")?;
        let data = tensor.to_cpu_storage()?;
        let seq = Group::next(&self.group.sent, dst);
        let peer = self.group.members[dst];
        self.shared
            .net
            .send(
                peer,
                self.group.id,
                Channel::P2p,
                "send",
                tensor.dims(),
                (data.dtype(), data.as_bytes()),
            )
            .map_err(|e| {
                with_peer(
                    self.err("send", Some(seq), net::write_error(peer, &e)),
                    peer,
                )
            })?;
        Ok(Work::done(()))
    }

    fn recv(&self, src: usize) -> Result<Work> {
        self.check_peer("recv", src, "source")?;
        let seq = Group::next(&self.group.received, src);
        Ok(Work::pending(Box::new(RecvWait {
            shared: self.shared.clone(),
            group: self.group.id,
            members: self.group.members.clone(),
            rank: self.rank,
            src,
            seq,
        })))
    }

    fn barrier(&self) -> Result<Work<()>> {
        Ok(self.launch(Kind::Barrier, None)?.map(|_| Ok(())))
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let me = super::group_position(ranks, self.world_size(), self.rank)
            .map_err(|m| self.invalid("new_group", m))?;
        let nth = {
            let mut made = lock(&self.group.made);
            let c = made.entry(format!("{tag}{ranks:?}")).or_insert(0);
            *c += 1;
            *c - 1
        };
        let key = super::rendezvous::group_key(&self.group.key, tag, ranks, nth);
        let members: Vec<usize> = ranks.iter().map(|&r| self.group.members[r]).collect();
        Ok(Arc::new(TcpCommunicator {
            shared: self.shared.clone(),
            group: Arc::new(Group::new(key, members)),
            rank: me,
            _store: None,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_ids_depend_on_the_whole_key() {
        let a = group_id(&super::super::rendezvous::group_key(
            "world",
            "dp",
            &[0, 1],
            0,
        ));
        let b = group_id(&super::super::rendezvous::group_key(
            "world",
            "dp",
            &[0, 1],
            1,
        ));
        let c = group_id(&super::super::rendezvous::group_key(
            "world",
            "tp",
            &[0, 1],
            0,
        ));
        assert!(a != b && a != c && b != c);
        assert_eq!(a, group_id("world/dp[0,1]#0"), "stable across processes");
    }
}
