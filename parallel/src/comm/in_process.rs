//! The in-process backend: every rank is a thread of this process, and a group is a shared
//! rendezvous table. Contributions are copied into host buffers at launch; the first rank to wait
//! on a complete collective combines them (in rank order, see [`super::reduce`]) and every rank
//! copies the shared result into a fresh tensor of its own.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{CommErrorKind, Device, Error, Result, Shape, Tensor};

use super::call::{checks, disagreement, Call, Kind};
use super::{format_ranks, reduce, with_peer, Communicator, Pending, ReduceOp, Work};

/// Locks a mutex, recovering the data if a panicking thread poisoned it: every critical section
/// here leaves the tables consistent, and rank failures are reported through [`World`] instead.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Formats a duration for messages: `2s`, `1.5s`, `250ms`.
pub(crate) fn fmt_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

/// State shared by all ranks of one run: the timeout, which ranks failed or exited, and the
/// registry of groups (so failures can wake every waiter).
pub(crate) struct World {
    size: usize,
    timeout: Duration,
    /// Sends complete only when their receive has taken the message (see
    /// [`crate::comm::RunOptions::rendezvous_sends`]).
    rendezvous: AtomicBool,
    failed: AtomicBool,
    failure: Mutex<Option<(usize, String)>>,
    exited: Vec<AtomicBool>,
    registry: Mutex<HashMap<GroupKey, Weak<Group>>>,
    next_group_id: AtomicU64,
}

/// (parent group id, global members, tag, instance).
type GroupKey = (u64, Vec<usize>, String, u64);

impl World {
    pub(crate) fn new(size: usize, timeout: Duration) -> Arc<World> {
        Arc::new(World {
            size,
            timeout,
            rendezvous: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            registry: Mutex::new(HashMap::new()),
            next_group_id: AtomicU64::new(1),
        })
    }

    /// Makes sends rendezvous (or buffered again).
    pub(crate) fn set_rendezvous(&self, on: bool) {
        self.rendezvous.store(on, Ordering::Relaxed);
    }

    /// Records that global rank `rank` failed with `reason` (the first failure is kept) and
    /// wakes every waiter, so pending operations fail at once.
    pub(crate) fn fail(&self, rank: usize, reason: &str) {
        {
            let mut f = lock(&self.failure);
            if f.is_none() {
                *f = Some((rank, reason.to_string()));
            }
        }
        self.failed.store(true, Ordering::SeqCst);
        self.wake_all();
    }

    /// The first failure, if any rank failed: (global rank, reason).
    pub(crate) fn failure(&self) -> Option<(usize, String)> {
        if self.failed.load(Ordering::SeqCst) {
            lock(&self.failure).clone()
        } else {
            None
        }
    }

    /// The global rank that failed first, if any.
    pub(crate) fn first_failed_rank(&self) -> Option<usize> {
        lock(&self.failure).as_ref().map(|(r, _)| *r)
    }

    /// Records that global rank `rank` returned (it will join nothing more) and wakes waiters.
    pub(crate) fn exit(&self, rank: usize) {
        if let Some(e) = self.exited.get(rank) {
            e.store(true, Ordering::SeqCst);
        }
        self.wake_all();
    }

    fn has_exited(&self, rank: usize) -> bool {
        self.exited
            .get(rank)
            .is_some_and(|e| e.load(Ordering::SeqCst))
    }

    fn wake_all(&self) {
        let groups: Vec<Arc<Group>> = lock(&self.registry)
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        for g in groups {
            // Taking the lock orders this wake-up after any waiter's check of the flags.
            let _s = lock(&g.state);
            g.cv.notify_all();
        }
    }

    /// Why a wait for the missing `ranks` should stop now, if it should.
    fn abort_reason(&self, missing: &[usize]) -> Option<CommErrorKind> {
        if let Some((rank, reason)) = self.failure() {
            return Some(CommErrorKind::PeerFailed { rank, reason });
        }
        let gone: Vec<usize> = missing
            .iter()
            .copied()
            .filter(|&r| self.has_exited(r))
            .collect();
        if gone.is_empty() {
            None
        } else {
            Some(CommErrorKind::PeerExited { ranks: gone })
        }
    }
}

/// A message or a contribution: a host buffer and its shape.
struct Payload {
    data: CpuStorage,
    shape: Shape,
    /// An all-to-all's result: the rows for every rank, destination by destination, and where
    /// each destination's rows start (element offsets, one more than the group size). Empty
    /// otherwise.
    offsets: Vec<usize>,
}

