//! The NCCL backend (cargo feature `nccl`): one rank per process and GPU, for runs started by
//! `meshgrad launch --backend nccl` (torchrun's variables; rank `r` of a node uses
//! `cuda:LOCAL_RANK`). Compiled in CI; what has run on a GPU is in README's Status.
//!
//! # Design
//!
//! * **One thread per communicator.** A NCCL communicator (`ncclComm_t`) is not thread safe and
//!   the trait's communicators are shared as `Arc<dyn Communicator>`, so each
//!   [`NcclCommunicator`] (the world and every group) has a dedicated thread that creates the
//!   NCCL communicator (`ncclCommInitRank`), owns it and a **communication stream** of its own,
//!   and issues every NCCL call. Calls reach it over a channel, in the order they were made,
//!   which is the order NCCL needs (every member issues the same collectives in the same order).
//! * **Stream ordering.** At the call, on the caller's thread, the input is copied (on the
//!   compute stream: the contract lets the caller modify its tensor while the operation is in
//!   flight; all-reduce and broadcast then run in place on that copy, which becomes the result),
//!   the output of the other collectives is allocated ([`Tensor::cuda_uninit`]), and an event
//!   is recorded on the device's compute stream, after the work that produced the input. The NCCL thread makes the communication stream wait on
//!   that event, launches the collective and records a *done* event after it. [`Work::wait`] on
//!   a tensor result makes the compute stream wait on the done event and returns the output at
//!   once, without blocking the host: later kernels on the output are ordered after the
//!   collective, and gradient reduction overlaps the rest of the backward pass.
//!   [`Work::is_completed`] asks whether the done event has completed. Sends and barriers block
//!   the host in `wait` until their done event completes. The NCCL thread keeps the input and
//!   output alive until the done event completes, so the caching allocator cannot hand their
//!   memory to other work while NCCL still uses it.
//! * **CPU tensors** (a loss, a norm, [`super::all_reduce_scalar`]) are copied to the device at
//!   the call and the result back to the host in `wait`, so code written for any backend runs.
//!   Tensors on another CUDA device than this rank's are refused.
//! * **Unique ids** go through the job's [`TcpStore`]: the group's rank 0 makes one
//!   (`ncclGetUniqueId`) and stores its 128 bytes under a key every member derives alike
//!   ([`rendezvous::group_key`]: the parent's key, the tag, the members and how many such groups
//!   were made before); the others read it. So [`Communicator::new_group`] is called only by
//!   the members, as the trait says (`ncclCommSplit` would need every rank of the parent), and
//!   each group is a communicator of its own (its own thread and stream).
//! * **Point-to-point.** A NCCL receive must know its size, so every send publishes a 64-byte
//!   [`MessageHeader`] (dtype and shape) in the store under (group, sender, receiver, message
//!   number) at the call; the receive's NCCL thread reads it (waiting up to the timeout), then
//!   allocates the output and posts `ncclRecv`. Only payloads travel over NCCL, so messages of
//!   a pair match in order however they are batched. [`Communicator::batch_p2p`] launches its
//!   sends and receives inside one `ncclGroupStart` / `ncclGroupEnd`. Costs: one store round
//!   trip per message on each side, and the store keeps every header (64 bytes and the key) for
//!   the life of the job.
//! * **All-to-all**: NCCL has no collective for it; as NCCL's documentation shows, it is one
//!   `ncclSend` and one `ncclRecv` per rank (this rank included) inside one `ncclGroupStart` /
//!   `ncclGroupEnd`, at element offsets of the staged input and of the output allocated at the
//!   call; empty blocks post nothing. Its splits are not checked across ranks (see below).
//! * **Barrier**: NCCL has none; it is a one-element all-reduce whose `wait` blocks the host.
//!
//! # The watchdog
//!
//! The NCCL thread numbers operations as the trait does (the k-th collective of the group, the
//! k-th message to or from a peer) and notes their launch. An operation whose done event has
//! not completed `timeout` after the launch (`--collective-timeout`, default
//! [`DEFAULT_TIMEOUT`]) fails with [`CommErrorKind::Timeout`] naming the call and its sequence
//! number; NCCL cannot say which peer is missing, so the error says so, except for a receive
//! whose header never came (the sender is named). The thread then aborts the communicator
//! (`ncclCommAbort`, which also ends the kernels waiting on peers), so every pending and later
//! operation of it fails with that error. An asynchronous NCCL error
//! (`ncclCommGetAsyncError`, e.g. a peer's process died) aborts it the same way. Limits: the
//! creation of a communicator (`ncclCommInitRank`) blocks its thread; the caller stops waiting
//! after the timeout and fails, but the thread stays until NCCL returns. While the thread waits
//! for a receive's header (up to the timeout), it launches nothing else on that communicator
//! and its watchdog checks the operations in flight only afterwards.
//!
//! # What NCCL guarantees, and what not
//!
//! NCCL reduces with ring or tree algorithms whose order depends on the topology, the message
//! size, the number of channels and the NCCL version; it documents neither rank-order sums nor
//! equal bits on every rank or across runs, so results equal the in-process backend's only up to
//! rounding, and code must not compare ranks' sums bit for bit. bf16 and f16 are reduced in
//! their own type pairwise (rounded after each addition). [`ReduceOp::Avg`] is `ncclAvg`
//! (floats only, as on every backend); [`ReduceOp::Max`] is `ncclMax`, which does not promise to
//! propagate NaN. Every dtype maps onto a NCCL type ([`nccl_dtype`]). Mismatched calls are not
//! detected: NCCL may hang until the watchdog or return wrong data. That includes an all-to-all
//! whose ranks disagree on a split: NCCL expects each `ncclRecv` to match its `ncclSend` in
//! count and type and does not check it (the result is undefined: a hang until the watchdog,
//! rows left unwritten or a later operation broken). Get the receive splits from
//! [`super::all_to_all_splits`] (one all-to-all of one count per rank, consistent by
//! construction).
//!
//! Multi-rank NCCL needs one GPU per rank (NCCL refuses two ranks of one communicator on one
//! GPU), so on a one-GPU machine only a world of size 1 runs; the code path is the same.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream};
use cudarc::nccl::{result as nccl, sys};
use meshgrad_tensor::{
    cuda_compute_stream, CommErrorKind, CudaBuffer, DType, Device, Error, Result, Tensor,
};

