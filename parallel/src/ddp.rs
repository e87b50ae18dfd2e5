//! Data parallelism (DDP): every rank holds the whole model and its own slice of the global batch;
//! gradients are averaged across ranks during backward.
//!
//! * **Start.** [`Ddp::new`] broadcasts every parameter from rank 0 (copied in place), so all
//!   ranks start from the same weights.
//! * **Buckets.** Parameters are grouped into buckets of about [`DdpConfig::bucket_bytes`] in
//!   *reverse* registration order, the order gradients tend to become ready in backward. A bucket
//!   closes once it holds at least `bucket_bytes` (so a bucket may exceed the cap by one
//!   parameter, and each holds at least one), and also where the flat buffer's dtype would change.
//! * **Overlap.** A gradient-ready hook on every parameter marks it ready. When a bucket is
//!   complete its gradients are flattened into one buffer (`cat` of the reshaped gradients, cast
//!   to [`DdpConfig::reduce_dtype`] if set) and its all-reduce ([`ReduceOp::Avg`]) is launched at
//!   once, while backward goes on. Buckets are launched strictly in bucket order (a complete
//!   bucket waits for the ones before it), so every rank issues the same collectives in the same
//!   order whatever order its hooks fire in.
//! * **Finish.** [`Ddp::finish`], called after backward and before the optimizer, launches any
//!   bucket not yet launched, waits for every bucket, and sets each parameter's gradient to its
//!   averaged value (a view of the bucket's buffer, cast back to the parameter's dtype).
//! * **Parameters without a gradient** in a backward (unused by this rank's forward) contribute
//!   zeros: their buckets are launched by `finish` (in bucket order, consistently on every rank),
//!   so nothing deadlocks. Such a parameter then receives the average like any other. With
//!   [`DdpConfig::find_unused_parameters`], `finish` also all-reduces (max) a mask of which
//!   parameters had a gradient on any rank, and parameters that had none anywhere keep no
//!   gradient (so an optimizer skips them, as on a single device); this costs one small
//!   collective per step.
//! * **Gradient accumulation.** Inside [`Ddp::no_sync`] (or with [`Ddp::set_sync`]`(false)`) the
//!   hooks do nothing and gradients accumulate locally; the backward of the final micro-batch,
//!   with sync on, reduces the accumulated sums. Gradients are accumulated on each rank in
//!   micro-batch order, then averaged across ranks in rank order.
//! * **Clipping** needs nothing special: after `finish` every rank holds the same averaged
//!   gradients, so [`meshgrad_nn::optim::clip_grad_norm`] computes the same norm everywhere.
//!
//! Reproducibility: every rank receives the same bits from the all-reduce, so parameters stay
//! bit-identical across ranks, and a run is bit-for-bit repeatable. With one rank, DDP equals
//! the single-device step bit for bit (the average over one rank is exact).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use meshgrad_autograd::{Var, VarId};
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use crate::comm::{Communicator, ReduceOp, Work};

/// Options of [`Ddp`].
#[derive(Clone, Debug, PartialEq)]
pub struct DdpConfig {
    /// Target bytes per gradient bucket, counted in the reduction dtype (default 25 MiB).
    pub bucket_bytes: usize,
    /// Reduce gradients in this dtype (bf16 or f16 to halve the traffic); `None` reduces in each
    /// parameter's dtype. The flat buffer is cast before the all-reduce and back after.
    pub reduce_dtype: Option<DType>,
    /// All-reduce a mask of which parameters got a gradient, so parameters unused on every rank
    /// keep no gradient (see the module docs). Default false.
    pub find_unused_parameters: bool,
    /// Broadcast the parameters from rank 0 in [`Ddp::new`] (default true). Turn off only when
    /// every rank is known to have built identical weights.
    pub broadcast_params: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_bytes: 25 << 20,
            reduce_dtype: None,
            find_unused_parameters: false,
            broadcast_params: true,
        }
    }
}

/// When a bucket's all-reduce was launched (for checking that communication overlaps backward).
#[derive(Clone, Copy, Debug)]
pub struct LaunchEvent {
    /// Bucket index.
    pub bucket: usize,
    /// Launch time.
    pub at: Instant,
    /// Whether the launch came from a gradient-ready hook (during backward) rather than from
    /// [`Ddp::finish`].
    pub during_backward: bool,
}

