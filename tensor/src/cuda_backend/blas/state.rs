//! The per-device cuBLASLt state, created at the first matmul of the device and kept for the
//! life of its context: the handle, one workspace (from the caching allocator, never given back)
//! and the plans (descriptors plus chosen algorithm) by [`PlanKey`], so that a shape seen before
//! re-creates no descriptor and re-runs no heuristic.
//!
//! The state sits behind a mutex in [`DeviceContext`]: cuBLASLt calls of one device are issued
//! one at a time (they only enqueue work on the compute stream, so this costs little).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use super::layout::{lt_types, PlanKey};
use super::lt::{create_plan, Handle, Plan, Pointers, Scale};
use crate::cuda_backend::memory::{allocate, Block};
use crate::cuda_backend::DeviceContext;
use crate::{DType, Error, Result};

/// Workspace given to cuBLASLt: 32 MiB, NVIDIA's recommendation for Hopper (4 MiB is enough
/// before it).
pub(crate) const WORKSPACE_BYTES: usize = 32 << 20;

/// The cuBLASLt state of one device (see the module documentation).
pub(crate) struct BlasLt {
    handle: Handle,
    /// Holds an `Arc` of the context that holds this state: the cycle is harmless, contexts
    /// live for the whole process.
    workspace: Block,
    /// `None`: cuBLASLt has no algorithm for the key (remembered too, so the heuristic is not
    /// asked again).
    plans: HashMap<PlanKey, Option<Plan>>,
}

impl fmt::Debug for BlasLt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BlasLt {{ workspace: {:?}, plans: {} }}",
            self.workspace,
            self.plans.len()
        )
    }
}

/// One call: the cache key, the pointers, and what to say when it fails.
pub(super) struct Call<'a> {
    /// The plan's key.
    pub key: PlanKey,
    /// The device pointers (the workspace is filled in here).
    pub a: u64,
    /// See [`Pointers::b`].
    pub b: u64,
    /// See [`Pointers::d`].
    pub d: u64,
    /// See [`Pointers::bias`].
    pub bias: Option<u64>,
    /// See [`Pointers::aux`].
    pub aux: Option<u64>,
    /// The op and its logical shapes, for error messages.
    pub what: &'a dyn fmt::Display,
}

impl BlasLt {
    fn new(ctx: &Arc<DeviceContext>) -> Result<Self> {
        // SAFETY: `is_culib_present` only tries to dlopen the candidate library names.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(Error::Cuda {
                device: ctx.device(),
                message: "the cuBLASLt library (libcublasLt.so, CUDA 13) cannot be loaded: put \
                          the directory holding it on LD_LIBRARY_PATH"
                    .to_owned(),
            });
        }
        ctx.bind()?;
        let handle = Handle::new().map_err(|(step, e)| Error::Cuda {
            device: ctx.device(),
            message: format!("{step}: {e}"),
        })?;
        let workspace = allocate(ctx, WORKSPACE_BYTES)?;
        Ok(BlasLt {
            handle,
            workspace,
            plans: HashMap::new(),
        })
    }

    /// Enqueues `call` on the compute stream, building its plan at the first call of its key.
    /// `Ok(false)`: cuBLASLt has no algorithm for it (nothing was enqueued).
    pub(super) fn matmul(&mut self, ctx: &DeviceContext, call: &Call<'_>) -> Result<bool> {
        let fail = |step: &str, e: &dyn fmt::Display| Error::Cuda {
            device: ctx.device(),
            message: format!(
                "{}: {step} failed with {e}; cuBLASLt {:?}",
                call.what, call.key
            ),
        };
        let types = lt_types(call.key.dtype).ok_or(Error::UnsupportedDType {
            op: "matmul (cuBLASLt)",
            dtype: call.key.dtype,
        })?;
        ctx.bind()?;
        if !self.plans.contains_key(&call.key) {
            let plan = create_plan(
                &self.handle,
                &call.key,
                &types,
                WORKSPACE_BYTES,
                call.bias,
                call.aux,
            )
            .map_err(|(step, e)| fail(step, &e))?;
            self.plans.insert(call.key, plan);
        }
        let Some(plan) = self.plans.get(&call.key).and_then(Option::as_ref) else {
            return Ok(false);
        };
        if plan.workspace > WORKSPACE_BYTES {
            return Err(fail(
                "the chosen algorithm",
                &format!(
                    "a workspace of {} bytes (> {WORKSPACE_BYTES})",
                    plan.workspace
                ),
            ));
        }
        let scale = if call.key.dtype == DType::F64 {
            Scale::F64
        } else {
            Scale::F32
        };
        let p = Pointers {
            a: call.a,
            b: call.b,
            d: call.d,
            bias: call.bias,
            aux: call.aux,
            workspace: (self.workspace.ptr(), WORKSPACE_BYTES),
        };
        let stream = ctx.stream.cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
        // SAFETY: the caller checked that the operands' layouts stay inside their buffers and
        // that the output, bias and aux buffers hold what the plan writes and reads; every buffer is from
        // this device's caching allocator, whose blocks are reused only in stream order, after
        // this call has run; the context was bound above.
        unsafe { plan.run(&self.handle, scale, &p, stream) }.map_err(|(step, e)| fail(step, &e))?;
        Ok(true)
    }

    #[cfg(test)]
    /// How many plans are cached (including the keys cuBLASLt has no algorithm for).
    pub(super) fn cached_plans(&self) -> usize {
        self.plans.len()
    }
}

/// Runs `f` on the cuBLASLt state of `ctx`'s device, creating it at the first use.
pub(super) fn with_blaslt<R>(
    ctx: &Arc<DeviceContext>,
    f: impl FnOnce(&mut BlasLt) -> Result<R>,
) -> Result<R> {
    let mut guard = ctx.blaslt.lock().unwrap_or_else(|e| e.into_inner());
    let lt = match guard.as_mut() {
        Some(lt) => lt,
        None => guard.insert(BlasLt::new(ctx)?),
    };
    f(lt)
}
