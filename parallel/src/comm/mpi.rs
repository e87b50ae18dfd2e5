//! The MPI backend (cargo feature `mpi`): one rank per process, over the system's MPI (Open MPI
//! on Debian), for runs started by `mpirun -np N`.
//!
//! # Design
//!
//! MPI communicators are `!Send` and the trait's are shared as `Arc<dyn Communicator>`, so one
//! dedicated **MPI thread** per process owns every MPI object: it initialises MPI
//! (`MPI_THREAD_MULTIPLE` is requested only so that the panic hook may call `MPI_Abort` from any
//! thread), duplicates `MPI_COMM_WORLD`, creates the sub-communicators, and finalises MPI at
//! [`finalize`]. Every [`MpiCommunicator`] call sends a request over a channel and returns a
//! [`Work`] at once; the MPI thread launches the matching **nonblocking** MPI operation
//! (`MPI_Iallreduce`, `MPI_Ireduce_scatter_block`, `MPI_Iallgather`, `MPI_Ibcast`,
//! `MPI_Ialltoallv`, `MPI_Ibarrier`, `MPI_Isend`, matched probe + `MPI_Imrecv`), polls every
//! operation in flight with `MPI_Test` and hands each result to its `Work` when it completes.
//! So communication overlaps compute as with the in-process backend, and two ranks that send to
//! each other at the same time do not deadlock. Operations are launched in the order they are issued, which is what
//! MPI's matching rule for collectives needs (the trait's matching rule is the same);
//! [`Communicator::batch_p2p`] hands a batch of sends and receives over as one request, launched
//! in one go. When nothing is in flight the thread waits for requests 10 ms at a time, so that it
//! keeps answering the watchdog's queries.
//!
//! # The watchdog
//!
//! The MPI thread numbers every operation as the trait does (the k-th collective on a group, the
//! k-th send to or receive from a peer) and notes when it launched it. Operations are never
//! waited for inside MPI (only `MPI_Test`), so the thread notices when one is late:
//!
//! 1. A grace before the timeout (a quarter of it, at most 5 s), it asks the peers the oldest
//!    pending operation waits for (every other member for a collective, the peer for a send or
//!    receive) how far they are on that group. The questions travel on a second duplicate of
//!    `MPI_COMM_WORLD`, the *control* communicator, which every rank's MPI thread probes in its
//!    loop (`MPI_Improbe` + `MPI_Mrecv`; answers go back with `MPI_Isend`). A group is named by a
//!    key every member derives alike (its parent's key, its members, its tag, and how many such
//!    groups were made before). The answer: how many collectives the peer has started on the
//!    group and the last one's name, how many messages it sent to the asker and how many
//!    receives it posted from it. The MPI thread of a rank whose main thread is busy (or stuck
//!    outside MPI) still answers.
//! 2. At the timeout (`MpiCommunicator::set_timeout`, default [`DEFAULT_TIMEOUT`]; `meshgrad
//!    train` passes `--collective-timeout`), if the operation is still pending, it fails with a
//!    [`CommErrorKind::Timeout`] naming the peers that had not started it (or sent, or posted the
//!    receive) and what they are doing: `rank 0: all_reduce #1 on group [0,1,2,3]: ranks 2, 3
//!    did not join within 2s (rank 2 is at all_reduce #0; rank 3 is at all_reduce #0)`. A peer
//!    that did not answer is named as gone or stuck. Every surviving rank waiting on the late
//!    rank times out the same way and names it.
//! 3. MPI cannot cancel a collective, so the backend then stops: every other pending operation
//!    fails ([`CommErrorKind::PeerFailed`], naming this rank and the timeout), later calls fail at
//!    once, buffers MPI may still use are kept, and [`finalize`] ends the job with `MPI_Abort`
//!    instead of `MPI_Finalize`. The caller reports the error and calls [`abort`] (as `meshgrad
//!    train` does), which waits the grace plus half a second before `MPI_Abort` so that the other
//!    surviving ranks can report theirs.
//!
//! Group creation is watched too: before the blocking `MPI_Comm_create_group`, every member sends
//! every other member a token (the new group's key) on the control communicator and waits for
//! theirs as a watched operation, so a member that never comes is named (`new_group #0 on group
//! [0,1,2,3]: rank 3 did not join within 2s (it has not started creating this group)`), members
//! that create different groups at the same point fail naming the other group, and
//! `MPI_Comm_create_group` runs only once every member is there.
//!
//! Limits: the timeout counts from the launch, not from [`Work::wait`] (an operation launched
//! long before its peers reach it counts as late); a rank inside `MPI_Comm_create_group` (brief,
//! since every member has arrived) answers no queries.
//!
//! # What differs from the in-process backend
//!
//! * **Reduction order.** MPI chooses the algorithm (Open MPI: recursive doubling, rings, ...),
//!   so sums are *not* combined in rank order and are not bit-identical to the in-process
//!   backend's; the MPI standard does not promise equal bits on every rank either (see the
//!   [`comm`](super) docs). f32/f64/integer sums and maxima use MPI's predefined operations (`MPI_MAX` on
//!   floats does not promise to propagate NaN). bf16 and f16 travel as 16-bit values and are
//!   combined by a user operation that adds each pair in f32 and rounds back, so a sum over `w`
//!   ranks is rounded up to `w - 1` times (NCCL behaves the same), instead of once.
//!   [`ReduceOp::Avg`] is the sum divided by the group size on each rank (integers: an error).
//! * **In place.** Reductions run in place (`MPI_IN_PLACE`) on the copy of the input that becomes
//!   the result, so an all-reduce holds one buffer, not two; a reduce-scatter reduces the whole
//!   buffer in place and keeps this rank's block; an all-gather writes into the output. The rsmpi
//!   crate does not export `MPI_IN_PLACE`: its value is taken from the library's name (Open MPI
//!   `(void*)1`, MPICH `(void*)-1`); another MPI falls back to a separate send buffer.
//! * **Groups.** [`Communicator::new_group`] is called only by the new group's members, as the
//!   trait says, and maps onto `MPI_Comm_create_group` (MPI 3), which is collective over exactly
//!   those members (not over the parent), after the members' token exchange (see the watchdog).
//!   So the members must create overlapping groups in the same order; [`crate::DeviceMesh`] does (every rank builds its groups dimension by dimension in
//!   the same order). The trait's tag becomes the MPI tag of the creation (a hash).
//! * **Failures.** Every failure is an [`Error::Comm`] naming the rank, the group, the call and
//!   (once numbered) its sequence number. Mismatched calls are not detected (MPI may fail with a
//!   truncation error or hang until the watchdog). An all-to-all is one `MPI_Ialltoallv` with
//!   counts and displacements in elements, so MPI sees sizes only, and the standard calls
//!   disagreeing counts erroneous. Seen with Open MPI 4.1: a rank that expects more rows than
//!   its peer sends gets zeros for the missing ones; fewer (but some) fails with MPI's
//!   truncation error and the job ends; none leaves the peer's message unreceived, which breaks
//!   a later collective; a different trailing shape of the same size goes unnoticed. Get the
//!   receive splits from [`super::all_to_all_splits`] (itself one all-to-all of one count per
//!   rank, so always consistent) rather than computing them separately on each rank. A rank
//!   that stops joining is named by the watchdog (above). A panic in any thread of any rank calls `MPI_Abort` (a hook installed by
//!   [`MpiCommunicator::world`]), so the whole job ends with a non-zero status instead of
//!   hanging; [`abort`] does the same for errors.
//! * **Limits.** MPI counts are `int`: one operation moves at most 2^31 - 1 elements (a message
//!   at most 2^31 - 1 bytes).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::{bf16, f16};
use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{cpu_map, CommError, CommErrorKind, DType, Device, Error, Result, Tensor};
use mpi::ffi;

use super::call::checks;
use super::{format_ranks, Communicator, P2pOp, P2pWork, Pending, ReduceOp, Work};

/// Whether this process was started by an MPI launcher as one rank of several
/// (`OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or `PMIX_RANK` with a size above 1). Reads only the
/// environment: MPI is not initialised.
pub fn launched_by_mpi() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .filter(|&n| n > 1)
}

/// The tag of point-to-point messages (header and data travel as one message).
const P2P_TAG: c_int = 7;

/// One rank's handle on a group of MPI ranks (see the [module docs](self)).
pub struct MpiCommunicator {
    engine: Arc<Engine>,
    /// Index of the MPI communicator in the MPI thread's table.
    id: usize,
    rank: usize,
    ranks: Vec<usize>,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiCommunicator(rank {} of {})",
            self.rank,
            format_ranks(&self.ranks)
        )
    }
}

/// The process's side of the MPI thread.
struct Engine {
    tx: Mutex<Option<Sender<Request>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    world_rank: usize,
    world_size: usize,
}