use super::call::checks;
use super::env::RankEnv;
use super::rendezvous::{self, MessageHeader, ID_BYTES};
use super::store::TcpStore;
use super::{format_ranks, Communicator, P2pOp, P2pWork, Pending, ReduceOp, Work};

/// The watchdog's default timeout (see the [module docs](self)).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The NCCL data type of a dtype. Every meshgrad dtype has one: f64, f32, bf16, f16, u8, u32,
/// i64 map onto `ncclFloat64`, `ncclFloat32`, `ncclBfloat16`, `ncclFloat16`, `ncclUint8`,
/// `ncclUint32`, `ncclInt64`.
pub fn nccl_dtype(dtype: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as T;
    match dtype {
        DType::F64 => T::ncclFloat64,
        DType::F32 => T::ncclFloat32,
        DType::BF16 => T::ncclBfloat16,
        DType::F16 => T::ncclFloat16,
        DType::U8 => T::ncclUint8,
        DType::U32 => T::ncclUint32,
        DType::I64 => T::ncclInt64,
    }
}

/// The NCCL reduction of `op` on `dtype`: `ncclSum`, `ncclAvg` (float dtypes only: an error for
/// integers, as on every backend) or `ncclMax`.
pub fn nccl_op(op: ReduceOp, dtype: DType) -> std::result::Result<sys::ncclRedOp_t, String> {
    checks::reduce_op(op, dtype)?;
    Ok(match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    })
}

/// Whether the NCCL library can be loaded (`libnccl.so` on the library path); `Err` says why
/// not. cudarc panics on the first call into a library it cannot load, so this is checked first.
pub fn nccl_library_present() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names; it calls no
    // function from them.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::msg(
            "the NCCL library (libnccl.so) cannot be loaded: install NCCL, or put a libnccl.so \
             (a link to libnccl.so.2) on LD_LIBRARY_PATH",
        ))
    }
}

fn nccl_err(what: &str, e: nccl::NcclError) -> String {
    format!("{what}: NCCL error {:?}", e.0)
}

/// One rank's handle on a group of NCCL ranks (see the [module docs](self)).
pub struct NcclCommunicator {
    rank: usize,
    ranks: Vec<usize>,
    /// The group's store key ([`rendezvous::group_key`]); `world` for the world.
    key: String,
    ordinal: usize,
    compute: Arc<CudaStream>,
    store: Arc<TcpStore>,
    timeout: Duration,
    shared: Arc<Shared>,
    tx: Mutex<Sender<Request>>,
    /// Disconnected when the communicator's thread has ended (its NCCL communicator destroyed):
    /// `Drop` waits for it, so that no NCCL teardown still runs when the process exits (seen on
    /// an H200: SIGSEGV in NCCL's `commFree` racing the CUDA runtime's exit handlers).
    finished: Mutex<Receiver<()>>,
    /// Collectives issued on this group (the next one's sequence number).
    colls: AtomicU64,
    /// Messages sent to / receives posted from each peer (group ranks).
    sends: Mutex<HashMap<usize, u64>>,
    recvs: Mutex<HashMap<usize, u64>>,
    /// Groups made per (tag, members), for their keys.
    groups: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for NcclCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclCommunicator(rank {} of {} on cuda:{})",
            self.rank,
            format_ranks(&self.ranks),
            self.ordinal
        )
    }
}

/// What the caller's side and the NCCL thread share: the error that stopped the communicator.
struct Shared {
    failed: Mutex<Option<Error>>,
}

impl Shared {
    fn failed(&self) -> Option<Error> {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn fail(&self, e: Error) {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(e);
        }
    }
}

/// What an operation is, for errors and the watchdog.
#[derive(Clone, Debug)]
struct OpInfo {
    call: &'static str,
    seq: u64,
    /// The other side of a send or receive (group rank).
    peer: Option<usize>,
}

/// One NCCL call, as the NCCL thread launches it.
enum Kind {
    AllReduce(CudaBuffer, CudaBuffer, sys::ncclRedOp_t),
    ReduceScatter(CudaBuffer, CudaBuffer, sys::ncclRedOp_t),
    AllGather(CudaBuffer, CudaBuffer),
    Broadcast(CudaBuffer, CudaBuffer, usize),
    /// Input, output, and the elements sent to / received from each group rank.
    AllToAll(CudaBuffer, CudaBuffer, Vec<usize>, Vec<usize>),
    Send(CudaBuffer, usize),
    /// The peer and the store key of the message's header.
    Recv(usize, String),
}