struct Bucket {
    /// Indices into the parameter list, in bucket order (reverse registration order).
    params: Vec<usize>,
    /// Dtype of the flat buffer.
    dtype: DType,
}

struct StepState {
    ready: Vec<Vec<bool>>,
    pending: Vec<usize>,
    next: usize,
    works: Vec<Option<Work>>,
    had_grad: Vec<bool>,
    events: Vec<LaunchEvent>,
    last_events: Vec<LaunchEvent>,
}

struct Shared {
    comm: Arc<dyn Communicator>,
    params: Vec<(String, Var)>,
    buckets: Vec<Bucket>,
    slot_of: HashMap<VarId, (usize, usize)>,
    sync: AtomicBool,
    config: DdpConfig,
    state: Mutex<StepState>,
}

/// Data-parallel training over a communicator (see the [module docs](self)).
///
/// ```no_run
/// # use meshgrad_parallel::{Ddp, DdpConfig, Communicator};
/// # fn f(comm: std::sync::Arc<dyn Communicator>, model: &meshgrad_nn::Gpt) -> meshgrad_tensor::Result<()> {
/// use meshgrad_nn::Module;
/// let ddp = Ddp::new(model.named_parameters(), comm, DdpConfig::default())?;
/// // per step: forward on this rank's rows, then
/// // loss.backward()?;   // buckets are all-reduced as their gradients become ready
/// ddp.finish()?;         // wait, and write the averaged gradients
/// // opt.step(lr)?;
/// # Ok(()) }
/// ```
pub struct Ddp {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Ddp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Ddp({} params in {} buckets on group {})",
            self.shared.params.len(),
            self.shared.buckets.len(),
            self.shared.comm.describe()
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The state is only mutated in short sections that leave it consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ddp {
    /// Wraps the parameters `named_params` (in registration order, e.g.
    /// `Module::named_parameters`) for data parallelism over `comm`: broadcasts them from rank 0,
    /// builds the buckets and registers a gradient-ready hook on each. Parameters that do not
    /// require grad are left alone. Every rank must pass the same parameter names and shapes.
    pub fn new(
        named_params: Vec<(String, Var)>,
        comm: Arc<dyn Communicator>,
        config: DdpConfig,
    ) -> Result<Ddp> {
        if let Some(dt) = config.reduce_dtype {
            if !dt.is_float() {
                meshgrad_tensor::bail!("ddp: reduce_dtype {dt} must be a float dtype");
            }
        }
        let params: Vec<(String, Var)> = named_params
            .into_iter()
            .filter(|(_, p)| p.requires_grad())
            .collect();
        let mut seen = HashMap::new();
        for (name, p) in &params {
            if let Some(other) = seen.insert(p.id(), name.clone()) {
                meshgrad_tensor::bail!(
                    "ddp: parameter {name} is the same variable as {other}; list each once"
                );
            }
            if !p.tensor().dtype().is_float() {
                meshgrad_tensor::bail!(
                    "ddp: parameter {name} has dtype {}; only float parameters are synchronised",
                    p.tensor().dtype()
                );
            }
        }
        if config.broadcast_params {
            broadcast_params(&params, comm.as_ref())?;
        }
        let buckets = make_buckets(&params, &config);
        let mut slot_of = HashMap::new();
        for (b, bucket) in buckets.iter().enumerate() {
            for (i, &p) in bucket.params.iter().enumerate() {
                slot_of.insert(params[p].1.id(), (b, i));
            }
        }
        let state = StepState {
            ready: buckets
                .iter()
                .map(|b| vec![false; b.params.len()])
                .collect(),
            pending: buckets.iter().map(|b| b.params.len()).collect(),
            next: 0,
            works: buckets.iter().map(|_| None).collect(),
            had_grad: vec![false; params.len()],
            events: Vec::new(),
            last_events: Vec::new(),
        };
        let shared = Arc::new(Shared {
            comm,
            params,
            buckets,
            slot_of,
            sync: AtomicBool::new(true),
            config,
            state: Mutex::new(state),
        });
        for (_, p) in &shared.params {
            let weak: Weak<Shared> = Arc::downgrade(&shared);
            p.register_grad_ready_hook(Arc::new(move |v: &Var| match weak.upgrade() {
                Some(s) => s.grad_ready(v),
                // The Ddp was dropped: the hook is inert.
                None => Ok(()),
            }));
        }
        Ok(Ddp { shared })
    }

    /// The communicator gradients are averaged over.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.shared.comm
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.shared.config
    }

