//! Owners of cuBLASLt objects (handle, matmul descriptor, matrix layouts, preference) and the
//! two calls made with them: building a [`Plan`] for a [`PlanKey`] (descriptors plus the
//! heuristic's algorithm, done once per key) and enqueuing it.
//!
//! Attribute value types follow the cuBLASLt documentation: `TRANSA`/`TRANSB` are
//! `cublasOperation_t` (4 bytes), `EPILOGUE` is `cublasLtEpilogue_t` (4 bytes),
//! `BIAS_DATA_TYPE` is a `cudaDataType` (4 bytes), `BIAS_POINTER` and `EPILOGUE_AUX_POINTER`
//! device pointers (8 bytes), `EPILOGUE_AUX_LD` an `i64` (the aux data type is left unset: it
//! then is D's),
//! the layouts' `BATCH_COUNT` an `i32` and `STRIDED_BATCH_OFFSET` an `i64`, the preference's
//! `MAX_WORKSPACE_BYTES` a `u64` and `MIN_ALIGNMENT_*_BYTES` `u32`s.

use core::ffi::c_void;
use std::mem::size_of;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys::{
    self, cublasLtMatmulDescAttributes_t as DescAttr,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr,
    cublasLtMatrixLayoutAttribute_t as LayoutAttr, cublasStatus_t,
};

use super::layout::{Epilogue, LtTypes, Operand, PlanKey};