/// One operation handed to the NCCL thread.
struct Op {
    info: OpInfo,
    kind: Kind,
    /// Tensors kept alive until the done event completes (input, output).
    keep: Vec<Tensor>,
    reply: Sender<Result<Launched>>,
}

enum Request {
    /// Operations launched together (one, or a `batch_p2p` inside a NCCL group), after the
    /// event recorded on the compute stream at the call.
    Launch(Vec<Op>, Option<CudaEvent>),
    Shutdown,
}

/// A launched operation: the event recorded after it on the communication stream, and its
/// output (a receive's is allocated by the NCCL thread).
struct Launched {
    done: Arc<CudaEvent>,
    output: Option<Tensor>,
}

/// How [`Work::wait`] finishes an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Finish {
    /// Stream-ordered: the compute stream waits on the done event; the output stays on the GPU.
    Device,
    /// The host waits for the done event, then copies the output to the host (CPU inputs).
    Host,
    /// The host waits for the done event (sends, barriers).
    Unit,
}

struct NcclPending {
    rx: Receiver<Result<Launched>>,
    launched: Mutex<Option<Result<Launched>>>,
    finish: Finish,
    compute: Arc<CudaStream>,
    shared: Arc<Shared>,
}

impl NcclPending {
    fn launched(&self, block: bool) -> Option<Result<Arc<CudaEvent>>> {
        let mut l = self.launched.lock().unwrap_or_else(|e| e.into_inner());
        if l.is_none() {
            let r = if block {
                self.rx.recv().ok()
            } else {
                match self.rx.try_recv() {
                    Ok(r) => Some(r),
                    Err(TryRecvError::Empty) => return None,
                    Err(TryRecvError::Disconnected) => None,
                }
            };
            *l = Some(r.unwrap_or_else(|| {
                Err(self.shared.failed().unwrap_or_else(|| {
                    Error::msg("the NCCL thread ended before launching the operation")
                }))
            }));
        }
        Some(match l.as_ref().expect("set above") {
            Ok(x) => Ok(x.done.clone()),
            Err(e) => Err(e.clone()),
        })
    }

