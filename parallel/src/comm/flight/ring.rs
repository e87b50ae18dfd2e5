//! [`Recorder`]: one rank's fixed-capacity ring of its most recent communication calls.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use meshgrad_tensor::{DType, Shape};

use super::dump::{Dump, Entry, EntryState};
use crate::comm::call::{Call, Kind};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A group as the recorder names it: its key (`world`, `world/dp[0,1]#0`, ...) and its members'
/// global ranks, shared by every record of the group.
#[derive(Debug)]
pub(crate) struct GroupName {
    pub(crate) key: String,
    pub(crate) ranks: Arc<[usize]>,
}

/// What a record's call was.
#[derive(Clone, Debug)]
pub(crate) enum Op {
    /// A collective (its kind, reduce op or root, and the tensor's dtype and shape).
    Collective(Call),
    /// A send to global rank `peer`.
    Send { peer: usize, tensor: (DType, Shape) },
    /// A receive from global rank `peer`.
    Recv { peer: usize },
}

/// One recorded call, as kept in the ring (turned into an [`Entry`] only when dumped).
struct Record {
    id: u64,
    group: Arc<GroupName>,
    seq: u64,
    op: Op,
    state: EntryState,
    error: Option<String>,
    waiting_for: Vec<usize>,
    launched_ms: u64,
    ended_ms: Option<u64>,
}

impl Record {
    fn entry(&self) -> Entry {
        let (kind, call, tensor, op, root, peer) = match &self.op {
            Op::Collective(c) => {
                let (op, root) = match &c.kind {
                    Kind::AllReduce(op) | Kind::ReduceScatter(op) => (Some(op.to_string()), None),
                    Kind::Broadcast(root) => (None, self.group.ranks.get(*root).copied()),
                    Kind::AllGather | Kind::Barrier | Kind::AllToAll { .. } => (None, None),
                };
                (
                    c.kind.name(),
                    c.to_string(),
                    c.tensor.clone(),
                    op,
                    root,
                    None,
                )
            }
            Op::Send { peer, tensor } => (
                "send",
                format!("send(to {peer}, {} {})", tensor.0, tensor.1),
                Some(tensor.clone()),
                None,
                None,
                Some(*peer),
            ),
            Op::Recv { peer } => (
                "recv",
                format!("recv(from {peer})"),
                None,
                None,
                None,
                Some(*peer),
            ),
        };
        Entry {
            id: self.id,
            group: self.group.key.clone(),
            ranks: self.group.ranks.to_vec(),
            seq: self.seq,
            kind: kind.to_string(),
            call,
            dtype: tensor.as_ref().map(|(d, _)| d.to_string()),
            shape: tensor.map(|(_, s)| s.dims().to_vec()),
            op,
            root,
            peer,
            state: self.state,
            error: self.error.clone(),
            waiting_for: self.waiting_for.clone(),
            launched_ms: self.launched_ms,
            ended_ms: self.ended_ms,
        }
    }
}

/// The ring: slot `id % capacity` holds record `id` until record `id + capacity` replaces it.
struct Ring {
    slots: Vec<Option<Record>>,
    next_id: u64,
}

/// How a recorded call ended.
#[derive(Clone, Debug)]
pub(crate) struct Outcome {
    pub(crate) state: EntryState,
    pub(crate) error: Option<String>,
    pub(crate) waiting_for: Vec<usize>,
}

/// One rank's flight recorder: the last `capacity` collectives and point-to-point calls it made
/// on any of its groups, each with its per-group sequence number, kind, group, dtype and shape,
/// state and times. Cheap to record into (a short critical section under a mutex; the only
/// allocation is the record's own shape); dumped as JSON by [`super::dump_all`].
pub struct Recorder {
    rank: usize,
    world_size: usize,
    capacity: usize,
    started_ms: u64,
    ring: Mutex<Ring>,
    /// Why this rank's recorder was dumped, oldest first (kept to the last 8).
    reasons: Mutex<Vec<String>>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Recorder(rank {} of {}, {} slots)",
            self.rank, self.world_size, self.capacity
        )
    }
}

impl Recorder {
    /// An empty recorder of `capacity` (at least 1) calls for global rank `rank` of
    /// `world_size`.
    pub fn new(rank: usize, world_size: usize, capacity: usize) -> Recorder {
        let capacity = capacity.max(1);
        Recorder {
            rank,
            world_size,
            capacity,
            started_ms: now_ms(),
            ring: Mutex::new(Ring {
                slots: (0..capacity).map(|_| None).collect(),
                next_id: 0,
            }),
            reasons: Mutex::new(Vec::new()),
        }
    }