/// A cuBLASLt failure: the step that failed and cuBLAS's status.
pub(super) type LtResult<T> = Result<T, (&'static str, CublasError)>;

/// Tags an error of `step`.
fn at<T>(step: &'static str, r: Result<T, CublasError>) -> LtResult<T> {
    r.map_err(|e| (step, e))
}

/// A cuBLASLt handle, destroyed on drop.
#[derive(Debug)]
pub(super) struct Handle(pub sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle is a host object usable from any thread; the backend keeps it
// behind the device's mutex, so it is never used from two threads at once.
unsafe impl Send for Handle {}

impl Handle {
    /// A new handle (the device's context must be current).
    pub fn new() -> LtResult<Self> {
        at("creating the cuBLASLt handle", result::create_handle()).map(Handle)
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `Handle::new` and is destroyed only here.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

/// A matmul descriptor, destroyed on drop.
#[derive(Debug)]
struct MatmulDesc(sys::cublasLtMatmulDesc_t);

impl MatmulDesc {
    fn new(t: &LtTypes) -> LtResult<Self> {
        at(
            "creating the matmul descriptor",
            result::create_matmul_desc(t.compute, t.scale),
        )
        .map(MatmulDesc)
    }

    /// Sets attribute `attr` to `value` (whose type is the attribute's documented type).
    fn set<T: Copy>(&self, attr: DescAttr, value: &T, step: &'static str) -> LtResult<()> {
        // SAFETY: the descriptor is alive (owned by `self`); `value` points to `size_of::<T>()`
        // readable bytes, which cuBLASLt copies before returning.
        at(step, unsafe {
            result::set_matmul_desc_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                size_of::<T>(),
            )
        })
    }
}

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created by `MatmulDesc::new`, destroyed only here.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A matrix layout descriptor, destroyed on drop.
#[derive(Debug)]
struct LayoutDesc(sys::cublasLtMatrixLayout_t);

impl LayoutDesc {
    /// The layout of operand `o`: its stored `rows×cols` with `ld`, and the batch.
    fn new(t: &LtTypes, o: &Operand, batch: i32, step: &'static str) -> LtResult<Self> {
        let l = LayoutDesc(at(
            step,
            result::create_matrix_layout(t.data, o.rows, o.cols, o.ld),
        )?);
        if batch > 1 {
            l.set(LayoutAttr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, step)?;
            let stride: i64 = o.batch_stride;
            l.set(
                LayoutAttr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                &stride,
                step,
            )?;
        }
        Ok(l)
    }

    fn set<T: Copy>(&self, attr: LayoutAttr, value: &T, step: &'static str) -> LtResult<()> {
        // SAFETY: the layout is alive (owned by `self`); `value` points to `size_of::<T>()`
        // readable bytes, copied by cuBLASLt before it returns.
        at(step, unsafe {
            result::set_matrix_layout_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                size_of::<T>(),
            )
        })
    }
}

impl Drop for LayoutDesc {
    fn drop(&mut self) {
        // SAFETY: created by `LayoutDesc::new`, destroyed only here.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// A heuristic preference, destroyed on drop (only needed while choosing the algorithm).
struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    fn new() -> LtResult<Self> {
        at("creating the preference", result::create_matmul_pref()).map(Preference)
    }

    fn set<T: Copy>(&self, attr: PrefAttr, value: &T) -> LtResult<()> {
        // SAFETY: the preference is alive (owned by `self`); `value` points to
        // `size_of::<T>()` readable bytes, copied by cuBLASLt before it returns.
        at("setting a preference attribute", unsafe {
            result::set_matmul_pref_attribute(
                self.0,
                attr,
                value as *const T as *const c_void,
                size_of::<T>(),
            )
        })
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by `Preference::new`, destroyed only here.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// Everything one cached matmul needs but its pointers: the descriptors and the algorithm the
/// heuristic chose for them.
#[derive(Debug)]
pub(super) struct Plan {
    desc: MatmulDesc,
    a: LayoutDesc,
    b: LayoutDesc,
    d: LayoutDesc,
    algo: sys::cublasLtMatmulAlgo_t,
    /// Workspace bytes the algorithm needs (at most what the preference allowed).
    pub workspace: usize,
    /// The epilogue (its bias and aux pointers are set before each call).
    epilogue: Epilogue,
}

// SAFETY: the descriptors are host objects usable from any thread; a plan lives in the
// device's cuBLASLt state behind its mutex, so it is never used from two threads at once.
unsafe impl Send for Plan {}

fn op(trans: bool) -> cublasOperation_t {
    if trans {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// Builds the descriptors of `key` and asks the heuristic for the best algorithm within
/// `workspace_limit` bytes of workspace and the key's alignments; `Ok(None)` when cuBLASLt has
/// no algorithm for it. `bias` and `aux` are the bias and aux pointers of the first call: the
/// heuristic reads their alignments from the descriptor (so they are part of the key too).
pub(super) fn create_plan(
    handle: &Handle,
    key: &PlanKey,
    types: &LtTypes,
    workspace_limit: usize,
    bias: Option<u64>,
    aux: Option<u64>,
) -> LtResult<Option<Plan>> {
    let g = &key.gemm;
    let desc = MatmulDesc::new(types)?;
    desc.set(
        DescAttr::CUBLASLT_MATMUL_DESC_TRANSA,
        &op(g.a.trans),
        "setting TRANSA",
    )?;
    desc.set(
        DescAttr::CUBLASLT_MATMUL_DESC_TRANSB,
        &op(g.b.trans),
        "setting TRANSB",
    )?;
    let epilogue = key.epilogue;
    if epilogue != Epilogue::Plain {
        desc.set(
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epilogue.lt(),
            "setting the epilogue",
        )?;
    }
    if epilogue.has_bias() {
        desc.set(
            DescAttr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
            &types.data,
            "setting the bias data type",
        )?;
    }
    set_pointers(&desc, epilogue, bias, aux)?;
    if let Some(ld) = epilogue.aux_ld() {
        desc.set(
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
            &ld,
            "setting the aux leading dimension",
        )?;
    }
    let a = LayoutDesc::new(types, &g.a, g.batch, "creating the layout of A")?;
    let b = LayoutDesc::new(types, &g.b, g.batch, "creating the layout of B")?;
    let d = LayoutDesc::new(types, &g.d, g.batch, "creating the layout of D")?;

    let pref = Preference::new()?;
    pref.set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &(workspace_limit as u64),
    )?;
    let [align_a, align_b, align_d, _bias, _aux] = key.align;
    pref.set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        &align_a,
    )?;
    pref.set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        &align_b,
    )?;
    // C is D (beta is 0 and the same pointer is passed for both).
    pref.set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        &align_d,
    )?;
    pref.set(
        PrefAttr::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        &align_d,
    )?;

    // SAFETY: all-zero bytes are a valid `cublasLtMatmulHeuristicResult_t` (integers, floats
    // and a `cublasStatus_t` whose 0 is CUBLAS_STATUS_SUCCESS); it is only read when cuBLASLt
    // reports having written it.
    let mut found: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
    let mut count: i32 = 0;
    // SAFETY: every descriptor is alive for the call; `found` has room for the 1 result
    // requested and `count` receives how many were written.
    let status = unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle.0, desc.0, a.0, b.0, d.0, d.0, pref.0, 1, &mut found, &mut count,
        )
    };
    match status {
        cublasStatus_t::CUBLAS_STATUS_SUCCESS => {}
        cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED => return Ok(None),
        other => {
            return Err((
                "choosing an algorithm (cublasLtMatmulAlgoGetHeuristic)",
                CublasError(other),
            ))
        }
    }
    if count < 1 {
        return Ok(None);
    }
    at(
        "the heuristic's result (cublasLtMatmulHeuristicResult_t.state)",
        found.state.result(),
    )?;
    Ok(Some(Plan {
        desc,
        a,
        b,
        d,
        algo: found.algo,
        workspace: found.workspaceSize,
        epilogue,
    }))
}

/// Sets the bias and aux pointers `epilogue` reads and writes (0 for one not given).
fn set_pointers(
    desc: &MatmulDesc,
    epilogue: Epilogue,
    bias: Option<u64>,
    aux: Option<u64>,
) -> LtResult<()> {
    if epilogue.has_bias() {
        let ptr: u64 = bias.unwrap_or(0);
        desc.set(
            DescAttr::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &ptr,
            "setting the bias pointer",
        )?;
    }
    if epilogue.aux_ld().is_some() {
        let ptr: u64 = aux.unwrap_or(0);
        desc.set(
            DescAttr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
            &ptr,
            "setting the aux pointer",
        )?;
    }
    Ok(())
}

/// The scale (alpha and beta) type of a plan: f32 for f32/bf16/f16, f64 for f64.
#[derive(Clone, Copy, Debug)]
pub(super) enum Scale {
    /// `CUDA_R_32F` alpha and beta.
    F32,
    /// `CUDA_R_64F` alpha and beta.
    F64,
}

/// The device pointers of one call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pointers {
    /// cuBLASLt's A (the logical right operand's element 0).
    pub a: u64,
    /// cuBLASLt's B (the logical left operand's element 0).
    pub b: u64,
    /// The output (also C).
    pub d: u64,
    /// The bias vector, when the plan's epilogue has one.
    pub bias: Option<u64>,
    /// The auxiliary output (the GELU epilogue's pre-activation), when the plan's epilogue
    /// writes one.
    pub aux: Option<u64>,
    /// The workspace and its size in bytes.
    pub workspace: (u64, usize),
}

