//! [`Recorded`]: the communicator every backend's calls go through to reach the flight
//! recorder. It records each call when it is launched and how it ended when its handle is
//! waited for (or dropped), and dumps every recorder of the process when a wait fails on the
//! watchdog's timeout.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use meshgrad_tensor::{CommErrorKind, Error, Result, Tensor};

use super::dump::EntryState;
use super::ring::{now_ms, GroupName, Op, Outcome, Recorder};
use crate::comm::call::{Call, Kind};
use crate::comm::{Communicator, P2pOp, P2pWork, Pending, ReduceOp, Work};

/// Sequence counters of one group, as every backend counts them (see the module docs of
/// [`crate::comm`]): collectives per group; messages per peer and direction.
#[derive(Default)]
struct Counters {
    collectives: u64,
    sent: HashMap<usize, u64>,
    received: HashMap<usize, u64>,
    /// Sub-groups made, by tag and members (the n-th call joins the n-th group).
    made: HashMap<String, u64>,
}

/// A communicator that records every call of the one it wraps into a [`Recorder`]: each call
/// when it is launched, and how it ended when its handle is waited for (or dropped); a wait that
/// fails on the watchdog's timeout dumps every recorder of the process
/// ([`dump_all`](super::dump_all)). Its sub-groups are recorded too.
pub struct Recorded {
    inner: Arc<dyn Communicator>,
    recorder: Arc<Recorder>,
    group: Arc<GroupName>,
    counters: Mutex<Counters>,
}

impl Recorded {
    /// Wraps `inner`, the world (group key `world`), recording into `recorder`.
    pub fn wrap(inner: Arc<dyn Communicator>, recorder: Arc<Recorder>) -> Arc<dyn Communicator> {
        Self::with_key(inner, recorder, "world".into())
    }

    fn with_key(
        inner: Arc<dyn Communicator>,
        recorder: Arc<Recorder>,
        key: String,
    ) -> Arc<dyn Communicator> {
        let group = Arc::new(GroupName {
            key,
            ranks: inner.ranks().into(),
        });
        Arc::new(Recorded {
            inner,
            recorder,
            group,
            counters: Mutex::new(Counters::default()),
        })
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Launches a collective through `launch` and records it; a launch error is recorded as a
    /// failed call (and a watchdog error dumps).
    fn collective<T: Send + 'static>(
        &self,
        call: Call,
        launch: impl FnOnce() -> Result<Work<T>>,
    ) -> Result<Work<T>> {
        let t0 = now_ms();
        let r = launch();
        if !numbered(&r) {
            return r;
        }
        let seq = {
            let mut c = self.counters();
            c.collectives += 1;
            c.collectives - 1
        };
        self.record(seq, Op::Collective(call), t0, r)
    }

    /// Records a launched call and returns its handle, wrapped so that the wait records how it
    /// ended.
    fn record<T: Send + 'static>(
        &self,
        seq: u64,
        op: Op,
        t0: u64,
        r: Result<Work<T>>,
    ) -> Result<Work<T>> {
        let id = self.recorder.launch(&self.group, seq, op, t0);
        match r {
            Ok(work) => Ok(Work::pending(Box::new(Watched {
                work: Some(work),
                recorder: self.recorder.clone(),
                id,
            }))),
            Err(e) => {
                finish(&self.recorder, id, Err(&e));
                Err(e)
            }
        }
    }

    fn next(map: &mut HashMap<usize, u64>, peer: usize) -> u64 {
        let c = map.entry(peer).or_insert(0);
        *c += 1;
        *c - 1
    }

    fn send_op(&self, tensor: &Tensor, dst: usize) -> Op {
        Op::Send {
            peer: self.inner.ranks().get(dst).copied().unwrap_or(dst),
            tensor: (tensor.dtype(), tensor.shape().clone()),
        }
    }

    fn recv_op(&self, src: usize) -> Op {
        Op::Recv {
            peer: self.inner.ranks().get(src).copied().unwrap_or(src),
        }
    }
}

/// Whether a launch took a sequence number: it succeeded, or failed after the backend numbered
/// it (a communication error with a number; invalid arguments are refused before one).
fn numbered<T>(r: &Result<T>) -> bool {
    match r {
        Ok(_) => true,
        Err(Error::Comm(c)) => c.seq.is_some(),
        Err(_) => false,
    }
}

/// Records how call `id` ended; a watchdog timeout (or a peer's failure) dumps every recorder of
/// the process.
fn finish(recorder: &Recorder, id: u64, r: std::result::Result<(), &Error>) {
    let outcome = match r {
        Ok(()) => Outcome {
            state: EntryState::Completed,
            error: None,
            waiting_for: Vec::new(),
        },
        Err(e) => Outcome {
            state: EntryState::Failed,
            error: Some(e.to_string()),
            waiting_for: match e {
                Error::Comm(c) => match &c.kind {
                    CommErrorKind::Timeout { missing, .. } => missing.clone(),
                    _ => Vec::new(),
                },
                _ => Vec::new(),
            },
        },
    };
    recorder.finish(id, outcome);
    if let Err(Error::Comm(c)) = r {
        if matches!(c.kind, CommErrorKind::Timeout { .. }) {
            super::dump_on(&format!("watchdog: {c}"), true);
        }
    }
}