    /// Blocks the host until `done` completes, or the communicator fails.
    fn host_wait(&self, done: &CudaEvent) -> Result<()> {
        let mut pause = Duration::from_micros(20);
        loop {
            // Completion first: a later operation's failure does not fail this finished one.
            match done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(Error::msg(format!("waiting for a NCCL operation: {e}"))),
            }
            if let Some(e) = self.shared.failed() {
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Pending<Option<Tensor>> for NcclPending {
    fn is_completed(&self) -> bool {
        match self.launched(false) {
            None => false,
            Some(Err(_)) => true,
            Some(Ok(done)) => done.is_complete() || self.shared.failed().is_some(),
        }
    }

    fn wait(self: Box<Self>) -> Result<Option<Tensor>> {
        let done = self.launched(true).expect("blocking")?;
        match self.finish {
            Finish::Device => {
                // A failed (aborted) communicator's unfinished operations have no valid result.
                if !done.is_complete() {
                    if let Some(e) = self.shared.failed() {
                        return Err(e);
                    }
                }
                self.compute
                    .wait(&done)
                    .map_err(|e| Error::msg(format!("ordering after a NCCL operation: {e}")))?;
            }
            Finish::Host | Finish::Unit => self.host_wait(&done)?,
        }
        let launched = self
            .launched
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .expect("launched")?;
        match (self.finish, launched.output) {
            (Finish::Host, Some(t)) => Ok(Some(t.to_device(Device::Cpu)?)),
            (_, out) => Ok(out),
        }
    }
}

impl NcclCommunicator {
    /// The world communicator of the job `env` describes (torchrun's variables, as `meshgrad
    /// launch` sets them): this rank uses `cuda:LOCAL_RANK`, rank 0 makes the unique id and
    /// shares it through `store` (the job's [`TcpStore`]), and every rank creates its NCCL
    /// communicator, waiting up to `timeout` for the others. `timeout` is also the watchdog's.
    pub fn world(env: &RankEnv, store: Arc<TcpStore>, timeout: Duration) -> Result<Arc<Self>> {
        let ordinal = env.local_rank;
        let ranks: Vec<usize> = (0..env.world_size).collect();
        Self::create("world".into(), env.rank, ranks, ordinal, store, timeout).map(Arc::new)
    }

    fn create(
        key: String,
        rank: usize,
        ranks: Vec<usize>,
        ordinal: usize,
        store: Arc<TcpStore>,
        timeout: Duration,
    ) -> Result<Self> {
        let global = ranks[rank];
        let fail = |kind: CommErrorKind| Error::comm(global, &ranks, "new_group", None, kind);
        nccl_library_present().map_err(|e| fail(CommErrorKind::Backend(e.to_string())))?;
        let compute = cuda_compute_stream(ordinal)?;
        let id = rendezvous::exchange_id(&store, &key, rank == 0, || {
            let id =
                cudarc::nccl::Id::new().map_err(|e| Error::msg(nccl_err("ncclGetUniqueId", e)))?;
            Ok(id.internal().map(|c| c as u8))
        })?;
        let shared = Arc::new(Shared {
            failed: Mutex::new(None),
        });
        let (tx, rx) = channel();
        let (init_tx, init_rx) = channel();
        let (finished_tx, finished) = channel::<()>();
        let world = ranks.len();
        let thread = Thread {
            rank,
            ordinal,
            ranks: ranks.clone(),
            compute: compute.clone(),
            shared: shared.clone(),
            store: store.clone(),
            timeout,
        };
        std::thread::Builder::new()
            .name(format!("meshgrad-nccl-{key}"))
            .spawn(move || {
                thread.run(rx, init_tx, id, world);
                drop(finished_tx);
            })
            .map_err(|e| {
                fail(CommErrorKind::Backend(format!(
                    "cannot start its thread: {e}"
                )))
            })?;
        match init_rx.recv_timeout(timeout) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(fail(CommErrorKind::Backend(e))),
            Err(_) => {
                return Err(fail(CommErrorKind::Timeout {
                    missing: vec![],
                    after: timeout,
                    detail: Some(
                        "ncclCommInitRank did not return: a member did not join".to_string(),
                    ),
                }))
            }
        }
        Ok(NcclCommunicator {
            rank,
            ranks,
            key,
            ordinal,
            compute,
            store,
            timeout,
            shared,
            tx: Mutex::new(tx),
            finished: Mutex::new(finished),
            colls: AtomicU64::new(0),
            sends: Mutex::new(HashMap::new()),
            recvs: Mutex::new(HashMap::new()),
            groups: Mutex::new(HashMap::new()),
        })
    }

    /// The CUDA device this rank uses.
    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The watchdog's timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
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

    fn backend_err(&self, call: &'static str, msg: impl std::fmt::Display) -> Error {
        Error::comm(
            self.global_rank(),
            &self.ranks,
            call,
            None,
            CommErrorKind::Backend(msg.to_string()),
        )
    }

    /// A private contiguous copy of the input on this rank's device (the contract: inputs are
    /// copied at launch, so the caller may modify them on the compute stream while NCCL runs),
    /// and whether it came from the host.
    fn stage(&self, call: &'static str, t: &Tensor) -> Result<(Tensor, bool)> {
        match t.device() {
            Device::Cpu => Ok((t.to_device(self.device())?.contiguous()?, true)),
            Device::Cuda(n) if n == self.ordinal => Ok((t.deep_clone()?, false)),
            d => Err(self.err(
                call,
                format!(
                    "the tensor is on {d}, but this rank's NCCL communicator is on cuda:{}",
                    self.ordinal
                ),
            )),
        }
    }

    fn next_coll(&self) -> u64 {
        self.colls.fetch_add(1, Ordering::Relaxed)
    }

    fn next_p2p(map: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
        let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
        let c = m.entry(peer).or_insert(0);
        *c += 1;
        *c - 1
    }

    /// Hands `ops` to the NCCL thread after an event on the compute stream.
    fn post(&self, call: &'static str, ops: Vec<Op>) -> Result<()> {
        if let Some(e) = self.shared.failed() {
            return Err(e);
        }
        let ready = self
            .compute
            .record_event(None)
            .map_err(|e| self.backend_err(call, format!("recording an event: {e}")))?;
        self.tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Request::Launch(ops, Some(ready)))
            .map_err(|_| {
                self.shared
                    .failed()
                    .unwrap_or_else(|| self.backend_err(call, "the NCCL thread has ended"))
            })
    }

    fn pending(&self, finish: Finish) -> (Sender<Result<Launched>>, Work<Option<Tensor>>) {
        let (tx, rx) = channel();
        let work = Work::pending(Box::new(NcclPending {
            rx,
            launched: Mutex::new(None),
            finish,
            compute: self.compute.clone(),
            shared: self.shared.clone(),
        }));
        (tx, work)
    }

    /// A collective with an output of `out_dims` (`None`: in place, on the staged copy of the
    /// input, which becomes the output): stages the input, allocates the output, posts
    /// `make(input buffer, output buffer)`.
    fn collective(
        &self,
        call: &'static str,
        tensor: &Tensor,
        out_dims: Option<Vec<usize>>,
        make: impl FnOnce(CudaBuffer, CudaBuffer) -> Kind,
    ) -> Result<Work> {
        let (input, from_host) = self.stage(call, tensor)?;
        let output = match out_dims {
            Some(dims) => Tensor::cuda_uninit(dims, input.dtype(), self.ordinal)?,
            None => input.clone(),
        };
        let kind = make(input.cuda_buffer()?, output.cuda_buffer()?);
        let finish = if from_host {
            Finish::Host
        } else {
            Finish::Device
        };
        let (reply, work) = self.pending(finish);
        let op = Op {
            info: OpInfo {
                call,
                seq: self.next_coll(),
                peer: None,
            },
            kind,
            keep: vec![input, output],
            reply,
        };
        self.post(call, vec![op])?;
        Ok(tensor_work(work))
    }

    /// A send's operation and handle; its header is published at once.
    fn send_op(&self, tensor: &Tensor, dst: usize) -> Result<(Op, Work<()>)> {
        checks::peer("send", dst, self.rank, self.world_size(), "destination")
            .map_err(|m| self.err("send", m))?;
        let (input, _) = self.stage("send", tensor)?;
        let header = MessageHeader {
            dtype: input.dtype(),
            dims: input.dims().to_vec(),
        }
        .encode()
        .map_err(|e| self.err("send", e))?;
        let seq = Self::next_p2p(&self.sends, dst);
        self.store.set(
            &rendezvous::header_key(&self.key, self.rank, dst, seq),
            &header,
        )?;
        let (reply, work) = self.pending(Finish::Unit);
        let op = Op {
            info: OpInfo {
                call: "send",
                seq,
                peer: Some(dst),
            },
            kind: Kind::Send(input.cuda_buffer()?, dst),
            keep: vec![input],
            reply,
        };
        Ok((op, work.map(|_| Ok(()))))
    }

    fn recv_op(&self, src: usize, to_host: bool) -> Result<(Op, Work)> {
        checks::peer("recv", src, self.rank, self.world_size(), "source")
            .map_err(|m| self.err("recv", m))?;
        let seq = Self::next_p2p(&self.recvs, src);
        let key = rendezvous::header_key(&self.key, src, self.rank, seq);
        let finish = if to_host {
            Finish::Host
        } else {
            Finish::Device
        };
        let (reply, work) = self.pending(finish);
        let op = Op {
            info: OpInfo {
                call: "recv",
                seq,
                peer: Some(src),
            },
            kind: Kind::Recv(src, key),
            keep: vec![],
            reply,
        };
        Ok((op, tensor_work(work)))
    }
}

fn tensor_work(w: Work<Option<Tensor>>) -> Work {
    w.map(|t| t.ok_or_else(|| Error::msg("a NCCL operation returned no tensor")))
}

impl Drop for NcclCommunicator {
    /// Asks the communicator's thread to finish what is in flight and destroy the NCCL
    /// communicator, and waits for it (at most the watchdog's timeout and 10 s more: the thread
    /// aborts what has not finished by the timeout).
    fn drop(&mut self) {
        let _ = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Request::Shutdown);
        let finished = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        let _ = finished.recv_timeout(self.timeout.saturating_add(Duration::from_secs(10)));
    }
}