impl Plan {
    /// Enqueues `D = A·B` with alpha 1, beta 0 and the plan's epilogue on `stream`.
    ///
    /// # Safety
    /// The pointers must address device buffers of this handle's device holding every element
    /// the plan's layouts reach (the aux buffer: D's size; checked by the caller), and stay
    /// allocated until the stream
    /// has run the call (the caching allocator's stream order does this). The context must be
    /// current on this thread.
    pub unsafe fn run(
        &self,
        handle: &Handle,
        scale: Scale,
        p: &Pointers,
        stream: sys::cudaStream_t,
    ) -> LtResult<()> {
        set_pointers(&self.desc, self.epilogue, p.bias, p.aux)?;
        let (one32, zero32, one64, zero64) = (1f32, 0f32, 1f64, 0f64);
        let (alpha, beta): (*const c_void, *const c_void) = match scale {
            Scale::F32 => (
                &one32 as *const f32 as *const c_void,
                &zero32 as *const f32 as *const c_void,
            ),
            Scale::F64 => (
                &one64 as *const f64 as *const c_void,
                &zero64 as *const f64 as *const c_void,
            ),
        };
        let (ws, ws_bytes) = p.workspace;
        // SAFETY: by this function's contract the pointers are valid for the layouts; alpha and
        // beta are host scalars of the descriptor's scale type (pointer mode host, read before
        // the call returns); the descriptors and the algorithm are alive and were built
        // together; the workspace holds `ws_bytes >= self.workspace` bytes.
        at("cublasLtMatmul", unsafe {
            result::matmul(
                handle.0,
                self.desc.0,
                alpha,
                beta,
                p.a as *const c_void,
                self.a.0,
                p.b as *const c_void,
                self.b.0,
                p.d as *const c_void,
                self.d.0,
                p.d as *mut c_void,
                self.d.0,
                &self.algo,
                ws as *mut c_void,
                ws_bytes,
                stream,
            )
        })
    }
}