/// A recorded call's handle: records the outcome when waited for, or `abandoned` when dropped
/// unfinished.
struct Watched<T: Send + 'static> {
    work: Option<Work<T>>,
    recorder: Arc<Recorder>,
    id: u64,
}

impl<T: Send + 'static> Pending<T> for Watched<T> {
    fn is_completed(&self) -> bool {
        self.work.as_ref().is_none_or(Work::is_completed)
    }

    fn wait(mut self: Box<Self>) -> Result<T> {
        let work = self.work.take().expect("waited for once");
        let r = work.wait();
        finish(&self.recorder, self.id, r.as_ref().map(|_| ()));
        r
    }
}

impl<T: Send + 'static> Drop for Watched<T> {
    fn drop(&mut self) {
        if let Some(w) = self.work.take() {
            let state = if w.is_completed() {
                EntryState::Completed
            } else {
                EntryState::Abandoned
            };
            self.recorder.finish(
                self.id,
                Outcome {
                    state,
                    error: None,
                    waiting_for: Vec::new(),
                },
            );
        }
    }
}

impl Communicator for Recorded {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn ranks(&self) -> &[usize] {
        self.inner.ranks()
    }

    fn global_rank(&self) -> usize {
        self.inner.global_rank()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let call = Call {
            kind: Kind::AllReduce(op),
            tensor: Some((tensor.dtype(), tensor.shape().clone())),
        };
        self.collective(call, || self.inner.all_reduce(tensor, op))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let call = Call {
            kind: Kind::ReduceScatter(op),
            tensor: Some((tensor.dtype(), tensor.shape().clone())),
        };
        self.collective(call, || self.inner.reduce_scatter(tensor, op))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        let call = Call {
            kind: Kind::AllGather,
            tensor: Some((tensor.dtype(), tensor.shape().clone())),
        };
        self.collective(call, || self.inner.all_gather(tensor))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        let call = Call {
            kind: Kind::Broadcast(root),
            tensor: Some((tensor.dtype(), tensor.shape().clone())),
        };
        self.collective(call, || self.inner.broadcast(tensor, root))
    }

    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work> {
        let call = Call {
            kind: Kind::AllToAll {
                send: send_splits.to_vec(),
                recv: recv_splits.to_vec(),
            },
            tensor: Some((tensor.dtype(), tensor.shape().clone())),
        };
        self.collective(call, || {
            self.inner.all_to_all(tensor, send_splits, recv_splits)
        })
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        let t0 = now_ms();
        let r = self.inner.send(tensor, dst);
        if !numbered(&r) {
            return r;
        }
        let seq = Self::next(&mut self.counters().sent, dst);
        self.record(seq, self.send_op(tensor, dst), t0, r)
    }

    fn recv(&self, src: usize) -> Result<Work> {
        let t0 = now_ms();
        let r = self.inner.recv(src);
        if !numbered(&r) {
            return r;
        }
        let seq = Self::next(&mut self.counters().received, src);
        self.record(seq, self.recv_op(src), t0, r)
    }

    fn barrier(&self) -> Result<Work<()>> {
        let call = Call {
            kind: Kind::Barrier,
            tensor: None,
        };
        self.collective(call, || self.inner.barrier())
    }

    fn batch_p2p(&self, ops: Vec<P2pOp>) -> Result<Vec<P2pWork>> {
        let t0 = now_ms();
        let described: Vec<(bool, usize, Op)> = ops
            .iter()
            .map(|op| match op {
                P2pOp::Send { tensor, peer } => (true, *peer, self.send_op(tensor, *peer)),
                P2pOp::Recv { peer } => (false, *peer, self.recv_op(*peer)),
            })
            .collect();
        let works = self.inner.batch_p2p(ops)?;
        let mut out = Vec::with_capacity(works.len());
        for ((is_send, peer, op), work) in described.into_iter().zip(works) {
            let seq = {
                let mut c = self.counters();
                Self::next(
                    if is_send {
                        &mut c.sent
                    } else {
                        &mut c.received
                    },
                    peer,
                )
            };
            out.push(match work {
                P2pWork::Send(w) => P2pWork::Send(self.record(seq, op, t0, Ok(w))?),
                P2pWork::Recv(w) => P2pWork::Recv(self.record(seq, op, t0, Ok(w))?),
            });
        }
        Ok(out)
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let inner = self.inner.new_group(ranks, tag)?;
        let nth = {
            let mut c = self.counters();
            let n = c.made.entry(format!("{tag}{ranks:?}")).or_insert(0);
            *n += 1;
            *n - 1
        };
        let key = crate::comm::rendezvous::group_key(&self.group.key, tag, ranks, nth);
        Ok(Self::with_key(inner, self.recorder.clone(), key))
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}