impl Payload {
    fn new(data: CpuStorage, shape: Shape) -> Payload {
        Payload {
            data,
            shape,
            offsets: Vec::new(),
        }
    }
}

enum Outcome {
    Waiting,
    Computing,
    Ready(Arc<Payload>),
    Failed(CommErrorKind),
}

/// One collective of a group, identified by its sequence number.
struct Slot {
    calls: Vec<Option<Call>>,
    inputs: Vec<Option<Arc<Payload>>>,
    joined: usize,
    outcome: Outcome,
    /// Members that have not yet taken (or abandoned) the result; the slot goes at zero.
    unconsumed: usize,
}

impl Slot {
    fn new(n: usize) -> Slot {
        Slot {
            calls: vec![None; n],
            inputs: (0..n).map(|_| None).collect(),
            joined: 0,
            outcome: Outcome::Waiting,
            unconsumed: n,
        }
    }
}

#[derive(Default)]
struct GroupState {
    slots: HashMap<u64, Slot>,
    /// Point-to-point messages keyed by (source, destination, per-pair sequence), group ranks.
    messages: HashMap<(usize, usize, u64), Payload>,
}

/// The rendezvous table of one group, shared by its members' handles.
struct Group {
    id: u64,
    members: Vec<usize>,
    label: String,
    state: Mutex<GroupState>,
    cv: Condvar,
}

impl Group {
    fn new(id: u64, members: Vec<usize>) -> Group {
        Group {
            id,
            label: format_ranks(&members),
            members,
            state: Mutex::new(GroupState::default()),
            cv: Condvar::new(),
        }
    }
}

/// One rank's handle on a group of the in-process backend (see the [`crate::comm`] docs for the
/// semantics). Obtained from [`crate::comm::run_ranks`] (the world group) and
/// [`Communicator::new_group`].
pub struct InProcessComm {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    seq: AtomicU64,
    send_seq: Mutex<HashMap<usize, u64>>,
    recv_seq: Mutex<HashMap<usize, u64>>,
    group_counts: Mutex<HashMap<(Vec<usize>, String), u64>>,
}

impl std::fmt::Debug for InProcessComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "InProcessComm(rank {} of group {})",
            self.rank, self.group.label
        )
    }
}

impl InProcessComm {
    /// The world-group handles of a new world of `size` ranks whose operations time out after
    /// `timeout`; handle `r` belongs to rank `r`. [`crate::comm::run_ranks`] is the usual entry
    /// point; with this constructor the caller runs the threads and should call
    /// [`InProcessComm::abort`] when a rank fails and [`InProcessComm::mark_exited`] when it
    /// returns, so peers fail fast instead of waiting for the timeout.
    pub fn create_world(size: usize, timeout: Duration) -> Result<Vec<InProcessComm>> {
        if size == 0 {
            meshgrad_tensor::bail!("in-process world: the world size must be at least 1");
        }
        let world = World::new(size, timeout);
        Ok(Self::world_handles(&world))
    }

    pub(crate) fn world_handles(world: &Arc<World>) -> Vec<InProcessComm> {
        let size = world.size;
        let group = Arc::new(Group::new(0, (0..size).collect()));
        lock(&world.registry).insert(
            (0, (0..size).collect(), String::new(), 0),
            Arc::downgrade(&group),
        );
        (0..size)
            .map(|rank| InProcessComm::handle(world.clone(), group.clone(), rank))
            .collect()
    }

    fn handle(world: Arc<World>, group: Arc<Group>, rank: usize) -> InProcessComm {
        InProcessComm {
            world,
            group,
            rank,
            seq: AtomicU64::new(0),
            send_seq: Mutex::new(HashMap::new()),
            recv_seq: Mutex::new(HashMap::new()),
            group_counts: Mutex::new(HashMap::new()),
        }
    }

    /// Marks this rank failed with `reason`: every pending and future operation of every rank of
    /// the world fails at once with an error naming this rank and the reason.
    pub fn abort(&self, reason: &str) {
        self.world.fail(self.global_rank(), reason);
    }

    /// Marks this rank as gone: operations that still need its contribution fail at once.
    pub fn mark_exited(&self) {
        self.world.exit(self.global_rank());
    }

    /// The timeout of every operation.
    pub fn timeout(&self) -> Duration {
        self.world.timeout
    }