    /// The parameter names of each bucket, in bucket (launch) order.
    pub fn bucket_names(&self) -> Vec<Vec<String>> {
        self.shared
            .buckets
            .iter()
            .map(|b| {
                b.params
                    .iter()
                    .map(|&i| self.shared.params[i].0.clone())
                    .collect()
            })
            .collect()
    }

    /// Whether the next backward synchronises gradients.
    pub fn is_sync(&self) -> bool {
        self.shared.sync.load(Ordering::SeqCst)
    }

    /// Turns gradient synchronisation on or off for the following backward passes (off for the
    /// non-final micro-batches of gradient accumulation).
    pub fn set_sync(&self, on: bool) {
        self.shared.sync.store(on, Ordering::SeqCst);
    }

    /// Turns synchronisation off until the guard is dropped: backward passes in its scope only
    /// accumulate gradients locally.
    pub fn no_sync(&self) -> NoSync<'_> {
        let prev = self.shared.sync.swap(false, Ordering::SeqCst);
        NoSync { ddp: self, prev }
    }

    /// Completes the gradient synchronisation of the last backward: launches the buckets not
    /// launched yet (parameters without a gradient contribute zeros), waits for every bucket and
    /// sets each parameter's gradient to the average across ranks. Call it after the final
    /// (synchronised) backward of a step and before clipping and the optimizer. Must be called
    /// with sync on, by every rank.
    pub fn finish(&self) -> Result<()> {
        if !self.is_sync() {
            meshgrad_tensor::bail!(
                "ddp: finish() called with gradient sync off (inside no_sync); gradients of \
                 non-final micro-batches are not synchronised, call finish() after the final one"
            );
        }
        let s = &self.shared;
        let (works, had_grad) = {
            let mut st = lock(&s.state);
            let r = (|| {
                while st.next < s.buckets.len() {
                    let b = st.next;
                    s.launch(&mut st, b, false)?;
                    st.next += 1;
                }
                Ok::<_, Error>(())
            })();
            let works: Vec<Option<Work>> = st.works.iter_mut().map(Option::take).collect();
            let had_grad = std::mem::replace(&mut st.had_grad, vec![false; s.params.len()]);
            st.reset(&s.buckets);
            r?;
            (works, had_grad)
        };
        let used = if s.config.find_unused_parameters {
            let mask: Vec<u8> = had_grad.iter().map(|&h| h as u8).collect();
            let n = mask.len();
            let mask = Tensor::from_vec(mask, n, Device::Cpu)?;
            let m = s.comm.all_reduce(&mask, ReduceOp::Max)?.wait()?;
            m.to_vec::<u8>()?.into_iter().map(|x| x != 0).collect()
        } else {
            vec![true; s.params.len()]
        };
        with_tag(MemoryTag::Grads, || {
            for (b, work) in works.into_iter().enumerate() {
                let Some(work) = work else {
                    meshgrad_tensor::bail!("ddp: internal error: bucket {b} was never launched");
                };
                let flat = work.wait()?;
                s.unflatten(b, &flat, &used)?;
            }
            Ok(())
        })
    }

    /// The bucket launches of the last completed synchronisation, in launch order.
    pub fn last_launches(&self) -> Vec<LaunchEvent> {
        lock(&self.shared.state).last_events.clone()
    }
}

/// Restores gradient synchronisation when dropped (see [`Ddp::no_sync`]).
pub struct NoSync<'a> {
    ddp: &'a Ddp,
    prev: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.ddp.shared.sync.store(self.prev, Ordering::SeqCst);
    }
}

impl StepState {
    fn reset(&mut self, buckets: &[Bucket]) {
        for r in self.ready.iter_mut() {
            r.iter_mut().for_each(|x| *x = false);
        }
        self.pending = buckets.iter().map(|b| b.params.len()).collect();
        self.next = 0;
        self.last_events = std::mem::take(&mut self.events);
    }
}