    /// The global rank this recorder belongs to.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Records a call launched at `launched_ms` and returns its id (for [`Recorder::finish`]).
    pub(crate) fn launch(&self, group: &Arc<GroupName>, seq: u64, op: Op, launched_ms: u64) -> u64 {
        let mut ring = lock(&self.ring);
        let id = ring.next_id;
        ring.next_id += 1;
        let slot = (id % self.capacity as u64) as usize;
        ring.slots[slot] = Some(Record {
            id,
            group: group.clone(),
            seq,
            op,
            state: EntryState::Launched,
            error: None,
            waiting_for: Vec::new(),
            launched_ms,
            ended_ms: None,
        });
        id
    }

    /// Sets how call `id` ended (nothing when the ring has already dropped it).
    pub(crate) fn finish(&self, id: u64, outcome: Outcome) {
        let mut ring = lock(&self.ring);
        let slot = (id % self.capacity as u64) as usize;
        if let Some(r) = ring.slots[slot].as_mut().filter(|r| r.id == id) {
            r.state = outcome.state;
            r.error = outcome.error;
            r.waiting_for = outcome.waiting_for;
            r.ended_ms = Some(now_ms());
        }
    }

    /// Adds `reason` to the reasons this recorder was dumped for.
    pub(crate) fn add_reason(&self, reason: &str) {
        let mut r = lock(&self.reasons);
        r.push(reason.to_string());
        let extra = r.len().saturating_sub(8);
        r.drain(..extra);
    }

    /// What the recorder holds now, oldest call first.
    pub fn snapshot(&self) -> Dump {
        let (entries, recorded) = {
            let ring = lock(&self.ring);
            let mut recs: Vec<&Record> = ring.slots.iter().flatten().collect();
            recs.sort_by_key(|r| r.id);
            (
                recs.iter().map(|r| r.entry()).collect::<Vec<_>>(),
                ring.next_id,
            )
        };
        Dump {
            version: Dump::VERSION,
            rank: self.rank,
            world_size: self.world_size,
            pid: std::process::id(),
            capacity: self.capacity,
            recorded,
            started_ms: self.started_ms,
            dumped_ms: now_ms(),
            reasons: lock(&self.reasons).clone(),
            entries,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

    fn group() -> Arc<GroupName> {
        Arc::new(GroupName {
            key: "world".into(),
            ranks: vec![0, 1].into(),
        })
    }

    fn all_reduce() -> Op {
        Op::Collective(Call {
            kind: Kind::AllReduce(ReduceOp::Sum),
            tensor: Some((DType::F32, Shape::from(vec![4]))),
        })
    }

    #[test]
    fn the_ring_keeps_the_last_calls_in_order() {
        let rec = Recorder::new(1, 2, 3);
        let g = group();
        let ids: Vec<u64> = (0..5)
            .map(|s| rec.launch(&g, s, all_reduce(), 10 + s))
            .collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        rec.finish(
            3,
            Outcome {
                state: EntryState::Completed,
                error: None,
                waiting_for: vec![],
            },
        );
        // Record 0 was replaced: finishing it changes nothing.
        rec.finish(
            0,
            Outcome {
                state: EntryState::Failed,
                error: Some("late".into()),
                waiting_for: vec![0],
            },
        );
        let d = rec.snapshot();
        assert_eq!((d.rank, d.world_size, d.capacity, d.recorded), (1, 2, 3, 5));
        let seqs: Vec<u64> = d.entries.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![2, 3, 4]);
        let states: Vec<EntryState> = d.entries.iter().map(|e| e.state).collect();
        assert_eq!(
            states,
            vec![
                EntryState::Launched,
                EntryState::Completed,
                EntryState::Launched
            ]
        );
        let e = &d.entries[0];
        assert_eq!(e.kind, "all_reduce");
        assert_eq!(e.call, "all_reduce(sum, f32 [4])");
        assert_eq!(e.dtype.as_deref(), Some("f32"));
        assert_eq!(e.shape.as_deref(), Some(&[4usize][..]));
        assert_eq!(e.op.as_deref(), Some("sum"));
        assert_eq!(e.ranks, vec![0, 1]);
        assert!(d.entries.iter().all(|e| e.error.is_none()));
    }

    #[test]
    fn point_to_point_records_name_the_peer() {
        let rec = Recorder::new(0, 2, 4);
        let g = group();
        let t = (DType::F32, Shape::from(vec![2, 3]));
        rec.launch(&g, 0, Op::Send { peer: 1, tensor: t }, 1);
        rec.launch(&g, 0, Op::Recv { peer: 1 }, 2);
        let d = rec.snapshot();
        assert_eq!(d.entries[0].call, "send(to 1, f32 [2, 3])");
        assert_eq!(d.entries[0].peer, Some(1));
        assert_eq!(d.entries[1].kind, "recv");
        assert_eq!(d.entries[1].shape, None);
    }
}