impl Communicator for NcclCommunicator {
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
        let red = nccl_op(op, tensor.dtype()).map_err(|m| self.err("all_reduce", m))?;
        self.collective("all_reduce", tensor, None, |i, o| {
            Kind::AllReduce(i, o, red)
        })
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let w = self.world_size();
        checks::reduce_scatter(tensor.shape(), tensor.dtype(), op, w)
            .map_err(|m| self.err("reduce_scatter", m))?;
        let mut dims = tensor.dims().to_vec();
        let red = nccl_op(op, tensor.dtype()).map_err(|m| self.err("reduce_scatter", m))?;
        dims[0] /= w;
        self.collective("reduce_scatter", tensor, Some(dims), |i, o| {
            Kind::ReduceScatter(i, o, red)
        })
    }

    fn all_gather(&self, tensor: &Tensor) -> Result<Work> {
        let w = self.world_size();
        let mut dims = tensor.dims().to_vec();
        if dims.is_empty() {
            dims.push(w);
        } else {
            dims[0] *= w;
        }
        self.collective("all_gather", tensor, Some(dims), Kind::AllGather)
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        checks::root(root, self.world_size()).map_err(|m| self.err("broadcast", m))?;
        self.collective("broadcast", tensor, None, |i, o| {
            Kind::Broadcast(i, o, root)
        })
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
        self.collective("all_to_all", tensor, Some(dims), |i, o| {
            Kind::AllToAll(i, o, send, recv)
        })
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        let (op, work) = self.send_op(tensor, dst)?;
        self.post("send", vec![op])?;
        Ok(work)
    }

    fn recv(&self, src: usize) -> Result<Work> {
        // A receive cannot know where its message came from: it lands on this rank's device.
        let (op, work) = self.recv_op(src, false)?;
        self.post("recv", vec![op])?;
        Ok(work)
    }

    fn batch_p2p(&self, ops: Vec<P2pOp>) -> Result<Vec<P2pWork>> {
        // Every operation is checked (and every header published) before any is launched; the
        // NCCL thread launches them inside one ncclGroupStart / ncclGroupEnd.
        let mut launch = Vec::with_capacity(ops.len());
        let mut works = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                P2pOp::Send { tensor, peer } => {
                    let (op, work) = self.send_op(&tensor, peer)?;
                    launch.push(op);
                    works.push(P2pWork::Send(work));
                }
                P2pOp::Recv { peer } => {
                    let (op, work) = self.recv_op(peer, false)?;
                    launch.push(op);
                    works.push(P2pWork::Recv(work));
                }
            }
        }
        if !launch.is_empty() {
            self.post("batch_p2p", launch)?;
        }
        Ok(works)
    }

    fn barrier(&self) -> Result<Work<()>> {
        let scratch = Tensor::cuda_uninit(vec![1], DType::F32, self.ordinal)?;
        let buf = scratch.cuda_buffer()?;
        let (reply, work) = self.pending(Finish::Unit);
        let op = Op {
            info: OpInfo {
                call: "barrier",
                seq: self.next_coll(),
                peer: None,
            },
            kind: Kind::AllReduce(buf, buf, sys::ncclRedOp_t::ncclSum),
            keep: vec![scratch],
            reply,
        };
        self.post("barrier", vec![op])?;
        Ok(work.map(|_| Ok(())))
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let my = super::group_position(ranks, self.world_size(), self.rank)
            .map_err(|m| self.err("new_group", m))?;
        let nth = {
            let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
            let c = g.entry(format!("{tag}{ranks:?}")).or_insert(0);
            *c += 1;
            *c - 1
        };
        let key = rendezvous::group_key(&self.key, tag, ranks, nth);
        let global: Vec<usize> = ranks.iter().map(|&r| self.ranks[r]).collect();
        let comm = Self::create(
            key,
            my,
            global,
            self.ordinal,
            self.store.clone(),
            self.timeout,
        )?;
        Ok(Arc::new(comm))
    }
}