    /// An invalid-argument error of `call` on this group.
    fn invalid(&self, call: &'static str, msg: String) -> Error {
        Error::comm(
            self.global_rank(),
            &self.group.members,
            call,
            None,
            CommErrorKind::Invalid(msg),
        )
    }

    fn check_tensor(&self, what: &'static str, t: &Tensor) -> Result<()> {
        if t.device() != Device::Cpu {
            return Err(self.invalid(
                what,
                format!(
                    "the in-process backend moves CPU tensors, got one on {}",
                    t.device()
                ),
            ));
        }
        Ok(())
    }

    /// Joins collective `kind` with `tensor` (whose data is contributed when `contribute`).
    fn launch(&self, kind: Kind, tensor: Option<&Tensor>, contribute: bool) -> Result<Work> {
        let what = kind.name();
        if let Some(t) = tensor {
            self.check_tensor(what, t)?;
        }
        let payload = match tensor {
            Some(t) if contribute => Some(Arc::new(Payload::new(
                t.to_cpu_storage()?,
                t.shape().clone(),
            ))),
            _ => None,
        };
        let call = Call {
            kind: kind.clone(),
            tensor: tensor.map(|t| (t.dtype(), t.shape().clone())),
        };
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let n = self.world_size();
        {
            let mut st = lock(&self.group.state);
            let slot = st.slots.entry(seq).or_insert_with(|| Slot::new(n));
            // Every member already there (an all-to-all matches pair by pair).
            let members = &self.group.members;
            let conflict = slot.calls.iter().enumerate().find_map(|(i, c)| {
                let theirs = c.as_ref()?;
                disagreement(&call, self.rank, theirs, i, members).map(|calls| (i, calls))
            });
            if let Some((other, calls)) = conflict {
                if !matches!(slot.outcome, Outcome::Failed(_)) {
                    slot.outcome = Outcome::Failed(CommErrorKind::Mismatch {
                        rank: members[self.rank],
                        other: members[other],
                        calls,
                    });
                }
            }
            slot.calls[self.rank] = Some(call);
            slot.inputs[self.rank] = payload;
            slot.joined += 1;
            self.group.cv.notify_all();
        }
        Ok(Work::pending(Box::new(CollectiveWait {
            world: self.world.clone(),
            group: self.group.clone(),
            rank: self.rank,
            global_rank: self.global_rank(),
            seq,
            kind,
            consumed: false,
        })))
    }

    fn check_peer(&self, what: &'static str, peer: usize, role: &str) -> Result<()> {
        checks::peer(what, peer, self.rank, self.world_size(), role)
            .map_err(|m| self.invalid(what, m))
    }

    fn next_pair_seq(map: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
        let mut m = lock(map);
        let c = m.entry(peer).or_insert(0);
        let s = *c;
        *c += 1;
        s
    }
}

impl Communicator for InProcessComm {
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
        self.launch(Kind::AllReduce(op), Some(tensor), true)
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        checks::reduce_scatter(tensor.shape(), tensor.dtype(), op, self.world_size())
            .map_err(|m| self.invalid("reduce_scatter", m))?;
        self.launch(Kind::ReduceScatter(op), Some(tensor), true)
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        self.launch(Kind::AllGather, Some(tensor), true)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        checks::root(root, self.world_size()).map_err(|m| self.invalid("broadcast", m))?;
        self.launch(Kind::Broadcast(root), Some(tensor), root == self.rank)
    }

    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work> {
        let kind = Kind::all_to_all(tensor.shape(), send_splits, recv_splits, self.world_size())
            .map_err(|m| self.invalid("all_to_all", m))?;
        self.launch(kind, Some(tensor), true)
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        self.check_peer("send", dst, "destination")?;
        self.check_tensor("send", tensor)?;
        let payload = Payload::new(tensor.to_cpu_storage()?, tensor.shape().clone());
        let seq = Self::next_pair_seq(&self.send_seq, dst);
        let mut st = lock(&self.group.state);
        st.messages.insert((self.rank, dst, seq), payload);
        self.group.cv.notify_all();
        if !self.world.rendezvous.load(Ordering::Relaxed) {
            return Ok(Work::done(()));
        }
        Ok(Work::pending(Box::new(SendWait {
            world: self.world.clone(),
            group: self.group.clone(),
            rank: self.rank,
            dst,
            seq,
        })))
    }

    fn recv(&self, src: usize) -> Result<Work> {
        self.check_peer("recv", src, "source")?;
        let seq = Self::next_pair_seq(&self.recv_seq, src);
        Ok(Work::pending(Box::new(RecvWait {
            world: self.world.clone(),
            group: self.group.clone(),
            rank: self.rank,
            src,
            seq,
        })))
    }

    fn barrier(&self) -> Result<Work<()>> {
        Ok(self.launch(Kind::Barrier, None, false)?.map(|_| Ok(())))
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let me = super::group_position(ranks, self.world_size(), self.rank)
            .map_err(|m| self.invalid("new_group", m))?;
        let members: Vec<usize> = ranks.iter().map(|&r| self.group.members[r]).collect();
        let instance = {
            let mut counts = lock(&self.group_counts);
            let c = counts
                .entry((members.clone(), tag.to_string()))
                .or_insert(0);
            let i = *c;
            *c += 1;
            i
        };
        let key = (self.group.id, members.clone(), tag.to_string(), instance);
        let group = {
            let mut reg = lock(&self.world.registry);
            match reg.get(&key).and_then(Weak::upgrade) {
                Some(g) => g,
                None => {
                    let id = self.world.next_group_id.fetch_add(1, Ordering::SeqCst);
                    let g = Arc::new(Group::new(id, members));
                    reg.insert(key, Arc::downgrade(&g));
                    g
                }
            }
        };
        Ok(Arc::new(InProcessComm::handle(
            self.world.clone(),
            group,
            me,
        )))
    }
}