static ENGINE: OnceLock<std::result::Result<Arc<Engine>, String>> = OnceLock::new();
/// Set between a successful `MPI_Init_thread` and `MPI_Finalize`: the panic hook aborts only then.
static LIVE: AtomicBool = AtomicBool::new(false);
static WORLD_RANK: AtomicUsize = AtomicUsize::new(0);
/// The watchdog's timeout in milliseconds (see [`MpiCommunicator::set_timeout`]).
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64);
/// Set when the watchdog failed an operation: [`finalize`] then aborts the job, and [`abort`]
/// first gives the other ranks a moment to report their own timeouts.
static WATCHDOG_FIRED: AtomicBool = AtomicBool::new(false);

/// The watchdog's default timeout: an operation that has not completed 5 minutes after it was
/// launched fails (see [`MpiCommunicator::set_timeout`]).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

fn timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// How long before the timeout the watchdog asks the peers for their progress (their answers
/// must arrive within it): a quarter of the timeout, at most 5 s.
fn grace(t: Duration) -> Duration {
    (t / 4).min(Duration::from_secs(5))
}

type Reply<T> = Sender<Result<T>>;

enum Request {
    AllReduce(usize, CpuStorage, ReduceOp, Reply<CpuStorage>),
    ReduceScatter(usize, CpuStorage, ReduceOp, Reply<CpuStorage>),
    AllGather(usize, CpuStorage, Reply<CpuStorage>),
    Broadcast(usize, CpuStorage, usize, Reply<CpuStorage>),
    /// The input and the elements sent to and received from each group rank.
    AllToAll(usize, CpuStorage, Vec<usize>, Vec<usize>, Reply<CpuStorage>),
    Barrier(usize, Reply<()>),
    Send(usize, Vec<u8>, usize, Reply<()>),
    Recv(usize, usize, Reply<Vec<u8>>),
    NewGroup(usize, Vec<usize>, String, c_int, Reply<usize>),
    /// Sends and receives launched together ([`Communicator::batch_p2p`]).
    Batch(Vec<Request>),
    Shutdown,
}

/// Ends the whole MPI job with `code` (`MPI_Abort` on the world), e.g. after an error on this
/// rank that its peers cannot know about. Exits the process when MPI is not running. After a
/// watchdog timeout on this rank it first waits a little (the watchdog's grace plus half a
/// second), so that the other surviving ranks, whose operations time out at about the same
/// moment, can report their own errors before `MPI_Abort` ends them.
pub fn abort(code: i32) -> ! {
    if LIVE.load(Ordering::SeqCst) {
        if WATCHDOG_FIRED.load(Ordering::SeqCst) {
            std::thread::sleep(grace(timeout()) + Duration::from_millis(500));
        }
        // SAFETY: MPI is initialised (LIVE) with MPI_THREAD_MULTIPLE requested, and
        // MPI_COMM_WORLD is a valid handle for the whole life of MPI; MPI_Abort may be called from
        // any thread and does not return.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
        }
    }
    std::process::exit(code)
}

/// Waits for every operation in flight, then finalises MPI (`MPI_Finalize`, on the MPI thread).
/// Collective over the world: every rank calls it. Afterwards no communicator works and MPI
/// cannot be initialised again in this process. After a watchdog timeout MPI cannot be finalised
/// cleanly (operations that will never complete are in flight), so it ends the job with
/// [`abort`]`(1)` instead.
pub fn finalize() {
    if let Some(Ok(engine)) = ENGINE.get() {
        if let Some(tx) = engine.tx.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = tx.send(Request::Shutdown);
        }
        if let Some(t) = engine
            .thread
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = t.join();
        }
        if WATCHDOG_FIRED.load(Ordering::SeqCst) {
            abort(1);
        }
    }
}

/// The exit code of a job whose rank panicked (the code Rust gives a panicking process).
const PANIC_ABORT_CODE: i32 = 101;

fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if LIVE.load(Ordering::SeqCst) {
            // One write, so a launcher tagging output lines by rank sees the whole line (the
            // wording is what `meshgrad launch --backend mpi` reads to name the failed rank).
            let line = format!(
                "{}\n",
                super::panic_abort_line(WORLD_RANK.load(Ordering::SeqCst), PANIC_ABORT_CODE)
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            abort(PANIC_ABORT_CODE);
        }
    }));
}

impl MpiCommunicator {
    /// The world communicator of this process, initialising MPI (and starting the MPI thread) on
    /// the first call. Also installs the panic hook that aborts the job. Fails when MPI was
    /// already initialised by someone else or finalised.
    pub fn world() -> Result<Arc<MpiCommunicator>> {
        let engine = ENGINE
            .get_or_init(|| {
                let (init_tx, init_rx) = channel();
                let (tx, rx) = channel();
                let thread = std::thread::Builder::new()
                    .name("meshgrad-mpi".into())
                    .spawn(move || mpi_thread(rx, init_tx))
                    .map_err(|e| format!("could not start the MPI thread: {e}"))?;
                let (world_rank, world_size) = init_rx
                    .recv()
                    .map_err(|_| "the MPI thread ended during MPI_Init".to_string())??;
                install_panic_hook();
                Ok(Arc::new(Engine {
                    tx: Mutex::new(Some(tx)),
                    thread: Mutex::new(Some(thread)),
                    world_rank,
                    world_size,
                }))
            })
            .clone()
            .map_err(Error::msg)?;
        Ok(Arc::new(MpiCommunicator {
            id: 0,
            rank: engine.world_rank,
            ranks: (0..engine.world_size).collect(),
            engine,
        }))
    }

    /// Sets the watchdog's timeout for every communicator of this process (default
    /// [`DEFAULT_TIMEOUT`]): an operation (collective, send, receive, barrier) that has not
    /// completed `timeout` after it was launched fails on this rank with a
    /// [`CommErrorKind::Timeout`] naming the missing rank(s), the call, its sequence number and
    /// the group; the MPI backend then stops (see the [module docs](self)).
    pub fn set_timeout(&self, timeout: Duration) {
        let ms = timeout.as_millis().clamp(1, u64::MAX as u128) as u64;
        TIMEOUT_MS.store(ms, Ordering::Relaxed);
    }

    /// The watchdog's timeout.
    pub fn timeout(&self) -> Duration {
        timeout()
    }

    /// Hands `request` to the MPI thread.
    fn post(&self, call: &'static str, request: Request) -> Result<()> {
        let guard = self.engine.tx.lock().unwrap_or_else(|e| e.into_inner());
        let backend = |m: &str| {
            Error::comm(
                self.global_rank(),
                &self.ranks,
                call,
                None,
                CommErrorKind::Backend(m.into()),
            )
        };
        let sender = guard.as_ref().ok_or_else(|| backend("MPI was finalized"))?;
        sender
            .send(request)
            .map_err(|_| backend("the MPI thread has ended"))
    }

    fn send_request<T: Send + 'static>(
        &self,
        call: &'static str,
        make: impl FnOnce(Reply<T>) -> Request,
    ) -> Result<Work<T>> {
        let (tx, work) = waiting();
        self.post(call, make(tx))?;
        Ok(work)
    }

    fn err(&self, call: &'static str, msg: impl std::fmt::Display) -> Error {
        Error::comm(
            self.global_rank(),
            &self.ranks,
            call,
            None,
            CommErrorKind::Invalid(msg.to_string()),
        )
    }
}

/// A reply channel for the MPI thread and the [`Work`] that waits on it.
fn waiting<T: Send + 'static>() -> (Reply<T>, Work<T>) {
    let (tx, rx) = channel();
    let work = Work::pending(Box::new(Waiting {
        rx,
        done: Mutex::new(None),
    }));
    (tx, work)
}

/// A [`Pending`] whose result the MPI thread sends when the operation completes.
struct Waiting<T> {
    rx: Receiver<Result<T>>,
    done: Mutex<Option<Result<T>>>,
}

impl<T: Send> Pending<T> for Waiting<T> {
    fn is_completed(&self) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if done.is_some() {
            return true;
        }
        match self.rx.try_recv() {
            Ok(r) => {
                *done = Some(r);
                true
            }
            Err(TryRecvError::Empty) => false,
            Err(TryRecvError::Disconnected) => true,
        }
    }

    fn wait(self: Box<Self>) -> Result<T> {
        if let Some(r) = self.done.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return r;
        }
        self.rx
            .recv()
            .unwrap_or_else(|_| Err(Error::msg("the MPI thread ended before the operation")))
    }
}

fn tensor_of(data: CpuStorage, dims: Vec<usize>) -> Result<Tensor> {
    Tensor::from_cpu(data, dims, Device::Cpu)
}