// ---- the NCCL thread ----

/// The NCCL thread's state (see the [module docs](self)).
struct Thread {
    rank: usize,
    ordinal: usize,
    ranks: Vec<usize>,
    compute: Arc<CudaStream>,
    shared: Arc<Shared>,
    store: Arc<TcpStore>,
    timeout: Duration,
}

/// An operation on the communication stream, kept until its done event completes.
struct InFlight {
    info: OpInfo,
    started: Instant,
    done: Arc<CudaEvent>,
    _keep: Vec<Tensor>,
}

/// The raw NCCL communicator, owned by its thread.
struct RawComm(sys::ncclComm_t);

impl Thread {
    fn op_err(&self, info: &OpInfo, kind: CommErrorKind) -> Error {
        let e = meshgrad_tensor::CommError {
            rank: self.ranks[self.rank],
            group: self.ranks.clone(),
            call: info.call,
            seq: Some(info.seq),
            peer: None,
            kind,
        };
        let e = match info.peer {
            Some(p) => e.with_peer(self.ranks[p]),
            None => e,
        };
        Error::Comm(Box::new(e))
    }

    fn run(
        self,
        rx: Receiver<Request>,
        init: Sender<std::result::Result<(), String>>,
        id: [u8; ID_BYTES],
        world: usize,
    ) {
        let setup = || -> std::result::Result<(Arc<CudaStream>, RawComm), String> {
            let ctx = self.compute.context();
            ctx.bind_to_thread()
                .map_err(|e| format!("binding the CUDA context: {e}"))?;
            let stream = ctx
                .new_stream()
                .map_err(|e| format!("creating the communication stream: {e}"))?;
            let id = cudarc::nccl::Id::uninit(id.map(|b| b as std::ffi::c_char));
            let mut comm = std::mem::MaybeUninit::<sys::ncclComm_t>::uninit();
            // SAFETY: `comm` is a valid out pointer; the rank is below the world size (both
            // fit an int: group sizes are small); the id is the one every member received.
            unsafe {
                sys::ncclCommInitRank(
                    comm.as_mut_ptr(),
                    world as i32,
                    sys::ncclUniqueId {
                        internal: *id.internal(),
                    },
                    self.rank as i32,
                )
                .result()
                .map_err(|e| nccl_err("ncclCommInitRank", e))?;
                Ok((stream, RawComm(comm.assume_init())))
            }
        };
        let (stream, comm) = match setup() {
            Ok(x) => x,
            Err(e) => {
                let _ = init.send(Err(e));
                return;
            }
        };
        let _ = init.send(Ok(()));
        self.serve(rx, &stream, comm);
    }

    /// The loop: launches requests in order, retires completed operations, and runs the
    /// watchdog.
    fn serve(&self, rx: Receiver<Request>, stream: &CudaStream, comm: RawComm) {
        let mut flight: VecDeque<InFlight> = VecDeque::new();
        let mut aborted = false;
        // Set by Shutdown: the loop ends once everything launched has finished (the watchdog
        // still aborts what does not finish in time).
        let mut closing = false;
        loop {
            if closing && (aborted || flight.is_empty()) {
                break;
            }
            let wait = if flight.is_empty() {
                Duration::from_millis(50)
            } else {
                Duration::from_millis(1)
            };
            let next = if closing {
                std::thread::sleep(wait);
                Err(RecvTimeoutError::Timeout)
            } else {
                rx.recv_timeout(wait)
            };
            match next {
                Ok(Request::Launch(ops, ready)) => {
                    if aborted {
                        let e = self.shared.failed().expect("failed when aborted");
                        for op in ops {
                            let _ = op.reply.send(Err(e.clone()));
                        }
                    } else {
                        self.launch(&comm, stream, ops, ready, &mut flight);
                    }
                }
                Ok(Request::Shutdown) | Err(RecvTimeoutError::Disconnected) => closing = true,
                Err(RecvTimeoutError::Timeout) => {}
            }
            while flight.front().is_some_and(|f| f.done.is_complete()) {
                flight.pop_front();
            }
            if aborted {
                continue;
            }
            let stop =
                self.check_async(&comm).or_else(|| {
                    let late = flight
                        .front()
                        .filter(|f| f.started.elapsed() >= self.timeout)?;
                    Some(self.op_err(
                    &late.info,
                    CommErrorKind::Timeout {
                        missing: vec![],
                        after: self.timeout,
                        detail: Some(
                            "NCCL cannot tell which ranks did not join; the communicator was \
                             aborted"
                                .to_string(),
                        ),
                    },
                ))
                });
            if let Some(e) = stop {
                self.shared.fail(e);
                // SAFETY: the communicator is live (never aborted before) and owned by this
                // thread; ncclCommAbort also stops its kernels still waiting on peers.
                unsafe {
                    let _ = sys::ncclCommAbort(comm.0);
                }
                aborted = true;
            }
        }
        if !aborted {
            // Everything launched has finished (the loop waited for it).
            let _ = stream.synchronize();
            drop(flight);
            // SAFETY: the communicator is live, owned by this thread, and nothing is pending.
            unsafe {
                let _ = sys::ncclCommDestroy(comm.0);
            }
        }
    }