/// A rank waiting for collective `seq` of a group.
struct CollectiveWait {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    global_rank: usize,
    seq: u64,
    kind: Kind,
    consumed: bool,
}

impl CollectiveWait {
    fn err(&self, kind: CommErrorKind) -> Error {
        Error::comm(
            self.global_rank,
            &self.group.members,
            self.kind.name(),
            Some(self.seq),
            kind,
        )
    }

    /// Marks this rank's interest in the slot as over; removes the slot when it was the last.
    fn consume(&mut self, st: &mut GroupState) {
        if self.consumed {
            return;
        }
        self.consumed = true;
        if let Some(slot) = st.slots.get_mut(&self.seq) {
            slot.unconsumed -= 1;
            if slot.unconsumed == 0 {
                st.slots.remove(&self.seq);
            }
        }
    }

    /// This rank's output from the shared result.
    fn extract(&self, result: &Payload) -> Result<Tensor> {
        let n = self.group.members.len();
        match &self.kind {
            Kind::ReduceScatter(_) => {
                let mut dims = result.shape.dims().to_vec();
                dims[0] /= n;
                let chunk = result.data.len() / n;
                let data = reduce::slice(&result.data, self.rank * chunk, chunk);
                Tensor::from_cpu(data, dims, Device::Cpu)
            }
            Kind::AllToAll { recv, .. } => {
                // This rank's rows, from every source in rank order.
                let (start, end) = (result.offsets[self.rank], result.offsets[self.rank + 1]);
                let mut dims = result.shape.dims().to_vec();
                dims[0] = recv.iter().sum();
                let data = reduce::slice(&result.data, start, end - start);
                Tensor::from_cpu(data, dims, Device::Cpu)
            }
            _ => Tensor::from_cpu(result.data.clone(), result.shape.clone(), Device::Cpu),
        }
    }
}

/// Combines the contributions of a complete collective: `inputs` are the contributions present,
/// in rank order, `by_rank` the same indexed by group rank, and `calls` the members' calls.
fn combine(
    kind: &Kind,
    inputs: &[Arc<Payload>],
    by_rank: &[Option<Arc<Payload>>],
    calls: &[Option<Call>],
) -> Result<Arc<Payload>> {
    let data: Vec<&CpuStorage> = inputs.iter().map(|p| &p.data).collect();
    let first = || {
        inputs
            .first()
            .ok_or_else(|| Error::msg("internal error: no contributions"))
    };
    match kind {
        Kind::AllReduce(op) | Kind::ReduceScatter(op) => Ok(Arc::new(Payload::new(
            reduce::reduce(&data, *op)?,
            first()?.shape.clone(),
        ))),
        Kind::AllGather => {
            let s = &first()?.shape;
            let mut dims = s.dims().to_vec();
            if dims.is_empty() {
                dims.push(inputs.len());
            } else {
                dims[0] *= inputs.len();
            }
            Ok(Arc::new(Payload::new(
                reduce::concat(&data)?,
                Shape::new(dims),
            )))
        }
        // The root's buffer is shared as is; each rank copies it when extracting.
        Kind::Broadcast(root) => by_rank
            .get(*root)
            .cloned()
            .flatten()
            .ok_or_else(|| Error::msg("internal error: the broadcast root's data is missing")),
        Kind::Barrier => Ok(Arc::new(Payload::new(
            CpuStorage::F32(Vec::new()),
            Shape::new(vec![0]),
        ))),
        Kind::AllToAll { .. } => all_to_all(inputs, calls),
    }
}