impl Communicator for MpiCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.ranks.len()
    }

    fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        checks::reduce_op(op, tensor.dtype()).map_err(|m| self.err("all_reduce", m))?;
        let dims = tensor.dims().to_vec();
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request("all_reduce", |r| Request::AllReduce(id, data, op, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let w = self.world_size();
        checks::reduce_scatter(tensor.shape(), tensor.dtype(), op, w)
            .map_err(|m| self.err("reduce_scatter", m))?;
        let mut dims = tensor.dims().to_vec();
        dims[0] /= w;
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request("reduce_scatter", |r| {
                Request::ReduceScatter(id, data, op, r)
            })?
            .map(move |d| tensor_of(d, dims)))
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        let w = self.world_size();
        let mut dims = tensor.dims().to_vec();
        if dims.is_empty() {
            dims.push(w);
        } else {
            dims[0] *= w;
        }
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request("all_gather", |r| Request::AllGather(id, data, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        checks::root(root, self.world_size()).map_err(|m| self.err("broadcast", m))?;
        let dims = tensor.dims().to_vec();
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request("broadcast", |r| Request::Broadcast(id, data, root, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn all_to_all(
        &self,
        tensor: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Work> {
        let (dims, send, recv) = checks::all_to_all_elements(
            tensor.shape(),
            send_splits,
            recv_splits,
            self.world_size(),
        )
        .map_err(|m| self.err("all_to_all", m))?;
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request("all_to_all", |r| Request::AllToAll(id, data, send, recv, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        checks::peer("send", dst, self.rank, self.world_size(), "destination")
            .map_err(|m| self.err("send", m))?;
        let bytes = encode(tensor)?;
        let id = self.id;
        self.send_request("send", |r| Request::Send(id, bytes, dst, r))
    }

    fn recv(&self, src: usize) -> Result<Work> {
        checks::peer("recv", src, self.rank, self.world_size(), "source")
            .map_err(|m| self.err("recv", m))?;
        let id = self.id;
        Ok(self
            .send_request("recv", |r| Request::Recv(id, src, r))?
            .map(|b| decode(&b)))
    }

    fn batch_p2p(&self, ops: Vec<P2pOp>) -> Result<Vec<P2pWork>> {
        // Every operation is checked (and every message encoded) before any is posted; the MPI
        // thread then launches them in one go, in order.
        let mut requests = Vec::with_capacity(ops.len());
        let mut works = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                P2pOp::Send { tensor, peer } => {
                    checks::peer("send", peer, self.rank, self.world_size(), "destination")
                        .map_err(|m| self.err("send", m))?;
                    let (tx, work) = waiting();
                    requests.push(Request::Send(self.id, encode(&tensor)?, peer, tx));
                    works.push(P2pWork::Send(work));
                }
                P2pOp::Recv { peer } => {
                    checks::peer("recv", peer, self.rank, self.world_size(), "source")
                        .map_err(|m| self.err("recv", m))?;
                    let (tx, work) = waiting::<Vec<u8>>();
                    requests.push(Request::Recv(self.id, peer, tx));
                    works.push(P2pWork::Recv(work.map(|b| decode(&b))));
                }
            }
        }
        self.post("batch_p2p", Request::Batch(requests))?;
        Ok(works)
    }

    fn barrier(&self) -> Result<Work<()>> {
        let id = self.id;
        self.send_request("barrier", |r| Request::Barrier(id, r))
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let my = super::group_position(ranks, self.world_size(), self.rank)
            .map_err(|m| self.err("new_group", m))?;
        // A stable hash of the tag (FNV-1a), within the 15 bits every MPI allows for tags.
        let h = tag.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ b as u32).wrapping_mul(0x0100_0193)
        });
        let mpi_tag = (h & 0x3fff) as c_int;
        let id = self.id;
        let group = ranks.to_vec();
        let tag = tag.to_string();
        let new_id = self
            .send_request("new_group", |r| {
                Request::NewGroup(id, group, tag, mpi_tag, r)
            })?
            .wait()?;
        Ok(Arc::new(MpiCommunicator {
            engine: self.engine.clone(),
            id: new_id,
            rank: my,
            ranks: ranks.iter().map(|&r| self.ranks[r]).collect(),
        }))
    }
}

// ---- point-to-point encoding: [dtype code, ndim, dims as u64 LE..., data bytes] ----

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::F64 => 0,
        DType::F32 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        DType::U8 => 4,
        DType::U32 => 5,
        DType::I64 => 6,
    }
}

fn encode(t: &Tensor) -> Result<Vec<u8>> {
    let data = t.to_cpu_storage()?;
    let dims = t.dims();
    let mut out = Vec::with_capacity(2 + 8 * dims.len() + data.as_bytes().len());
    out.push(dtype_code(t.dtype()));
    out.push(dims.len() as u8);
    for &d in dims {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    out.extend_from_slice(data.as_bytes());
    Ok(out)
}

fn decode(b: &[u8]) -> Result<Tensor> {
    let bad = || Error::msg("recv: a malformed message");
    let (&code, rest) = b.split_first().ok_or_else(bad)?;
    let (&ndim, rest) = rest.split_first().ok_or_else(bad)?;
    let ndim = ndim as usize;
    if rest.len() < 8 * ndim {
        return Err(bad());
    }
    let dims: Vec<usize> = rest[..8 * ndim]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let payload = &rest[8 * ndim..];
    fn cast<T: bytemuck::Pod + bytemuck::Zeroable>(p: &[u8]) -> Vec<T> {
        // Copies into a properly aligned Vec whatever the input's alignment.
        let n = p.len() / std::mem::size_of::<T>();
        let mut v = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut v)
            .copy_from_slice(&p[..n * std::mem::size_of::<T>()]);
        v
    }
    let data = match code {
        0 => CpuStorage::F64(cast(payload)),
        1 => CpuStorage::F32(cast(payload)),
        2 => CpuStorage::BF16(cast(payload)),
        3 => CpuStorage::F16(cast(payload)),
        4 => CpuStorage::U8(payload.to_vec()),
        5 => CpuStorage::U32(cast(payload)),
        6 => CpuStorage::I64(cast(payload)),
        _ => return Err(bad()),
    };
    tensor_of(data, dims)
}

// ---- the MPI thread ----

/// The predefined or user operations the MPI thread uses.
struct Ops {
    sum: ffi::MPI_Op,
    max: ffi::MPI_Op,
    f32_max: ffi::MPI_Op,
    f64_max: ffi::MPI_Op,
    bf16_sum: ffi::MPI_Op,
    bf16_max: ffi::MPI_Op,
    f16_sum: ffi::MPI_Op,
    f16_max: ffi::MPI_Op,
}

trait Elem: Copy {
    fn f(self) -> f64;
    fn from_f(v: f64) -> Self;
}
impl Elem for f32 {
    fn f(self) -> f64 {
        self as f64
    }
    fn from_f(v: f64) -> Self {
        v as f32
    }
}
impl Elem for f64 {
    fn f(self) -> f64 {
        self
    }
    fn from_f(v: f64) -> Self {
        v
    }
}
impl Elem for bf16 {
    fn f(self) -> f64 {
        self.to_f32() as f64
    }
    fn from_f(v: f64) -> Self {
        bf16::from_f32(v as f32)
    }
}
impl Elem for f16 {
    fn f(self) -> f64 {
        self.to_f32() as f64
    }
    fn from_f(v: f64) -> Self {
        f16::from_f32(v as f32)
    }
}

/// `inout[i] = in[i] + inout[i]`, added in f32 and rounded back (for bf16/f16).
unsafe extern "C" fn half_sum<T: Elem>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _ty: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI calls a user operation with two buffers of `*len` elements of the datatype it
    // was registered for (u16 carrying T, 2 bytes, same alignment); they do not overlap.
    let (a, b) = unsafe {
        let n = *len as usize;
        (
            std::slice::from_raw_parts(input as *const T, n),
            std::slice::from_raw_parts_mut(inout as *mut T, n),
        )
    };
    for (x, y) in a.iter().zip(b.iter_mut()) {
        *y = T::from_f((x.f() as f32 + y.f() as f32) as f64);
    }
}

/// `inout[i] = max(in[i], inout[i])`, NaN propagating.
unsafe extern "C" fn nan_max<T: Elem>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _ty: *mut ffi::MPI_Datatype,
) {
    // SAFETY: as in `half_sum`: two non-overlapping buffers of `*len` elements of type T.
    let (a, b) = unsafe {
        let n = *len as usize;
        (
            std::slice::from_raw_parts(input as *const T, n),
            std::slice::from_raw_parts_mut(inout as *mut T, n),
        )
    };
    for (x, y) in a.iter().zip(b.iter_mut()) {
        let (xf, yf) = (x.f(), y.f());
        if xf.is_nan() || xf > yf {
            *y = *x;
        }
    }
}

fn check(code: c_int, what: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let mut buf = vec![0 as std::ffi::c_char; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer has room for MPI_MAX_ERROR_STRING (256 on Open MPI and MPICH) bytes.
    unsafe {
        ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len);
    }
    let msg: String = buf[..len.max(0) as usize]
        .iter()
        .map(|&c| c as u8 as char)
        .collect();
    Err(Error::msg(format!("{what}: MPI error {code}: {msg}")))
}

fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::msg(format!(
            "{what}: {n} elements exceed MPI's count limit (2^31 - 1)"
        ))
    })
}

fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: the RSMPI_* handles are constants set by MPI's headers, valid after MPI_Init.
    unsafe {
        match d {
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
            DType::U32 => ffi::RSMPI_UINT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
        }
    }
}

fn op_for(ops: &Ops, op: ReduceOp, d: DType) -> ffi::MPI_Op {
    match (op, d) {
        (ReduceOp::Sum | ReduceOp::Avg, DType::BF16) => ops.bf16_sum,
        (ReduceOp::Sum | ReduceOp::Avg, DType::F16) => ops.f16_sum,
        (ReduceOp::Sum | ReduceOp::Avg, _) => ops.sum,
        (ReduceOp::Max, DType::BF16) => ops.bf16_max,
        (ReduceOp::Max, DType::F16) => ops.f16_max,
        (ReduceOp::Max, DType::F32) => ops.f32_max,
        (ReduceOp::Max, DType::F64) => ops.f64_max,
        (ReduceOp::Max, _) => ops.max,
    }
}

/// Divides every element by `n` (the average's division; float dtypes only).
fn divide(s: &mut CpuStorage, n: usize) {
    fn each<T: Elem>(v: &mut [T], n: usize) {
        for x in v {
            *x = T::from_f(x.f() / n as f64);
        }
    }
    match s {
        CpuStorage::F32(v) => v.iter_mut().for_each(|x| *x /= n as f32),
        CpuStorage::F64(v) => v.iter_mut().for_each(|x| *x /= n as f64),
        CpuStorage::BF16(v) => each(v, n),
        CpuStorage::F16(v) => each(v, n),
        _ => {}
    }
}

fn ptr(s: &mut CpuStorage) -> *mut c_void {
    cpu_map!(s, v => v.as_mut_ptr() as *mut c_void)
}

/// How an operation's result is finished once MPI completes it.
enum Finish {
    Storage {
        data: CpuStorage,
        /// The separate send buffer, when MPI_IN_PLACE is unknown or the call has one (kept
        /// alive until completion).
        _send: Option<CpuStorage>,
        /// Count and displacement arrays MPI reads until completion (`MPI_Ialltoallv`).
        _args: Vec<Vec<c_int>>,
        avg: Option<usize>,
        keep: Option<usize>,
        reply: Reply<CpuStorage>,
    },
    /// The buffer is only kept alive (a send's message) until MPI completes.
    Unit(#[allow(dead_code)] Vec<u8>, Reply<()>),
    Bytes(Vec<u8>, Reply<Vec<u8>>),
}

/// What the watchdog knows of an operation: its group, call and sequence number, and when it was
/// launched.
#[derive(Clone, Debug)]
struct OpInfo {
    /// Unique in this process.
    id: u64,
    /// Index of the communicator in the MPI thread's table.
    comm: usize,
    call: &'static str,
    /// The n-th collective on the group, or the n-th send to / receive from `peer`.
    seq: u64,
    /// The other side (group rank) of a send or receive.
    peer: Option<usize>,
    started: Instant,
    /// For a group being created: its key and its members (global ranks).
    group: Option<(String, Vec<usize>)>,
}

/// A group being created: every member sends every other a token on the control communicator
/// (a watched operation) before the blocking `MPI_Comm_create_group`, which then finds every
/// member there.
struct Creating {
    op: OpInfo,
    /// The members as ranks of the parent group.
    ranks: Vec<usize>,
    mpi_tag: c_int,
    reply: Reply<usize>,
    /// The token receives: (source, request, buffer, done).
    tokens: Vec<(usize, ffi::MPI_Request, Vec<u8>, bool)>,
}

/// The tag of group-creation tokens on the control communicator.
const CTRL_TOKEN: c_int = 13;

struct InFlight {
    req: ffi::MPI_Request,
    finish: Finish,
    op: OpInfo,
}

impl Finish {
    fn complete(self, r: Result<()>) {
        match self {
            Finish::Storage {
                mut data,
                avg,
                keep,
                reply,
                ..
            } => {
                let r = r.map(|()| {
                    if let Some(keep) = keep {
                        cpu_map!(&mut data, v => v.truncate(keep));
                    }
                    if let Some(n) = avg {
                        divide(&mut data, n);
                    }
                    data
                });
                let _ = reply.send(r);
            }
            Finish::Unit(_, reply) => {
                let _ = reply.send(r);
            }
            Finish::Bytes(b, reply) => {
                let _ = reply.send(r.map(|()| b));
            }
        }
    }

    fn fail(self, e: Error) {
        self.complete(Err(e))
    }

