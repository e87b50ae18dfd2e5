//! The TCP backend's collectives, run on a group's worker thread (see the module docs of
//! [`super`] for the algorithms and their order of addition).

use std::sync::Arc;
use std::time::Instant;

use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{CommErrorKind, Error, Result};

use super::net::{Channel, Message, Missing};
use super::Shared;
use crate::comm::call::{Call, Kind};
use crate::comm::reduce;

/// A collective's result on this rank: its elements and shape.
pub(super) type Output = (CpuStorage, Vec<usize>);

/// A unit of work for a group's worker thread.
pub(super) type Job = Box<dyn FnOnce() + Send>;

/// One collective as this rank runs it.
pub(super) struct Op {
    pub net: Arc<Shared>,
    pub group: u64,
    /// Global ranks in group order.
    pub members: Arc<[usize]>,
    /// This rank's group rank.
    pub rank: usize,
    /// The collective's number on the group.
    pub seq: u64,
    pub call: Call,
}

/// Elements `[i * n / w, (i + 1) * n / w)`: block `i` of `n` elements over `w` ranks.
fn block(i: usize, n: usize, w: usize) -> std::ops::Range<usize> {
    i * n / w..(i + 1) * n / w
}

impl Op {
    /// Runs the collective with this rank's contribution `data` (none for a barrier) and returns
    /// this rank's result (elements and shape; the waiting thread makes the tensor, so that it
    /// is charged to that thread's allocation tracker); a panic becomes an error, so the
    /// caller's wait always ends.
    pub(super) fn run(&self, data: Option<CpuStorage>) -> Result<Output> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_inner(data)))
            .unwrap_or_else(|_| {
                Err(self.err(CommErrorKind::Backend(
                    "the collective panicked on this rank".into(),
                )))
            })
    }

    fn run_inner(&self, data: Option<CpuStorage>) -> Result<Output> {
        let dims: Vec<usize> = match &self.call.tensor {
            Some((_, s)) => s.dims().to_vec(),
            None => vec![0],
        };
        let data = data.unwrap_or_else(|| CpuStorage::F32(Vec::new()));
        let w = self.members.len();
        match &self.call.kind {
            Kind::AllToAll { send, recv } => self.all_to_all(data, &dims, send, recv),
            &Kind::AllReduce(op) | &Kind::ReduceScatter(op) => {
                let n = data.len();
                let mine = self.reduce_block(&data, op)?;
                if let Kind::ReduceScatter(_) = self.call.kind {
                    let mut out = dims;
                    out[0] /= w;
                    return Ok((mine, out));
                }
                let blocks = self.exchange(1, &mine, |p| block(p, n, w).len())?;
                let parts: Vec<&CpuStorage> = (0..w)
                    .map(|p| blocks[p].as_ref().map_or(&mine, |m| &m.data))
                    .collect();
                Ok((reduce::concat(&parts)?, dims))
            }
            Kind::AllGather | Kind::Barrier => {
                let n = data.len();
                let got = self.exchange(0, &data, |_| n)?;
                let parts: Vec<&CpuStorage> = (0..w)
                    .map(|p| got[p].as_ref().map_or(&data, |m| &m.data))
                    .collect();
                let mut out = dims;
                match out.first_mut() {
                    Some(d0) => *d0 *= w,
                    None => out.push(w),
                }
                Ok((reduce::concat(&parts)?, out))
            }
            &Kind::Broadcast(root) => {
                if root == self.rank {
                    let bytes = (data.dtype(), data.as_bytes());
                    for p in (0..w).filter(|&p| p != root) {
                        self.send(p, 0, &dims, bytes)?;
                    }
                    return Ok((data, dims));
                }
                let mut got = self.receive(0, &[root], |_| data.len())?;
                let m = got[root].take().expect("received from the root");
                Ok((m.data, dims))
            }
        }
    }

    /// An all-to-all: sends rank `p` its `send[p]` rows of `data` and receives `recv[p]` rows
    /// from it, going round the group from this rank (sends to `r + k`, receives from `r - k`);
    /// the result is the received rows in rank order (this rank's own block copied).
    fn all_to_all(
        &self,
        data: CpuStorage,
        dims: &[usize],
        send: &[usize],
        recv: &[usize],
    ) -> Result<Output> {
        let (w, me) = (self.members.len(), self.rank);
        let row: usize = dims[1..].iter().product();
        let sent = reduce::split_ranges(send, row);
        let size = data.dtype().size_in_bytes();
        let bytes = data.as_bytes();
        let others: Vec<usize> = (1..w).map(|k| (me + k) % w).collect();
        for &p in &others {
            let r = &sent[p];
            let mut block = dims.to_vec();
            block[0] = send[p];
            self.send(
                p,
                0,
                &block,
                (data.dtype(), &bytes[r.start * size..r.end * size]),
            )?;
        }
        let from: Vec<usize> = (1..w).map(|k| (me + w - k) % w).collect();
        let got = self.receive(0, &from, |p| recv[p] * row)?;
        let parts: Vec<(&CpuStorage, std::ops::Range<usize>)> = (0..w)
            .map(|p| match &got[p] {
                Some(m) => (&m.data, 0..m.data.len()),
                None => (&data, sent[me].clone()),
            })
            .collect();
        let mut out = dims.to_vec();
        out[0] = recv.iter().sum();
        Ok((reduce::concat_ranges(data.dtype(), &parts)?, out))
    }

    /// The first half of an all-reduce: sends block `p` of `data` to every rank `p` and combines
    /// the blocks of this rank's index from every rank in rank order.
    fn reduce_block(&self, data: &CpuStorage, op: crate::ReduceOp) -> Result<CpuStorage> {
        let (n, w, me) = (data.len(), self.members.len(), self.rank);
        let size = data.dtype().size_in_bytes();
        let bytes = data.as_bytes();
        for p in (0..w).filter(|&p| p != me) {
            let b = block(p, n, w);
            let slice = &bytes[b.start * size..b.end * size];
            self.send(p, 0, &[b.len()], (data.dtype(), slice))?;
        }
        let mine = block(me, n, w);
        let own = reduce::slice(data, mine.start, mine.len());
        let others: Vec<usize> = (0..w).filter(|&p| p != me).collect();
        let got = self.receive(0, &others, |_| mine.len())?;
        let parts: Vec<&CpuStorage> = (0..w)
            .map(|p| got[p].as_ref().map_or(&own, |m| &m.data))
            .collect();
        reduce::reduce(&parts, op)
    }

    /// Sends `data` to every other member on `phase` and receives theirs (`len(p)` elements
    /// from rank `p`); the result is indexed by group rank, `None` at this rank.
    fn exchange(
        &self,
        phase: u8,
        data: &CpuStorage,
        len: impl Fn(usize) -> usize,
    ) -> Result<Vec<Option<Message>>> {
        let w = self.members.len();
        let others: Vec<usize> = (0..w).filter(|&p| p != self.rank).collect();
        for &p in &others {
            self.send(p, phase, &[data.len()], (data.dtype(), data.as_bytes()))?;
        }
        self.receive(phase, &others, len)
    }

    fn err(&self, kind: CommErrorKind) -> Error {
        Error::comm(
            self.members[self.rank],
            &self.members,
            self.call.kind.name(),
            Some(self.seq),
            kind,
        )
    }

    fn send(
        &self,
        p: usize,
        phase: u8,
        dims: &[usize],
        bytes: super::net::Bytes<'_>,
    ) -> Result<()> {
        let chan = Channel::Collective {
            seq: self.seq,
            phase,
        };
        let peer = self.members[p];
        self.net
            .net
            .send(peer, self.group, chan, &self.agreed(p), dims, bytes)
            .map_err(|e| self.err(super::net::write_error(peer, &e)))
    }

    /// One message of `phase` from each of `from` (group ranks), checked against this rank's
    /// call and its expected length `len(p)`, all within one timeout.
    fn receive(
        &self,
        phase: u8,
        from: &[usize],
        len: impl Fn(usize) -> usize,
    ) -> Result<Vec<Option<Message>>> {
        let chan = Channel::Collective {
            seq: self.seq,
            phase,
        };
        let mailbox = &self.net.net.mailbox;
        let deadline = Instant::now() + self.net.timeout;
        let mut out: Vec<Option<Message>> = (0..self.members.len()).map(|_| None).collect();
        for (i, &p) in from.iter().enumerate() {
            let src = self.members[p];
            let m = match mailbox.take(self.group, chan, src, deadline) {
                Ok(m) => m,
                Err(Missing::Timeout) => {
                    let missing = std::iter::once(src)
                        .chain(
                            from[i + 1..]
                                .iter()
                                .map(|&q| self.members[q])
                                .filter(|&g| !mailbox.has(self.group, chan, g)),
                        )
                        .collect();
                    return Err(self.err(CommErrorKind::Timeout {
                        missing,
                        after: self.net.timeout,
                        detail: None,
                    }));
                }
                Err(Missing::Gone(why)) => return Err(self.err(gone(src, why))),
            };
            let mine = self.agreed(p);
            if m.call != mine {
                return Err(self.err(CommErrorKind::Mismatch {
                    rank: self.members[self.rank],
                    other: src,
                    calls: [mine, m.call],
                }));
            }
            if m.data.len() != len(p) || m.data.dtype() != self.dtype() {
                return Err(self.err(CommErrorKind::Backend(format!(
                    "rank {src} sent {} {} elements where {} were expected",
                    m.data.len(),
                    m.data.dtype(),
                    len(p)
                ))));
            }
            out[p] = Some(m);
        }
        Ok(out)
    }

    /// What this rank and group rank `p` must agree on, as the messages between them carry it:
    /// the whole call, or for an all-to-all the pair's view of it ([`Call::pair`]).
    fn agreed(&self, p: usize) -> String {
        self.call.pair(self.rank, p, &self.members)
    }

    /// The dtype of this rank's tensor (f32 for a barrier's empty messages).
    fn dtype(&self) -> meshgrad_tensor::DType {
        self.call
            .tensor
            .as_ref()
            .map_or(meshgrad_tensor::DType::F32, |(d, _)| *d)
    }
}

/// The error kind for a peer whose connection closed (see [`Missing::Gone`]).
pub(super) fn gone(peer: usize, why: Option<String>) -> CommErrorKind {
    match why {
        None => CommErrorKind::PeerExited { ranks: vec![peer] },
        Some(reason) => CommErrorKind::PeerFailed { rank: peer, reason },
    }
}

#[cfg(test)]
mod tests {
    use super::block;

    #[test]
    fn blocks_cover_every_element_once() {
        for w in 1..6 {
            for n in 0..20 {
                let mut next = 0;
                for i in 0..w {
                    let b = block(i, n, w);
                    assert_eq!(b.start, next);
                    next = b.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