/// An all-to-all's rows regrouped by destination (every member's calls matched, so rank `i`
/// sends rank `d` as many rows as `d` expects): for each destination in rank order, the rows
/// every source sends it, in source order; the payload's shape is the input's trailing
/// dimensions after the total number of rows.
fn all_to_all(inputs: &[Arc<Payload>], calls: &[Option<Call>]) -> Result<Arc<Payload>> {
    let missing = || Error::msg("internal error: an all-to-all contribution is missing");
    let first = inputs.first().ok_or_else(missing)?;
    let dims = first.shape.dims();
    let row: usize = dims[1..].iter().product();
    let ranges: Vec<Vec<std::ops::Range<usize>>> = calls
        .iter()
        .map(|c| match c.as_ref().map(|c| &c.kind) {
            Some(Kind::AllToAll { send, .. }) => Ok(reduce::split_ranges(send, row)),
            _ => Err(missing()),
        })
        .collect::<Result<_>>()?;
    let w = ranges.len();
    if inputs.len() != w {
        return Err(missing());
    }
    let mut parts = Vec::with_capacity(w * w);
    let mut offsets = Vec::with_capacity(w + 1);
    let mut at = 0;
    offsets.push(0);
    for d in 0..w {
        for (input, r) in inputs.iter().zip(&ranges) {
            at += r[d].len();
            parts.push((&input.data, r[d].clone()));
        }
        offsets.push(at);
    }
    let mut shape = dims.to_vec();
    shape[0] = calls
        .iter()
        .flatten()
        .map(|c| match &c.kind {
            Kind::AllToAll { send, .. } => send.iter().sum::<usize>(),
            _ => 0,
        })
        .sum();
    Ok(Arc::new(Payload {
        data: reduce::concat_ranges(first.data.dtype(), &parts)?,
        shape: Shape::new(shape),
        offsets,
    }))
}

/// Puts a `Failed` outcome in place if the combining rank unwinds before finishing.
struct ComputeGuard<'a> {
    group: &'a Group,
    seq: u64,
    done: bool,
}

impl Drop for ComputeGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            let mut st = lock(&self.group.state);
            if let Some(slot) = st.slots.get_mut(&self.seq) {
                slot.outcome = Outcome::Failed(CommErrorKind::Backend(
                    "the rank combining the result panicked".into(),
                ));
            }
            self.group.cv.notify_all();
        }
    }
}

impl Pending<Tensor> for CollectiveWait {
    fn is_completed(&self) -> bool {
        let st = lock(&self.group.state);
        match st.slots.get(&self.seq) {
            Some(slot) => {
                slot.joined == slot.calls.len() || matches!(slot.outcome, Outcome::Failed(_))
            }
            None => true,
        }
    }

