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
//! `MPI_Ibarrier`, `MPI_Isend`, matched probe + `MPI_Imrecv`), polls every operation in flight
//! with `MPI_Test` and hands each result to its `Work` when it completes. So communication
//! overlaps compute as with the in-process backend, and two ranks that send to each other at the
//! same time do not deadlock. Operations are launched in the order they are issued, which is what
//! MPI's matching rule for collectives needs (the trait's matching rule is the same).
//!
//! # What differs from the in-process backend
//!
//! * **Reduction order.** MPI chooses the algorithm (Open MPI: recursive doubling, rings, ...),
//!   so sums are *not* combined in rank order and are not bit-identical to the in-process
//!   backend's; every rank still receives the same bits (MPI's reductions are computed once and
//!   distributed). f32/f64/integer sums and maxima use MPI's predefined operations (`MPI_MAX` on
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
//!   those members (not over the parent). So the members must create overlapping groups in the
//!   same order; [`crate::DeviceMesh`] does (every rank builds its groups dimension by dimension in
//!   the same order). The trait's tag becomes the MPI tag of the creation (a hash).
//! * **Failures.** Mismatched calls are not detected (MPI may fail with a truncation error or
//!   hang), and there is no timeout yet: a rank that never joins keeps its peers waiting. A panic
//!   in any thread of any rank calls `MPI_Abort` (a hook installed by
//!   [`MpiCommunicator::world`]), so the whole job ends with a non-zero status instead of
//!   hanging; [`abort`] does the same for errors.
//! * **Limits.** MPI counts are `int`: one operation moves at most 2^31 - 1 elements (a message
//!   at most 2^31 - 1 bytes).

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use half::{bf16, f16};
use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{cpu_map, DType, Device, Error, Result, Tensor};
use mpi::ffi;

use super::{format_ranks, reduce, Communicator, Pending, ReduceOp, Work};

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

type Reply<T> = Sender<Result<T>>;

enum Request {
    AllReduce(usize, CpuStorage, ReduceOp, Reply<CpuStorage>),
    ReduceScatter(usize, CpuStorage, ReduceOp, Reply<CpuStorage>),
    AllGather(usize, CpuStorage, Reply<CpuStorage>),
    Broadcast(usize, CpuStorage, usize, Reply<CpuStorage>),
    Barrier(usize, Reply<()>),
    Send(usize, Vec<u8>, usize, Reply<()>),
    Recv(usize, usize, Reply<Vec<u8>>),
    NewGroup(usize, Vec<usize>, c_int, Reply<usize>),
    Shutdown,
}

/// Ends the whole MPI job at once with `code` (`MPI_Abort` on the world), e.g. after an error on
/// this rank that its peers cannot know about. Exits the process when MPI is not running.
pub fn abort(code: i32) -> ! {
    if LIVE.load(Ordering::SeqCst) {
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
/// cannot be initialised again in this process.
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
    }
}

fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        if LIVE.load(Ordering::SeqCst) {
            eprintln!(
                "rank {}: panicked; aborting the MPI job",
                WORLD_RANK.load(Ordering::SeqCst)
            );
            abort(101);
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

    fn send_request<T: Send + 'static>(
        &self,
        make: impl FnOnce(Reply<T>) -> Request,
    ) -> Result<Work<T>> {
        let (tx, rx) = channel();
        let guard = self.engine.tx.lock().unwrap_or_else(|e| e.into_inner());
        let sender = guard
            .as_ref()
            .ok_or_else(|| Error::msg(format!("rank {}: MPI was finalized", self.rank)))?;
        sender
            .send(make(tx))
            .map_err(|_| Error::msg(format!("rank {}: the MPI thread has ended", self.rank)))?;
        Ok(Work::pending(Box::new(Waiting {
            rx,
            done: Mutex::new(None),
        })))
    }

    fn err(&self, call: &str, msg: impl std::fmt::Display) -> Error {
        Error::msg(format!(
            "rank {}: {call} on group {}: {msg}",
            self.global_rank(),
            self.describe()
        ))
    }
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
        if !reduce::supports(op, tensor.dtype()) {
            return Err(self.err(
                "all_reduce",
                format!("{op} needs a float dtype, got {:?}", tensor.dtype()),
            ));
        }
        let dims = tensor.dims().to_vec();
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request(|r| Request::AllReduce(id, data, op, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn reduce_scatter(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let w = self.world_size();
        let mut dims = tensor.dims().to_vec();
        if dims.is_empty() || !dims[0].is_multiple_of(w) {
            return Err(self.err(
                "reduce_scatter",
                format!("the leading dimension of {dims:?} is not divisible by {w}"),
            ));
        }
        if !reduce::supports(op, tensor.dtype()) {
            return Err(self.err(
                "reduce_scatter",
                format!("{op} needs a float dtype, got {:?}", tensor.dtype()),
            ));
        }
        dims[0] /= w;
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request(|r| Request::ReduceScatter(id, data, op, r))?
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
            .send_request(|r| Request::AllGather(id, data, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        if root >= self.world_size() {
            return Err(self.err("broadcast", format!("root {root} is not a group rank")));
        }
        let dims = tensor.dims().to_vec();
        let data = tensor.to_cpu_storage()?;
        let id = self.id;
        Ok(self
            .send_request(|r| Request::Broadcast(id, data, root, r))?
            .map(move |d| tensor_of(d, dims)))
    }

    fn send(&self, tensor: &Tensor, dst: usize) -> Result<Work<()>> {
        if dst >= self.world_size() || dst == self.rank {
            return Err(self.err("send", format!("invalid destination rank {dst}")));
        }
        let bytes = encode(tensor)?;
        let id = self.id;
        self.send_request(|r| Request::Send(id, bytes, dst, r))
    }

    fn recv(&self, src: usize) -> Result<Work> {
        if src >= self.world_size() || src == self.rank {
            return Err(self.err("recv", format!("invalid source rank {src}")));
        }
        let id = self.id;
        Ok(self
            .send_request(|r| Request::Recv(id, src, r))?
            .map(|b| decode(&b)))
    }

    fn barrier(&self) -> Result<Work<()>> {
        let id = self.id;
        self.send_request(|r| Request::Barrier(id, r))
    }

    fn new_group(&self, ranks: &[usize], tag: &str) -> Result<Arc<dyn Communicator>> {
        let n = self.world_size();
        let mut seen = vec![false; n];
        for &r in ranks {
            if r >= n || std::mem::replace(&mut seen[r], true) {
                return Err(self.err(
                    "new_group",
                    format!("ranks {ranks:?} must be distinct ranks below {n}"),
                ));
            }
        }
        let Some(my) = ranks.iter().position(|&r| r == self.rank) else {
            return Err(self.err(
                "new_group",
                format!(
                    "this rank (group rank {}) is not among {ranks:?}",
                    self.rank
                ),
            ));
        };
        // A stable hash of the tag (FNV-1a), within the 15 bits every MPI allows for tags.
        let h = tag.bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ b as u32).wrapping_mul(0x0100_0193)
        });
        let mpi_tag = (h & 0x3fff) as c_int;
        let id = self.id;
        let group = ranks.to_vec();
        let new_id = self
            .send_request(|r| Request::NewGroup(id, group, mpi_tag, r))?
            .wait()
            .map_err(|e| self.err("new_group", e))?;
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
        /// The separate send buffer, when MPI_IN_PLACE is unknown (kept alive until completion).
        _send: Option<CpuStorage>,
        avg: Option<usize>,
        keep: Option<usize>,
        reply: Reply<CpuStorage>,
    },
    /// The buffer is only kept alive (a send's message) until MPI completes.
    Unit(#[allow(dead_code)] Vec<u8>, Reply<()>),
    Bytes(Vec<u8>, Reply<Vec<u8>>),
}

struct InFlight {
    req: ffi::MPI_Request,
    finish: Finish,
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
}

struct Comm {
    handle: ffi::MPI_Comm,
    size: usize,
}

struct State {
    comms: Vec<Comm>,
    ops: Ops,
    in_place: Option<*mut c_void>,
    flight: Vec<InFlight>,
    /// Receives waiting for their message, per (communicator, source), in issue order.
    recvs: HashMap<(usize, usize), VecDeque<Reply<Vec<u8>>>>,
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
            comms: vec![Comm {
                handle: world,
                size: size as usize,
            }],
            ops,
            in_place,
            flight: Vec::new(),
            recvs: HashMap::new(),
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
    let _ = init.send(Ok((WORLD_RANK.load(Ordering::SeqCst), state.comms[0].size)));
    let mut shutdown = false;
    let mut idle = 0u32;
    loop {
        // New requests: block when nothing is in flight, else take what is there.
        let busy = !state.flight.is_empty() || state.recvs.values().any(|q| !q.is_empty());
        let mut progressed = false;
        if !shutdown {
            if !busy {
                match rx.recv() {
                    Ok(r) => {
                        shutdown |= state.launch(r);
                        progressed = true;
                    }
                    Err(_) => shutdown = true,
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
        if shutdown && state.flight.is_empty() && state.recvs.values().all(|q| q.is_empty()) {
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
    // SAFETY: every request has completed; the communicators and ops were created by this thread.
    unsafe {
        for c in state.comms.iter_mut() {
            ffi::MPI_Comm_free(&mut c.handle);
        }
    }
    LIVE.store(false, Ordering::SeqCst);
    drop(universe); // MPI_Finalize
}

impl State {
    /// Launches one request; true for a shutdown.
    fn launch(&mut self, r: Request) -> bool {
        match r {
            Request::Shutdown => return true,
            Request::AllReduce(c, data, op, reply) => self.reduce(c, data, op, false, reply),
            Request::ReduceScatter(c, data, op, reply) => self.reduce(c, data, op, true, reply),
            Request::AllGather(c, data, reply) => {
                let comm = &self.comms[c];
                let (w, n) = (comm.size, data.len());
                let mut me: c_int = 0;
                // SAFETY: a valid communicator and out pointer.
                unsafe { ffi::MPI_Comm_rank(comm.handle, &mut me) };
                let mut out = CpuStorage::zeros(data.dtype(), n * w);
                let (ty, handle) = (datatype(data.dtype()), comm.handle);
                let cnt = match count(n * w, "all_gather") {
                    Ok(_) => n as c_int,
                    Err(e) => {
                        let _ = reply.send(Err(e));
                        return false;
                    }
                };
                let mut send = Some(data);
                let send_ptr: *const c_void = match self.in_place {
                    Some(ip) => {
                        let d = send.take().expect("data");
                        let bytes = d.as_bytes();
                        let o = cpu_map!(&mut out, v => bytemuck::cast_slice_mut::<_, u8>(v.as_mut_slice()));
                        let at = me as usize * bytes.len();
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
                        avg: None,
                        keep: None,
                        reply,
                    },
                );
            }
            Request::Broadcast(c, mut data, root, reply) => {
                let n = match count(data.len(), "broadcast") {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = reply.send(Err(e));
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
                        avg: None,
                        keep: None,
                        reply,
                    },
                );
            }
            Request::Barrier(c, reply) => {
                let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                // SAFETY: a valid communicator and request out pointer.
                let code = unsafe { ffi::MPI_Ibarrier(self.comms[c].handle, req.as_mut_ptr()) };
                self.start(code, "MPI_Ibarrier", req, Finish::Unit(Vec::new(), reply));
            }
            Request::Send(c, bytes, dst, reply) => {
                let n = match count(bytes.len(), "send") {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = reply.send(Err(e));
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
                self.start(code, "MPI_Isend", req, Finish::Unit(bytes, reply));
            }
            Request::Recv(c, src, reply) => {
                self.recvs.entry((c, src)).or_default().push_back(reply);
            }
            Request::NewGroup(c, ranks, tag, reply) => {
                let r = self.new_group(c, &ranks, tag);
                let _ = reply.send(r);
            }
        }
        false
    }

    fn new_group(&mut self, c: usize, ranks: &[usize], tag: c_int) -> Result<usize> {
        let parent = self.comms[c].handle;
        let ranks_c: Vec<c_int> = ranks.iter().map(|&r| r as c_int).collect();
        // SAFETY: valid handles and out pointers; the groups are freed after use. Blocking
        // (collective over the new group's members only); operations in flight keep progressing
        // inside MPI meanwhile.
        unsafe {
            let mut pg = std::mem::zeroed::<ffi::MPI_Group>();
            check(ffi::MPI_Comm_group(parent, &mut pg), "MPI_Comm_group")?;
            let mut g = std::mem::zeroed::<ffi::MPI_Group>();
            check(
                ffi::MPI_Group_incl(pg, ranks_c.len() as c_int, ranks_c.as_ptr(), &mut g),
                "MPI_Group_incl",
            )?;
            let mut nc = ffi::RSMPI_COMM_NULL;
            let code = ffi::MPI_Comm_create_group(parent, g, tag, &mut nc);
            ffi::MPI_Group_free(&mut g);
            ffi::MPI_Group_free(&mut pg);
            check(code, "MPI_Comm_create_group")?;
            ffi::MPI_Comm_set_errhandler(nc, ffi::RSMPI_ERRORS_RETURN);
            self.comms.push(Comm {
                handle: nc,
                size: ranks.len(),
            });
        }
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
        let comm = &self.comms[c];
        let (w, n, dt) = (comm.size, data.len(), data.dtype());
        let what = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        let cnt = match count(if scatter { n / w } else { n }, what) {
            Ok(c) => c,
            Err(e) => {
                let _ = reply.send(Err(e));
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
                avg: (op == ReduceOp::Avg).then_some(w),
                keep: scatter.then_some(n / w),
                reply,
            },
        );
    }

    fn start(
        &mut self,
        code: c_int,
        what: &str,
        req: std::mem::MaybeUninit<ffi::MPI_Request>,
        finish: Finish,
    ) {
        match check(code, what) {
            // SAFETY: MPI initialised the request on success.
            Ok(()) => self.flight.push(InFlight {
                req: unsafe { req.assume_init() },
                finish,
            }),
            Err(e) => finish.fail(e),
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
            let q = self.recvs.get_mut(&(c, src)).expect("queue");
            if code != 0 {
                let reply = q.pop_front().expect("waiter");
                let _ = reply.send(check(code, "MPI_Improbe").map(|()| Vec::new()));
                moved = true;
                continue;
            }
            if flag == 0 {
                continue;
            }
            let reply = q.pop_front().expect("waiter");
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
            self.start(code, "MPI_Imrecv", req, Finish::Bytes(buf, reply));
            moved = true;
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
                f.finish.complete(check(code, "MPI_Test"));
                moved = true;
            } else {
                i += 1;
            }
        }
        moved
    }
}