    /// An asynchronous NCCL error of the communicator (a peer died, a network failure), if any.
    fn check_async(&self, comm: &RawComm) -> Option<Error> {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator owned by this thread; `state` is a valid out pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(comm.0, &mut state) };
        let bad = match (r, state) {
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclSuccess) => return None,
            (sys::ncclResult_t::ncclSuccess, sys::ncclResult_t::ncclInProgress) => return None,
            (sys::ncclResult_t::ncclSuccess, s) => s,
            (r, _) => r,
        };
        Some(Error::comm(
            self.ranks[self.rank],
            &self.ranks,
            "nccl",
            None,
            CommErrorKind::Backend(format!(
                "NCCL reported {bad:?}; the communicator was aborted"
            )),
        ))
    }

    /// Launches `ops` (one NCCL group when there are several) after `ready`, and records the
    /// done event; replies to every op.
    fn launch(
        &self,
        comm: &RawComm,
        stream: &CudaStream,
        ops: Vec<Op>,
        ready: Option<CudaEvent>,
        flight: &mut VecDeque<InFlight>,
    ) {
        // Receives first learn their message's dtype and shape, and get their output.
        let mut outputs: Vec<Option<Tensor>> = Vec::with_capacity(ops.len());
        for op in &ops {
            match &op.kind {
                Kind::Recv(src, key) => match self.receive_header(&op.info, *src, key) {
                    Ok(t) => outputs.push(Some(t)),
                    Err(e) => {
                        self.fail_all(ops, e);
                        return;
                    }
                },
                _ => outputs.push(None),
            }
        }
        let r = (|| -> std::result::Result<CudaEvent, String> {
            if let Some(ev) = &ready {
                stream
                    .wait(ev)
                    .map_err(|e| format!("waiting for the compute stream: {e}"))?;
            }
            if outputs.iter().any(Option::is_some) {
                // Receive outputs were allocated here, ordered on the compute stream.
                let ev = self
                    .compute
                    .record_event(None)
                    .map_err(|e| format!("recording an event: {e}"))?;
                stream
                    .wait(&ev)
                    .map_err(|e| format!("waiting for the compute stream: {e}"))?;
            }
            let grouped = ops.len() > 1;
            if grouped {
                nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
            }
            let mut first_err = None;
            for (op, out) in ops.iter().zip(&outputs) {
                let buf = out.as_ref().map(|t| t.cuda_buffer()).transpose();
                let r = buf
                    .map_err(|e| e.to_string())
                    .and_then(|b| self.call(comm, stream, &op.kind, b));
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
            }
            if grouped {
                nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
            }
            if let Some(e) = first_err {
                return Err(e);
            }
            stream
                .record_event(None)
                .map_err(|e| format!("recording the done event: {e}"))
        })();
        match r {
            Ok(done) => {
                let done = Arc::new(done);
                let now = Instant::now();
                for (op, out) in ops.into_iter().zip(outputs) {
                    let output = out.or_else(|| op.keep.get(1).cloned());
                    let _ = op.reply.send(Ok(Launched {
                        done: done.clone(),
                        output: output.clone(),
                    }));
                    let mut keep = op.keep;
                    keep.extend(output);
                    flight.push_back(InFlight {
                        info: op.info,
                        started: now,
                        done: done.clone(),
                        _keep: keep,
                    });
                }
            }
            Err(msg) => {
                let info = ops[0].info.clone();
                let e = self.op_err(&info, CommErrorKind::Backend(msg));
                self.fail_all(ops, e);
            }
        }
    }

    fn fail_all(&self, ops: Vec<Op>, e: Error) {
        for op in ops {
            let _ = op.reply.send(Err(e.clone()));
        }
    }

    /// Reads a receive's header from the store (waiting up to the store's timeout) and
    /// allocates its output.
    fn receive_header(&self, info: &OpInfo, src: usize, key: &str) -> Result<Tensor> {
        let bytes = self.store.get(key).map_err(|e| {
            let msg = e.to_string();
            if msg.contains("not set within") {
                self.op_err(
                    info,
                    CommErrorKind::Timeout {
                        missing: vec![self.ranks[src]],
                        after: self.timeout,
                        detail: Some(format!("its message #{} never came", info.seq)),
                    },
                )
            } else {
                self.op_err(info, CommErrorKind::Backend(msg))
            }
        })?;
        let h = MessageHeader::decode(&bytes)
            .map_err(|e| self.op_err(info, CommErrorKind::Backend(e.to_string())))?;
        Tensor::cuda_uninit(h.dims.clone(), h.dtype, self.ordinal)
    }

    /// Issues one NCCL call on `stream` (`out`: a receive's output).
    fn call(
        &self,
        comm: &RawComm,
        stream: &CudaStream,
        kind: &Kind,
        out: Option<CudaBuffer>,
    ) -> std::result::Result<(), String> {
        let s = stream.cu_stream() as sys::cudaStream_t;
        let p = |b: &CudaBuffer| b.ptr as *mut c_void;
        let w = self.ranks.len();
        // SAFETY: every buffer is a live device allocation of this rank's device (kept alive
        // until the done event completes) with room for the counts given: an all-reduce's and a
        // broadcast's output have the input's length, an all-gather's w times it, a
        // reduce-scatter's 1/w of it, a receive's the length of its header (an all-to-all's
        // blocks: see `all_to_all`); the communicator
        // is live and owned by this thread; the stream belongs to the communicator's device.
        let r = unsafe {
            match kind {
                Kind::AllReduce(i, o, op) => {
                    nccl::all_reduce(p(i), p(o), i.len, nccl_dtype(i.dtype), *op, comm.0, s)
                }
                Kind::ReduceScatter(i, o, op) => {
                    nccl::reduce_scatter(p(i), p(o), i.len / w, nccl_dtype(i.dtype), *op, comm.0, s)
                }
                Kind::AllGather(i, o) => {
                    nccl::all_gather(p(i), p(o), i.len, nccl_dtype(i.dtype), comm.0, s)
                }
                Kind::Broadcast(i, o, root) => nccl::broadcast(
                    p(i),
                    p(o),
                    i.len,
                    nccl_dtype(i.dtype),
                    *root as i32,
                    comm.0,
                    s,
                ),
                Kind::AllToAll(i, o, send, recv) => {
                    return Self::all_to_all(comm, s, i, o, send, recv);
                }
                Kind::Send(i, peer) => {
                    nccl::send(p(i), i.len, nccl_dtype(i.dtype), *peer as i32, comm.0, s)
                }
                Kind::Recv(peer, _) => {
                    let o = out.ok_or("a receive without its output")?;
                    nccl::recv(p(&o), o.len, nccl_dtype(o.dtype), *peer as i32, comm.0, s)
                }
            }
        };
        r.map(|_| ()).map_err(|e| nccl_err(kind.name(), e))
    }

    /// An all-to-all as NCCL's documentation builds it: in one group, for every rank `r` (this
    /// one included), `ncclSend` of its block of the input and `ncclRecv` of its block of the
    /// output, `send[r]` and `recv[r]` elements at consecutive offsets; empty blocks post
    /// nothing.
    fn all_to_all(
        comm: &RawComm,
        s: sys::cudaStream_t,
        i: &CudaBuffer,
        o: &CudaBuffer,
        send: &[usize],
        recv: &[usize],
    ) -> std::result::Result<(), String> {
        let size = i.dtype.size_in_bytes() as u64;
        let ty = nccl_dtype(i.dtype);
        let at = |b: &CudaBuffer, elems: usize| (b.ptr + elems as u64 * size) as *mut c_void;
        nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let mut first_err = None;
        let (mut sent, mut received) = (0, 0);
        for (r, (&ns, &nr)) in send.iter().zip(recv).enumerate() {
            // SAFETY: `i` holds sum(send) elements and `o` sum(recv) (checked at the call), so
            // every block lies inside its live device allocation (kept alive until the done
            // event completes); the communicator is live and owned by this thread; the stream
            // belongs to the communicator's device; `r` is a rank of the communicator.
            unsafe {
                if ns > 0 {
                    if let Err(e) = nccl::send(at(i, sent), ns, ty, r as i32, comm.0, s) {
                        first_err.get_or_insert(nccl_err("ncclSend", e));
                    }
                }
                if nr > 0 {
                    if let Err(e) = nccl::recv(at(o, received), nr, ty, r as i32, comm.0, s) {
                        first_err.get_or_insert(nccl_err("ncclRecv", e));
                    }
                }
            }
            sent += ns;
            received += nr;
        }
        // The group is closed whatever happened inside it.
        let end = nccl::group_end().map_err(|e| nccl_err("ncclGroupEnd", e));
        match first_err {
            Some(e) => Err(e),
            None => end.map(|_| ()),
        }
    }
}