    fn wait(mut self: Box<Self>) -> Result<Tensor> {
        let deadline = Instant::now() + self.world.timeout;
        let group = self.group.clone();
        let mut st = lock(&group.state);
        loop {
            let Some(slot) = st.slots.get_mut(&self.seq) else {
                return Err(self.err(CommErrorKind::Backend(
                    "internal error: the collective's record is gone".into(),
                )));
            };
            match &slot.outcome {
                Outcome::Failed(reason) => {
                    let e = self.err(reason.clone());
                    self.consume(&mut st);
                    return Err(e);
                }
                Outcome::Ready(result) => {
                    let result = result.clone();
                    self.consume(&mut st);
                    drop(st);
                    return self.extract(&result);
                }
                Outcome::Waiting if slot.joined == slot.calls.len() => {
                    slot.outcome = Outcome::Computing;
                    let inputs: Vec<Arc<Payload>> = slot.inputs.iter().flatten().cloned().collect();
                    let roots = slot.inputs.clone();
                    // An all-to-all reads every member's splits.
                    let calls = match self.kind {
                        Kind::AllToAll { .. } => slot.calls.clone(),
                        _ => Vec::new(),
                    };
                    drop(st);
                    let mut guard = ComputeGuard {
                        group: &group,
                        seq: self.seq,
                        done: false,
                    };
                    let combined = combine(&self.kind, &inputs, &roots, &calls);
                    st = lock(&group.state);
                    guard.done = true;
                    if let Some(slot) = st.slots.get_mut(&self.seq) {
                        slot.outcome = match combined {
                            Ok(p) => Outcome::Ready(p),
                            Err(e) => Outcome::Failed(CommErrorKind::Backend(e.to_string())),
                        };
                        // The contributions are no longer needed.
                        slot.inputs.iter_mut().for_each(|i| *i = None);
                    }
                    group.cv.notify_all();
                    continue;
                }
                Outcome::Waiting | Outcome::Computing => {}
            }
            let missing: Vec<usize> = slot
                .calls
                .iter()
                .enumerate()
                .filter(|(_, c)| c.is_none())
                .map(|(i, _)| group.members[i])
                .collect();
            if let Some(reason) = self.world.abort_reason(&missing) {
                let e = self.err(reason);
                self.consume(&mut st);
                return Err(e);
            }
            let now = Instant::now();
            if now >= deadline {
                let e = self.err(CommErrorKind::Timeout {
                    detail: missing
                        .is_empty()
                        .then(|| "the combining rank is stuck".to_string()),
                    missing,
                    after: self.world.timeout,
                });
                self.consume(&mut st);
                return Err(e);
            }
            st = group
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for CollectiveWait {
    fn drop(&mut self) {
        if !self.consumed {
            let group = self.group.clone();
            let mut st = lock(&group.state);
            self.consume(&mut st);
        }
    }
}

/// A rank waiting for message `seq` from `src`.
struct RecvWait {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    src: usize,
    seq: u64,
}

impl RecvWait {
    fn err(&self, kind: CommErrorKind) -> Error {
        let e = Error::comm(
            self.group.members[self.rank],
            &self.group.members,
            "recv",
            Some(self.seq),
            kind,
        );
        with_peer(e, self.group.members[self.src])
    }
}

impl Pending<Tensor> for RecvWait {
    fn is_completed(&self) -> bool {
        lock(&self.group.state)
            .messages
            .contains_key(&(self.src, self.rank, self.seq))
    }

    fn wait(self: Box<Self>) -> Result<Tensor> {
        let deadline = Instant::now() + self.world.timeout;
        let mut st = lock(&self.group.state);
        loop {
            if let Some(p) = st.messages.remove(&(self.src, self.rank, self.seq)) {
                // A rendezvous sender waits for the message to be taken.
                self.group.cv.notify_all();
                drop(st);
                // The buffer was copied at send time and is owned by this message alone; the
                // tensor built here is charged to the receiving thread's tracker.
                return Tensor::from_cpu(p.data, p.shape, Device::Cpu);
            }
            let src = self.group.members[self.src];
            if let Some(reason) = self.world.abort_reason(&[src]) {
                return Err(self.err(reason));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(self.err(CommErrorKind::Timeout {
                    missing: vec![src],
                    after: self.world.timeout,
                    detail: None,
                }));
            }
            st = self
                .group
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// A rendezvous send: completes when the receiver has taken the message.
struct SendWait {
    world: Arc<World>,
    group: Arc<Group>,
    rank: usize,
    dst: usize,
    seq: u64,
}

impl Pending<()> for SendWait {
    fn is_completed(&self) -> bool {
        !lock(&self.group.state)
            .messages
            .contains_key(&(self.rank, self.dst, self.seq))
    }

    fn wait(self: Box<Self>) -> Result<()> {
        let deadline = Instant::now() + self.world.timeout;
        let dst = self.group.members[self.dst];
        let err = |kind: CommErrorKind| {
            let e = Error::comm(
                self.group.members[self.rank],
                &self.group.members,
                "send",
                Some(self.seq),
                kind,
            );
            with_peer(e, dst)
        };
        let mut st = lock(&self.group.state);
        loop {
            if !st.messages.contains_key(&(self.rank, self.dst, self.seq)) {
                return Ok(());
            }
            if let Some(reason) = self.world.abort_reason(&[dst]) {
                return Err(err(reason));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(err(CommErrorKind::Timeout {
                    missing: vec![dst],
                    after: self.world.timeout,
                    detail: Some(
                        "rendezvous send: a schedule that sends before the matching receive is \
                         posted deadlocks on a real backend"
                            .into(),
                    ),
                }));
            }
            st = self
                .group
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