    /// Fails the operation's handle now while the buffers stay here (MPI may still use them).
    fn reply_err(&self, e: Error) {
        match self {
            Finish::Storage { reply, .. } => {
                let _ = reply.send(Err(e));
            }
            Finish::Unit(_, reply) => {
                let _ = reply.send(Err(e));
            }
            Finish::Bytes(_, reply) => {
                let _ = reply.send(Err(e));
            }
        }
    }
}

/// One communicator of the MPI thread's table, with the counters the watchdog reports.
struct Comm {
    handle: ffi::MPI_Comm,
    /// The members' global ranks, in group order.
    members: Vec<usize>,
    /// This rank's group rank.
    me: usize,
    /// The same on every member: how peers name this group in watchdog queries.
    key: String,
    /// Collectives launched on the group (the next one's sequence number) and the last one's name.
    colls: u64,
    last: &'static str,
    /// Sends launched to, and receives posted from, each group rank.
    sends: HashMap<usize, u64>,
    recvs: HashMap<usize, u64>,
}

impl Comm {
    fn new(handle: ffi::MPI_Comm, members: Vec<usize>, me: usize, key: String) -> Comm {
        Comm {
            handle,
            members,
            me,
            key,
            colls: 0,
            last: "",
            sends: HashMap::new(),
            recvs: HashMap::new(),
        }
    }
}

/// A peer's answer to a watchdog query about one group.
#[derive(Debug)]
struct Answer {
    /// Whether the peer has created the group.
    known: bool,
    colls: u64,
    last: String,
    /// Sends the peer launched to the asking rank, and receives it posted from it.
    sent_to_you: u64,
    recvd_from_you: u64,
}

/// A watchdog query in progress: the late operation, whom it asked and what they answered.
struct Diag {
    op: OpInfo,
    qid: u64,
    asked: Vec<usize>,
    answers: HashMap<usize, Answer>,
}

/// Tags on the control communicator: a progress query and its answer.
const CTRL_QUERY: c_int = 11;
const CTRL_ANSWER: c_int = 12;

/// A receive posted before its message arrived.
type WaitingRecv = (OpInfo, Reply<Vec<u8>>);

struct State {
    comms: Vec<Comm>,
    ops: Ops,
    in_place: Option<*mut c_void>,
    flight: Vec<InFlight>,
    /// Receives waiting for their message, per (communicator, source), in issue order.
    recvs: HashMap<(usize, usize), VecDeque<WaitingRecv>>,
    world_rank: usize,
    /// A duplicate of the world on which the MPI threads ask each other for progress.
    ctrl: ffi::MPI_Comm,
    /// Control messages in flight (answers and queries) with their buffers.
    ctrl_sends: Vec<(ffi::MPI_Request, Vec<u8>)>,
    next_id: u64,
    diag: Option<Diag>,
    /// The watchdog's error, once it fired: every later request fails with it.
    failed: Option<Error>,
    /// Operations abandoned when the watchdog fired: their buffers stay alive (MPI may still
    /// write into them) until the job ends.
    zombies: Vec<InFlight>,
    /// Groups being created (waiting for the other members' tokens).
    creating: Vec<Creating>,
    /// Token receives abandoned when the watchdog fired (their buffers stay alive).
    abandoned: Vec<(usize, ffi::MPI_Request, Vec<u8>, bool)>,
    /// How many groups with these (parent key, members, tag) this rank created.
    group_counts: HashMap<(String, Vec<usize>, String), u64>,
}

fn mpi_thread(rx: Receiver<Request>, init: Sender<std::result::Result<(usize, usize), String>>) {
    let Some((universe, _threading)) =
        mpi::initialize_with_threading(mpi::environment::Threading::Multiple)
    else {
        let _ = init.send(Err(
            "MPI could not be initialised (already initialised or finalized)".into(),
        ));
        return;
    };
    let setup = || -> Result<State> {
        let mut world: ffi::MPI_Comm;
        let mut ctrl: ffi::MPI_Comm;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialised on this thread; all handles passed are valid and the out
        // pointers point to live locals.
        unsafe {
            world = ffi::RSMPI_COMM_NULL;
            check(
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut world),
                "MPI_Comm_dup",
            )?;
            ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN);
            ctrl = ffi::RSMPI_COMM_NULL;
            check(
                ffi::MPI_Comm_dup(ffi::RSMPI_COMM_WORLD, &mut ctrl),
                "MPI_Comm_dup",
            )?;
            ffi::MPI_Comm_set_errhandler(ctrl, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(world, &mut rank);
            ffi::MPI_Comm_size(world, &mut size);
        }
        let user = |f: ffi::MPI_User_function| -> Result<ffi::MPI_Op> {
            // SAFETY: an op handle out-pointer and a valid `extern "C"` function.
            unsafe {
                let mut op = std::mem::zeroed::<ffi::MPI_Op>();
                check(ffi::MPI_Op_create(f, 1, &mut op), "MPI_Op_create")?;
                Ok(op)
            }
        };
        // SAFETY: predefined handles, valid after MPI_Init.
        let (sum, max) = unsafe { (ffi::RSMPI_SUM, ffi::RSMPI_MAX) };
        let ops = Ops {
            sum,
            max,
            f32_max: user(Some(nan_max::<f32>))?,
            f64_max: user(Some(nan_max::<f64>))?,
            bf16_sum: user(Some(half_sum::<bf16>))?,
            bf16_max: user(Some(nan_max::<bf16>))?,
            f16_sum: user(Some(half_sum::<f16>))?,
            f16_max: user(Some(nan_max::<f16>))?,
        };
        let mut buf = vec![0 as std::ffi::c_char; 8192];
        let mut len: c_int = 0;
        // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING on Open MPI and MPICH.
        unsafe {
            ffi::MPI_Get_library_version(buf.as_mut_ptr(), &mut len);
        }
        let lib: String = buf[..len.clamp(0, 8192) as usize]
            .iter()
            .map(|&c| c as u8 as char)
            .collect();
        // MPI_IN_PLACE is `(void *) 1` in Open MPI's mpi.h and `(void *) -1` in MPICH's.
        let in_place = if lib.contains("Open MPI") {
            Some(std::ptr::without_provenance_mut::<c_void>(1))
        } else if lib.contains("MPICH") {
            Some(std::ptr::without_provenance_mut::<c_void>(usize::MAX))
        } else {
            None
        };
        WORLD_RANK.store(rank as usize, Ordering::SeqCst);
        Ok(State {
            comms: vec![Comm::new(
                world,
                (0..size as usize).collect(),
                rank as usize,
                "world".into(),
            )],
            ops,
            in_place,
            flight: Vec::new(),
            recvs: HashMap::new(),
            world_rank: rank as usize,
            ctrl,
            ctrl_sends: Vec::new(),
            next_id: 0,
            diag: None,
            failed: None,
            zombies: Vec::new(),
            creating: Vec::new(),
            abandoned: Vec::new(),
            group_counts: HashMap::new(),
        })
    };
    let mut state = match setup() {
        Ok(s) => s,
        Err(e) => {
            let _ = init.send(Err(e.to_string()));
            return;
        }
    };
    LIVE.store(true, Ordering::SeqCst);
    let _ = init.send(Ok((state.world_rank, state.comms[0].members.len())));
    let mut shutdown = false;
    let mut idle = 0u32;
    loop {
        // New requests: wait a little when nothing is in flight (the control channel and the
        // watchdog still need the loop), else take what is there.
        let busy = !state.flight.is_empty()
            || !state.creating.is_empty()
            || state.recvs.values().any(|q| !q.is_empty());
        let mut progressed = false;
        if !shutdown {
            if !busy {
                match rx.recv_timeout(Duration::from_millis(10)) {
                    Ok(r) => {
                        shutdown |= state.launch(r);
                        progressed = true;
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => shutdown = true,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(r) => {
                        shutdown |= state.launch(r);
                        progressed = true;
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        shutdown = true;
                        break;
                    }
                }
            }
        }
        progressed |= state.poll();
        progressed |= state.poll_groups();
        progressed |= state.service_ctrl();
        state.watchdog();
        if shutdown && state.failed.is_some() {
            // Operations that will never complete are in flight: MPI cannot be finalised, and
            // `finalize` aborts the job. LIVE stays set so that `abort` calls MPI_Abort.
            std::mem::forget(universe);
            return;
        }
        if shutdown
            && state.flight.is_empty()
            && state.creating.is_empty()
            && state.recvs.values().all(|q| q.is_empty())
        {
            break;
        }
        if progressed {
            idle = 0;
        } else {
            idle += 1;
            if idle > 100 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }
    // Answers still in flight are small (sent eagerly): give them a moment, then let them go.
    let until = Instant::now() + Duration::from_secs(1);
    while !state.ctrl_sends.is_empty() && Instant::now() < until {
        state.service_ctrl();
        std::thread::yield_now();
    }
    // SAFETY: every request has completed; the communicators and ops were created by this thread.
    unsafe {
        for c in state.comms.iter_mut() {
            ffi::MPI_Comm_free(&mut c.handle);
        }
        if state.ctrl_sends.is_empty() {
            ffi::MPI_Comm_free(&mut state.ctrl);
        }
    }
    LIVE.store(false, Ordering::SeqCst);
    drop(universe); // MPI_Finalize
}

impl State {
    /// Numbers the next operation on communicator `c`: the next collective when `peer` is
    /// `None`, else the next send to / receive from `peer` (`call` says which).
    fn begin(&mut self, c: usize, call: &'static str, peer: Option<usize>) -> OpInfo {
        let comm = &mut self.comms[c];
        let seq = match peer {
            None => {
                comm.last = call;
                comm.colls += 1;
                comm.colls - 1
            }
            Some(p) => {
                let m = if call == "send" {
                    &mut comm.sends
                } else {
                    &mut comm.recvs
                };
                let n = m.entry(p).or_insert(0);
                *n += 1;
                *n - 1
            }
        };
        self.next_id += 1;
        OpInfo {
            id: self.next_id,
            comm: c,
            call,
            seq,
            peer,
            started: Instant::now(),
            group: None,
        }
    }

    /// A [`CommError`] about `op`.
    fn op_err(&self, op: &OpInfo, kind: CommErrorKind) -> Error {
        let comm = &self.comms[op.comm];
        Error::Comm(Box::new(CommError {
            rank: self.world_rank,
            group: comm.members.clone(),
            call: op.call,
            seq: Some(op.seq),
            peer: op.peer.map(|p| comm.members[p]),
            kind,
        }))
    }

    /// An MPI error code on `op` as a [`CommError`].
    fn backend_err(&self, op: &OpInfo, e: Error) -> Error {
        self.op_err(op, CommErrorKind::Backend(e.to_string()))
    }

    /// Launches one request; true for a shutdown.
    fn launch(&mut self, r: Request) -> bool {
        let r = match r {
            Request::Batch(rs) => {
                let mut shutdown = false;
                for r in rs {
                    shutdown |= self.launch(r);
                }
                return shutdown;
            }
            r => r,
        };
        if let Some(failed) = &self.failed {
            let e = |c: usize, call: &'static str| {
                Error::comm(
                    self.world_rank,
                    &self.comms[c].members,
                    call,
                    None,
                    CommErrorKind::Backend(format!(
                        "the MPI backend stopped after a watchdog timeout: {failed}"
                    )),
                )
            };
            match r {
                Request::Shutdown => return true,
                Request::AllReduce(c, _, _, reply) => drop(reply.send(Err(e(c, "all_reduce")))),
                Request::ReduceScatter(c, _, _, reply) => {
                    drop(reply.send(Err(e(c, "reduce_scatter"))))
                }
                Request::AllGather(c, _, reply) => drop(reply.send(Err(e(c, "all_gather")))),
                Request::Broadcast(c, _, _, reply) => drop(reply.send(Err(e(c, "broadcast")))),
                Request::AllToAll(c, _, _, _, reply) => drop(reply.send(Err(e(c, "all_to_all")))),
                Request::Barrier(c, reply) => drop(reply.send(Err(e(c, "barrier")))),
                Request::Send(c, _, _, reply) => drop(reply.send(Err(e(c, "send")))),
                Request::Recv(c, _, reply) => drop(reply.send(Err(e(c, "recv")))),
                Request::NewGroup(c, _, _, _, reply) => drop(reply.send(Err(e(c, "new_group")))),
                Request::Batch(_) => unreachable!("batches are unpacked above"),
            }
            return false;
        }
        match r {
            Request::Shutdown => return true,
            Request::AllReduce(c, data, op, reply) => self.reduce(c, data, op, false, reply),
            Request::ReduceScatter(c, data, op, reply) => self.reduce(c, data, op, true, reply),
            Request::AllGather(c, data, reply) => {
                let info = self.begin(c, "all_gather", None);
                let comm = &self.comms[c];
                let (w, n) = (comm.members.len(), data.len());
                let me = comm.me;
                let mut out = CpuStorage::zeros(data.dtype(), n * w);
                let (ty, handle) = (datatype(data.dtype()), comm.handle);
                let cnt = match count(n * w, "all_gather") {
                    Ok(_) => n as c_int,
                    Err(e) => {
                        let _ = reply.send(Err(self.backend_err(&info, e)));
                        return false;
                    }
                };
                let mut send = Some(data);
                let send_ptr: *const c_void = match self.in_place {
                    Some(ip) => {
                        let d = send.take().expect("data");
                        let bytes = d.as_bytes();
                        let o = cpu_map!(&mut out, v => bytemuck::cast_slice_mut::<_, u8>(v.as_mut_slice()));
                        let at = me * bytes.len();
                        o[at..at + bytes.len()].copy_from_slice(bytes);
                        ip
                    }
                    None => send.as_mut().map(ptr).expect("data"),
                };
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: `out` holds w * n elements and `send` (if any) n; both are kept in the
                // InFlight entry (heap buffers do not move) until MPI_Test reports completion.
                let code = unsafe {
                    ffi::MPI_Iallgather(
                        send_ptr,
                        cnt,
                        ty,
                        ptr(&mut out),
                        cnt,
                        ty,
                        handle,
                        req.as_mut_ptr(),
                    )
                };
                self.start(
                    code,
                    "MPI_Iallgather",
                    req,
                    Finish::Storage {
                        data: out,
                        _send: send,
                        _args: Vec::new(),
                        avg: None,
                        keep: None,
                        reply,
                    },
                    info,
                );
            }
            Request::Broadcast(c, mut data, root, reply) => {
                let info = self.begin(c, "broadcast", None);
                let n = match count(data.len(), "broadcast") {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = reply.send(Err(self.backend_err(&info, e)));
                        return false;
                    }
                };
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: the buffer of n elements lives in the InFlight entry until completion.
                let code = unsafe {
                    ffi::MPI_Ibcast(
                        ptr(&mut data),
                        n,
                        datatype(data.dtype()),
                        root as c_int,
                        self.comms[c].handle,
                        req.as_mut_ptr(),
                    )
                };
                self.start(
                    code,
                    "MPI_Ibcast",
                    req,
                    Finish::Storage {
                        data,
                        _send: None,
                        _args: Vec::new(),
                        avg: None,
                        keep: None,
                        reply,
                    },
                    info,
                );
            }
            Request::AllToAll(c, data, send, recv, reply) => {
                self.all_to_all(c, data, &send, &recv, reply)
            }
            Request::Barrier(c, reply) => {
                let info = self.begin(c, "barrier", None);
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: a valid communicator and request out pointer.
                let code = unsafe { ffi::MPI_Ibarrier(self.comms[c].handle, req.as_mut_ptr()) };
                self.start(
                    code,
                    "MPI_Ibarrier",
                    req,
                    Finish::Unit(Vec::new(), reply),
                    info,
                );
            }
            Request::Send(c, bytes, dst, reply) => {
                let info = self.begin(c, "send", Some(dst));
                let n = match count(bytes.len(), "send") {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = reply.send(Err(self.backend_err(&info, e)));
                        return false;
                    }
                };
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: the message buffer lives in the InFlight entry until completion.
                let code = unsafe {
                    ffi::MPI_Isend(
                        bytes.as_ptr() as *const c_void,
                        n,
                        ffi::RSMPI_UINT8_T,
                        dst as c_int,
                        P2P_TAG,
                        self.comms[c].handle,
                        req.as_mut_ptr(),
                    )
                };
                self.start(code, "MPI_Isend", req, Finish::Unit(bytes, reply), info);
            }
            Request::Recv(c, src, reply) => {
                let info = self.begin(c, "recv", Some(src));
                self.recvs
                    .entry((c, src))
                    .or_default()
                    .push_back((info, reply));
            }
            Request::NewGroup(c, ranks, tag, mpi_tag, reply) => {
                self.start_group(c, ranks, &tag, mpi_tag, reply)
            }
            Request::Batch(_) => unreachable!("batches are unpacked above"),
        }
        false
    }

    /// Starts creating a group over `ranks` (ranks of group `c`): numbers it, sends a token to
    /// every other member and posts the receives of theirs; [`State::poll_groups`] creates the
    /// communicator once every token is in.
    fn start_group(
        &mut self,
        c: usize,
        ranks: Vec<usize>,
        tag: &str,
        mpi_tag: c_int,
        reply: Reply<usize>,
    ) {
        let members: Vec<usize> = ranks.iter().map(|&r| self.comms[c].members[r]).collect();
        let instance = {
            let n = self
                .group_counts
                .entry((self.comms[c].key.clone(), members.clone(), tag.to_string()))
                .or_insert(0);
            *n += 1;
            *n - 1
        };
        let key = format!(
            "{}/{tag}{}#{instance}",
            self.comms[c].key,
            format_ranks(&members)
        );
        self.next_id += 1;
        let op = OpInfo {
            id: self.next_id,
            comm: c,
            call: "new_group",
            seq: instance,
            peer: None,
            started: Instant::now(),
            group: Some((key.clone(), members.clone())),
        };
        let mut tokens = Vec::new();
        let me = self.world_rank;
        for &m in members.iter().filter(|&&m| m != me) {
            self.ctrl_send(m, CTRL_TOKEN, key.as_bytes().to_vec());
            let mut buf = vec![0u8; key.len()];
            let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            // SAFETY: `buf` lives in the Creating entry (or `abandoned`) until the request
            // completes; `ctrl` is a valid communicator.
            let code = unsafe {
                ffi::MPI_Irecv(
                    buf.as_mut_ptr() as *mut c_void,
                    buf.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    m as c_int,
                    CTRL_TOKEN,
                    self.ctrl,
                    req.as_mut_ptr(),
                )
            };
            if let Err(e) = check(code, "MPI_Irecv") {
                let _ = reply.send(Err(self.backend_err(&op, e)));
                return;
            }
            // SAFETY: MPI initialised the request on success.
            tokens.push((m, unsafe { req.assume_init() }, buf, false));
        }
        self.creating.push(Creating {
            op,
            ranks,
            mpi_tag,
            reply,
            tokens,
        });
    }

    /// Tests the token receives of the groups being created; creates each group whose tokens
    /// are all in. True if anything moved.
    fn poll_groups(&mut self) -> bool {
        let mut moved = false;
        let mut i = 0;
        while i < self.creating.len() {
            let mut failed = None;
            for t in self.creating[i].tokens.iter_mut().filter(|t| !t.3) {
                let mut flag: c_int = 0;
                // SAFETY: an active request this thread started; the status is ignored.
                let code = unsafe { ffi::MPI_Test(&mut t.1, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                if code != 0 {
                    failed = Some(check(code, "MPI_Test").expect_err("an MPI error"));
                    t.3 = true;
                } else if flag != 0 {
                    t.3 = true;
                    moved = true;
                }
            }
            let g = &self.creating[i];
            let (key, _) = g.op.group.clone().expect("a group");
            if failed.is_none() {
                if let Some(t) = g.tokens.iter().find(|t| t.3 && t.2 != key.as_bytes()) {
                    failed = Some(Error::msg(format!(
                        "rank {} is creating another group ({}) at this point, not {key}",
                        t.0,
                        String::from_utf8_lossy(&t.2)
                    )));
                }
            }
            if failed.is_none() && !g.tokens.iter().all(|t| t.3) {
                i += 1;
                continue;
            }
            let g = self.creating.swap_remove(i);
            moved = true;
            let r = match failed {
                Some(e) => Err(self.backend_err(&g.op, e)),
                None => self.new_group(g.op.comm, &g.ranks, key, g.mpi_tag),
            };
            let _ = g.reply.send(r);
        }
        moved
    }

    /// Creates the communicator of a group whose members are all there (blocking).
    fn new_group(
        &mut self,
        c: usize,
        ranks: &[usize],
        key: String,
        mpi_tag: c_int,
    ) -> Result<usize> {
        let parent = self.comms[c].handle;
        let members: Vec<usize> = ranks.iter().map(|&r| self.comms[c].members[r]).collect();
        let me = members
            .iter()
            .position(|&m| m == self.world_rank)
            .expect("checked by MpiCommunicator::new_group");
        let ranks_c: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        let fail = |e: Error| {
            Error::comm(
                self.world_rank,
                &self.comms[c].members,
                "new_group",
                None,
                CommErrorKind::Backend(e.to_string()),
            )
        };
        // SAFETY: valid handles and out pointers; the groups are freed after use. Blocking
        // (collective over the new group's members only); operations in flight keep progressing
        // inside MPI meanwhile.
        let nc = unsafe {
            let mut pg = std::mem::zeroed::<ffi::MPI_Group>();
            check(ffi::MPI_Comm_group(parent, &mut pg), "MPI_Comm_group").map_err(fail)?;
            let mut g = std::mem::zeroed::<ffi::MPI_Group>();
            check(
                ffi::MPI_Group_incl(pg, ranks_c.len() as c_int, ranks_c.as_ptr(), &mut g),
                "MPI_Group_incl",
            )
            .map_err(fail)?;
            let mut nc = ffi::RSMPI_COMM_NULL;
            let code = ffi::MPI_Comm_create_group(parent, g, mpi_tag, &mut nc);
            ffi::MPI_Group_free(&mut g);
            ffi::MPI_Group_free(&mut pg);
            check(code, "MPI_Comm_create_group").map_err(fail)?;
            ffi::MPI_Comm_set_errhandler(nc, ffi::RSMPI_ERRORS_RETURN);
            nc
        };
        self.comms.push(Comm::new(nc, members, me, key));
        Ok(self.comms.len() - 1)
    }

    fn reduce(
        &mut self,
        c: usize,
        mut data: CpuStorage,
        op: ReduceOp,
        scatter: bool,
        reply: Reply<CpuStorage>,
    ) {
        let what = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        let info = self.begin(c, what, None);
        let comm = &self.comms[c];
        let (w, n, dt) = (comm.members.len(), data.len(), data.dtype());
        let cnt = match count(if scatter { n / w } else { n }, what) {
            Ok(c) => c,
            Err(e) => {
                let _ = reply.send(Err(self.backend_err(&info, e)));
                return;
            }
        };
        let (ty, mop, handle) = (datatype(dt), op_for(&self.ops, op, dt), comm.handle);
        let mut send = match self.in_place {
            Some(_) => None,
            None => Some(data.clone()),
        };
        let send_ptr = match (self.in_place, send.as_mut()) {
            (Some(ip), _) => ip as *const c_void,
            (None, Some(s)) => ptr(s) as *const c_void,
            (None, None) => unreachable!("a send copy exists without MPI_IN_PLACE"),
        };
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: `data` (n elements) and `send` stay in the InFlight entry until MPI_Test
        // reports completion; in place, MPI reads and writes `data` only.
        let code = unsafe {
            if scatter {
                ffi::MPI_Ireduce_scatter_block(
                    send_ptr,
                    ptr(&mut data),
                    cnt,
                    ty,
                    mop,
                    handle,
                    req.as_mut_ptr(),
                )
            } else {
                ffi::MPI_Iallreduce(
                    send_ptr,
                    ptr(&mut data),
                    cnt,
                    ty,
                    mop,
                    handle,
                    req.as_mut_ptr(),
                )
            }
        };
        let name = if scatter {
            "MPI_Ireduce_scatter_block"
        } else {
            "MPI_Iallreduce"
        };
        self.start(
            code,
            name,
            req,
            Finish::Storage {
                data,
                _send: send,
                _args: Vec::new(),
                avg: (op == ReduceOp::Avg).then_some(w),
                keep: scatter.then_some(n / w),
                reply,
            },
            info,
        );
    }

    /// Launches `MPI_Ialltoallv`: `send[p]` elements of `data` to group rank `p` (blocks in rank
    /// order) and `recv[p]` from it into a fresh buffer (blocks in rank order).
    fn all_to_all(
        &mut self,
        c: usize,
        mut data: CpuStorage,
        send: &[usize],
        recv: &[usize],
        reply: Reply<CpuStorage>,
    ) {
        let info = self.begin(c, "all_to_all", None);
        // Counts and displacements are ints: every displacement, so the total, must fit.
        let ints = |v: &[usize]| -> Result<(Vec<c_int>, Vec<c_int>, usize)> {
            let total: usize = v.iter().sum();
            count(total, "all_to_all")?;
            let counts = v.iter().map(|&n| n as c_int).collect();
            let mut at = 0;
            let displs = v
                .iter()
                .map(|&n| {
                    let d = at as c_int;
                    at += n;
                    d
                })
                .collect();
            Ok((counts, displs, total))
        };
        let (sc, sd, rc, rd, total) = match ints(send).and_then(|(sc, sd, _)| {
            let (rc, rd, total) = ints(recv)?;
            Ok((sc, sd, rc, rd, total))
        }) {
            Ok(x) => x,
            Err(e) => {
                let _ = reply.send(Err(self.backend_err(&info, e)));
                return;
            }
        };
        let ty = datatype(data.dtype());
        let mut out = CpuStorage::zeros(data.dtype(), total);
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: `data` holds sum(send) elements and `out` sum(recv), the counts and
        // displacements describe blocks inside them; the buffers and the four arrays (heap
        // memory that does not move) stay in the InFlight entry until MPI_Test reports
        // completion.
        let code = unsafe {
            ffi::MPI_Ialltoallv(
                ptr(&mut data) as *const c_void,
                sc.as_ptr(),
                sd.as_ptr(),
                ty,
                ptr(&mut out),
                rc.as_ptr(),
                rd.as_ptr(),
                ty,
                self.comms[c].handle,
                req.as_mut_ptr(),
            )
        };
        self.start(
            code,
            "MPI_Ialltoallv",
            req,
            Finish::Storage {
                data: out,
                _send: Some(data),
                _args: vec![sc, sd, rc, rd],
                avg: None,
                keep: None,
                reply,
            },
            info,
        );
    }

    fn start(
        &mut self,
        code: c_int,
        what: &str,
        req: std::mem::MaybeUninit<ffi::MPI_Request>,
        finish: Finish,
        op: OpInfo,
    ) {
        match check(code, what) {
            // SAFETY: MPI initialised the request on success.
            Ok(()) => self.flight.push(InFlight {
                req: unsafe { req.assume_init() },
                finish,
                op,
            }),
            Err(e) => finish.fail(self.backend_err(&op, e)),
        }
    }

    /// Tests the operations in flight and matches waiting receives; true if anything moved.
    fn poll(&mut self) -> bool {
        let mut moved = false;
        // Receives: probe for the next message of each (communicator, source) with a waiter.
        let keys: Vec<(usize, usize)> = self
            .recvs
            .iter()
            .filter(|(_, q)| !q.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for (c, src) in keys {
            let handle = self.comms[c].handle;
            let (mut flag, mut len): (c_int, c_int) = (0, 0);
            // SAFETY: valid communicator; the message and status out pointers are live locals.
            let (code, mut msg) = unsafe {
                let mut msg = std::mem::zeroed::<ffi::MPI_Message>();
                let mut status = std::mem::zeroed::<ffi::MPI_Status>();
                let code = ffi::MPI_Improbe(
                    src as c_int,
                    P2P_TAG,
                    handle,
                    &mut flag,
                    &mut msg,
                    &mut status,
                );
                if code == 0 && flag != 0 {
                    ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut len);
                }
                (code, msg)
            };
            if code == 0 && flag == 0 {
                continue;
            }
            let q = self.recvs.get_mut(&(c, src)).expect("queue");
            let (info, reply) = q.pop_front().expect("waiter");
            moved = true;
            if code != 0 {
                let e = check(code, "MPI_Improbe").expect_err("an MPI error");
                let _ = reply.send(Err(self.backend_err(&info, e)));
                continue;
            }
            let mut buf = vec![0u8; len.max(0) as usize];
            let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            // SAFETY: `buf` has room for the matched message and lives in the InFlight entry.
            let code = unsafe {
                ffi::MPI_Imrecv(
                    buf.as_mut_ptr() as *mut c_void,
                    len,
                    ffi::RSMPI_UINT8_T,
                    &mut msg,
                    req.as_mut_ptr(),
                )
            };
            self.start(code, "MPI_Imrecv", req, Finish::Bytes(buf, reply), info);
        }
        let mut i = 0;
        while i < self.flight.len() {
            let mut flag: c_int = 0;
            // SAFETY: an active request this thread started; the status is ignored.
            let code = unsafe {
                ffi::MPI_Test(&mut self.flight[i].req, &mut flag, ffi::RSMPI_STATUS_IGNORE)
            };
            if code != 0 || flag != 0 {
                let f = self.flight.swap_remove(i);
                let r = check(code, "MPI_Test").map_err(|e| self.backend_err(&f.op, e));
                f.finish.complete(r);
                moved = true;
            } else {
                i += 1;
            }
        }
        moved
    }

    /// Posts a small control message to world rank `dst` (kept until MPI completes it).
    fn ctrl_send(&mut self, dst: usize, tag: c_int, buf: Vec<u8>) {
        let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
        // SAFETY: `buf` is kept in `ctrl_sends` (its heap storage does not move) until MPI_Test
        // reports completion; `ctrl` is a valid communicator.
        let code = unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const c_void,
                buf.len() as c_int,
                ffi::RSMPI_UINT8_T,
                dst as c_int,
                tag,
                self.ctrl,
                req.as_mut_ptr(),
            )
        };
        if code == 0 {
            // SAFETY: MPI initialised the request on success.
            self.ctrl_sends.push((unsafe { req.assume_init() }, buf));
        }
    }

    /// Receives the next control message with `tag`, if one is there: (source, bytes).
    fn ctrl_recv(&mut self, tag: c_int) -> Option<(usize, Vec<u8>)> {
        let (mut flag, mut len): (c_int, c_int) = (0, 0);
        // SAFETY: valid communicator; the out pointers are live locals; a matched message is
        // received into a buffer of the size MPI reports for it.
        unsafe {
            let mut msg = std::mem::zeroed::<ffi::MPI_Message>();
            let mut status = std::mem::zeroed::<ffi::MPI_Status>();
            let code = ffi::MPI_Improbe(
                ffi::RSMPI_ANY_SOURCE,
                tag,
                self.ctrl,
                &mut flag,
                &mut msg,
                &mut status,
            );
            if code != 0 || flag == 0 {
                return None;
            }
            ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut len);
            let mut buf = vec![0u8; len.max(0) as usize];
            let code = ffi::MPI_Mrecv(
                buf.as_mut_ptr() as *mut c_void,
                len,
                ffi::RSMPI_UINT8_T,
                &mut msg,
                ffi::RSMPI_STATUS_IGNORE,
            );
            (code == 0).then_some((status.MPI_SOURCE as usize, buf))
        }
    }

    /// Answers the peers' watchdog queries, records the answers to this rank's query and
    /// completes control sends; true if anything moved.
    fn service_ctrl(&mut self) -> bool {
        let mut moved = false;
        while let Some((src, q)) = self.ctrl_recv(CTRL_QUERY) {
            moved = true;
            if q.len() < 8 {
                continue;
            }
            let key = String::from_utf8_lossy(&q[8..]);
            let comm = self.comms.iter().find(|c| c.key == key);
            let asker = comm.and_then(|c| c.members.iter().position(|&m| m == src));
            let mut a = q[..8].to_vec();
            let creating = self
                .creating
                .iter()
                .any(|g| g.op.group.as_ref().is_some_and(|(k, _)| *k == key));
            let (known, colls, last, sent, recvd) = match (comm, asker) {
                _ if creating => (1, 0, "", 0, 0),
                (Some(c), Some(p)) => (
                    1u64,
                    c.colls,
                    c.last,
                    c.sends.get(&p).copied().unwrap_or(0),
                    c.recvs.get(&p).copied().unwrap_or(0),
                ),
                _ => (0, 0, "", 0, 0),
            };
            for v in [known, colls, sent, recvd] {
                a.extend_from_slice(&v.to_le_bytes());
            }
            a.extend_from_slice(last.as_bytes());
            self.ctrl_send(src, CTRL_ANSWER, a);
        }
        while let Some((src, a)) = self.ctrl_recv(CTRL_ANSWER) {
            moved = true;
            if a.len() < 40 {
                continue;
            }
            let word = |i: usize| u64::from_le_bytes(a[8 * i..8 * i + 8].try_into().expect("8"));
            if let Some(d) = self.diag.as_mut().filter(|d| d.qid == word(0)) {
                d.answers.insert(
                    src,
                    Answer {
                        known: word(1) != 0,
                        colls: word(2),
                        sent_to_you: word(3),
                        recvd_from_you: word(4),
                        last: String::from_utf8_lossy(&a[40..]).into_owned(),
                    },
                );
            }
        }
        let mut i = 0;
        while i < self.ctrl_sends.len() {
            let mut flag: c_int = 0;
            // SAFETY: an active request this thread started; the status is ignored.
            let code = unsafe {
                ffi::MPI_Test(
                    &mut self.ctrl_sends[i].0,
                    &mut flag,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            };
            if code != 0 || flag != 0 {
                self.ctrl_sends.swap_remove(i);
                moved = true;
            } else {
                i += 1;
            }
        }
        moved
    }

    /// The watchdog: `grace` before the oldest operation's timeout, asks the peers it waits for
    /// how far they are; at the timeout, if the operation is still pending, fails it naming the
    /// missing ranks, and stops the backend.
    fn watchdog(&mut self) {
        if self.failed.is_some() {
            return;
        }
        let t = timeout();
        let now = Instant::now();
        if let Some(d) = &self.diag {
            let id = d.op.id;
            let pending = self.flight.iter().any(|f| f.op.id == id)
                || self.creating.iter().any(|g| g.op.id == id)
                || self.recvs.values().flatten().any(|(o, _)| o.id == id);
            if !pending {
                self.diag = None;
            } else if now >= d.op.started + t {
                self.conclude();
                return;
            } else {
                return;
            }
        }
        let oldest = self
            .flight
            .iter()
            .map(|f| &f.op)
            .chain(self.creating.iter().map(|g| &g.op))
            .chain(self.recvs.values().flatten().map(|(o, _)| o))
            .min_by_key(|o| o.started)
            .cloned();
        if let Some(op) = oldest {
            if now + grace(t) >= op.started + t {
                self.ask(op);
            }
        }
    }

    /// Asks the peers `op` waits for (every other member, or the send's or receive's peer)
    /// for their progress on its group.
    fn ask(&mut self, op: OpInfo) {
        self.next_id += 1;
        let qid = self.next_id;
        let comm = &self.comms[op.comm];
        let (asked, key): (Vec<usize>, &str) = match (&op.group, op.peer) {
            (Some((key, members)), _) => (
                members
                    .iter()
                    .copied()
                    .filter(|&m| m != self.world_rank)
                    .collect(),
                key,
            ),
            (None, Some(p)) => (vec![comm.members[p]], &comm.key),
            (None, None) => (
                (0..comm.members.len())
                    .filter(|&r| r != comm.me)
                    .map(|r| comm.members[r])
                    .collect(),
                &comm.key,
            ),
        };
        let mut q = qid.to_le_bytes().to_vec();
        q.extend_from_slice(key.as_bytes());
        for &w in &asked {
            self.ctrl_send(w, CTRL_QUERY, q.clone());
        }
        self.diag = Some(Diag {
            op,
            qid,
            asked,
            answers: HashMap::new(),
        });
    }

    /// The timeout of the operation under diagnosis: fails it naming the ranks that did not
    /// take part (from their answers), fails every other pending operation, and stops the backend.
    fn conclude(&mut self) {
        let d = self.diag.take().expect("a diagnosis");
        let op = &d.op;
        let me = self.world_rank;
        let mut notes: Vec<(usize, String)> = Vec::new();
        for &w in &d.asked {
            let at = |a: &Answer| {
                if a.colls == 0 {
                    "has started no collective on this group".to_string()
                } else {
                    format!("is at {} #{}", a.last, a.colls - 1)
                }
            };
            let note = match d.answers.get(&w) {
                None => Some(
                    "did not answer the watchdog: its process or its MPI thread is gone or stuck"
                        .to_string(),
                ),
                Some(a) if !a.known => Some(if op.call == "new_group" {
                    "has not started creating this group".to_string()
                } else {
                    "has not created this group".to_string()
                }),
                Some(_) if op.call == "new_group" => None,
                Some(a) => match op.call {
                    "recv" => (a.sent_to_you <= op.seq).then(|| {
                        format!(
                            "has sent {} message(s) to rank {me} on this group and {}",
                            a.sent_to_you,
                            at(a)
                        )
                    }),
                    "send" => (a.recvd_from_you <= op.seq).then(|| {
                        format!(
                            "has posted {} receive(s) from rank {me} on this group and {}",
                            a.recvd_from_you,
                            at(a)
                        )
                    }),
                    _ => (a.colls <= op.seq).then(|| at(a)),
                },
            };
            if let Some(n) = note {
                notes.push((w, n));
            }
        }
        let detail = match notes.as_slice() {
            [] => Some("every peer has joined, but MPI did not complete the operation".into()),
            [(_, n)] => Some(format!("it {n}")),
            many => Some(
                many.iter()
                    .map(|(w, n)| format!("rank {w} {n}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
        };
        let err = self.op_err(
            op,
            CommErrorKind::Timeout {
                missing: notes.iter().map(|(w, _)| *w).collect(),
                after: timeout(),
                detail,
            },
        );
        // The late operation fails with the diagnosis, every other pending one because of it;
        // their buffers stay alive (MPI may still use them) until the job ends.
        let others = CommErrorKind::PeerFailed {
            rank: me,
            reason: format!("the watchdog stopped the MPI backend: {err}"),
        };
        let flight = std::mem::take(&mut self.flight);
        for f in &flight {
            let e = if f.op.id == op.id {
                err.clone()
            } else {
                self.op_err(&f.op, others.clone())
            };
            f.finish.reply_err(e);
        }
        self.zombies.extend(flight);
        let recvs = std::mem::take(&mut self.recvs);
        for (info, reply) in recvs.into_values().flatten() {
            let e = if info.id == op.id {
                err.clone()
            } else {
                self.op_err(&info, others.clone())
            };
            let _ = reply.send(Err(e));
        }
        for g in std::mem::take(&mut self.creating) {
            let e = if g.op.id == op.id {
                err.clone()
            } else {
                self.op_err(&g.op, others.clone())
            };
            let _ = g.reply.send(Err(e));
            self.abandoned.extend(g.tokens);
        }
        WATCHDOG_FIRED.store(true, Ordering::SeqCst);
        self.failed = Some(err);
    }
}