impl Shared {
    /// The gradient-ready hook: marks the parameter ready and launches every bucket that is
    /// complete and next in order.
    fn grad_ready(&self, v: &Var) -> Result<()> {
        if !self.sync.load(Ordering::SeqCst) {
            return Ok(());
        }
        let Some(&(b, i)) = self.slot_of.get(&v.id()) else {
            return Ok(());
        };
        let mut st = lock(&self.state);
        if st.ready[b][i] {
            let name = &self.params[self.buckets[b].params[i]].0;
            meshgrad_tensor::bail!(
                "ddp: parameter {name} got a second gradient before finish(); call finish() after \
                 each synchronised backward, and run non-final micro-batches inside no_sync()"
            );
        }
        st.ready[b][i] = true;
        st.pending[b] -= 1;
        while st.next < self.buckets.len() && st.pending[st.next] == 0 {
            let next = st.next;
            self.launch(&mut st, next, true)?;
            st.next += 1;
        }
        Ok(())
    }

    /// Flattens bucket `b`'s gradients and launches its all-reduce.
    fn launch(&self, st: &mut StepState, b: usize, during_backward: bool) -> Result<()> {
        let bucket = &self.buckets[b];
        let flat = with_tag(MemoryTag::Grads, || -> Result<Tensor> {
            let mut parts = Vec::with_capacity(bucket.params.len());
            for &pi in &bucket.params {
                let p = self.params[pi].1.tensor();
                let g = match self.params[pi].1.grad() {
                    Some(g) => {
                        st.had_grad[pi] = true;
                        g
                    }
                    None => Tensor::zeros(p.shape(), bucket.dtype, p.device())?,
                };
                parts.push(g.reshape(p.elem_count())?.to_dtype(bucket.dtype)?);
            }
            let refs: Vec<&Tensor> = parts.iter().collect();
            Tensor::cat(&refs, 0)
        })
        .map_err(|e| Error::msg(format!("ddp: flattening bucket {b}: {e}")))?;
        let work = self.comm.all_reduce(&flat, ReduceOp::Avg)?;
        st.works[b] = Some(work);
        st.events.push(LaunchEvent {
            bucket: b,
            at: Instant::now(),
            during_backward,
        });
        Ok(())
    }

    /// Sets the gradients of bucket `b`'s parameters from its averaged flat buffer.
    fn unflatten(&self, b: usize, flat: &Tensor, used: &[bool]) -> Result<()> {
        let mut offset = 0;
        for &pi in &self.buckets[b].params {
            let (name, p) = &self.params[pi];
            let t = p.tensor();
            let n = t.elem_count();
            if !used[pi] {
                p.set_grad(None);
                offset += n;
                continue;
            }
            let g = flat
                .narrow(0, offset, n)?
                .reshape(t.shape())?
                .to_dtype(t.dtype())
                .map_err(|e| Error::msg(format!("ddp: gradient of {name}: {e}")))?;
            p.set_grad(Some(g));
            offset += n;
        }
        Ok(())
    }
}

/// Copies every parameter's values from rank 0 (all broadcasts launched, then waited in order).
fn broadcast_params(params: &[(String, Var)], comm: &dyn Communicator) -> Result<()> {
    let works: Vec<Work> = params
        .iter()
        .map(|(_, p)| comm.broadcast(p.tensor(), 0))
        .collect::<Result<_>>()?;
    for ((name, p), w) in params.iter().zip(works) {
        let v = w
            .wait()
            .map_err(|e| Error::msg(format!("ddp: broadcasting parameter {name}: {e}")))?;
        if comm.rank() != 0 {
            p.tensor().copy_from(&v)?;
        }
    }
    Ok(())
}

/// Groups parameters into buckets in reverse registration order (see the module docs).
fn make_buckets(params: &[(String, Var)], config: &DdpConfig) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut bytes = 0usize;
    for i in (0..params.len()).rev() {
        let t = params[i].1.tensor();
        let dtype = config.reduce_dtype.unwrap_or(t.dtype());
        let open = buckets
            .last()
            .is_some_and(|b| b.dtype == dtype && bytes < config.bucket_bytes);
        if !open {
            buckets.push(Bucket {
                params: Vec::new(),
                dtype,
            });
            bytes = 0;
        }
        if let Some(b) = buckets.last_mut() {
            b.params.push(i);
        }
        bytes += t.elem_count() * dtype.size_in_bytes();
    }
    buckets
}