impl Kind {
    fn name(&self) -> &'static str {
        match self {
            Kind::AllReduce(..) => "ncclAllReduce",
            Kind::ReduceScatter(..) => "ncclReduceScatter",
            Kind::AllGather(..) => "ncclAllGather",
            Kind::Broadcast(..) => "ncclBroadcast",
            Kind::AllToAll(..) => "ncclSend/ncclRecv",
            Kind::Send(..) => "ncclSend",
            Kind::Recv(..) => "ncclRecv",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_a_nccl_type() {
        use sys::ncclDataType_t as T;
        let table = [
            (DType::F64, T::ncclFloat64),
            (DType::F32, T::ncclFloat32),
            (DType::BF16, T::ncclBfloat16),
            (DType::F16, T::ncclFloat16),
            (DType::U8, T::ncclUint8),
            (DType::U32, T::ncclUint32),
            (DType::I64, T::ncclInt64),
        ];
        for (d, t) in table {
            assert_eq!(nccl_dtype(d), t, "{d:?}");
        }
    }

    #[test]
    fn reduce_ops_map_and_avg_needs_a_float() {
        use sys::ncclRedOp_t as O;
        for d in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            assert_eq!(nccl_op(ReduceOp::Sum, d), Ok(O::ncclSum));
            assert_eq!(nccl_op(ReduceOp::Avg, d), Ok(O::ncclAvg));
            assert_eq!(nccl_op(ReduceOp::Max, d), Ok(O::ncclMax));
        }
        for d in [DType::I64, DType::U8, DType::U32] {
            assert_eq!(nccl_op(ReduceOp::Sum, d), Ok(O::ncclSum));
            assert_eq!(nccl_op(ReduceOp::Max, d), Ok(O::ncclMax));
            assert_eq!(
                nccl_op(ReduceOp::Avg, d),
                Err(format!("avg needs a float dtype, got {d}"))
            );
        }
    }
}
