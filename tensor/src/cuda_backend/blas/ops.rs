//! `matmul`, `linear` and `linear_gelu` of the CUDA backend: checks, copies of operands
//! cuBLASLt cannot read in place, the output buffers, and one cuBLASLt call (see `layout.rs`
//! for the mapping and the epilogues, `state.rs` for the cached plans).

use std::fmt;
use std::sync::Arc;

use cudarc::driver::result as driver;
use meshgrad_kernels::ops::MatrixLayout;

use super::layout::{
    alignment, epilogue_for, extent, gemm, lhs_operand, lt_types, operand_alignment,
    output_operand, packed_copy, rhs_operand, PlanKey, BIAS_ALIGNMENT,
};
use super::state::{with_blaslt, Call};
use crate::backend::api::{In, Product};
use crate::cuda_backend::{basic, CudaStorage, DeviceContext};
use crate::{DType, Error, Layout, Result, Shape};

/// The op and its logical sizes, for error messages.
struct What {
    op: &'static str,
    dtype: DType,
    p: Product,
}

impl fmt::Display for What {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Product {
            al,
            bl,
            batch,
            m,
            n,
            k,
        } = self.p;
        write!(
            f,
            "{} ({:?}, batch {batch} of [{m}, {k}] x [{k}, {n}]; lhs {al:?}, rhs {bl:?})",
            self.op, self.dtype
        )
    }
}

impl What {
    /// The description of `op` on `a` and `b` (their shared dtype checked, see
    /// [`operand_dtype`]) for the product `p`, and the output's element count.
    fn new(
        op: &'static str,
        a: &CudaStorage,
        b: &CudaStorage,
        p: &Product,
    ) -> Result<(Self, usize)> {
        let dtype = operand_dtype(op, a, b)?;
        let what = What { op, dtype, p: *p };
        let len = p
            .batch
            .checked_mul(p.m)
            .and_then(|x| x.checked_mul(p.n))
            .ok_or_else(|| Error::Msg(format!("{what}: the output size overflows")))?;
        Ok((what, len))
    }
}

/// The dtype shared by the operands, when cuBLASLt takes it.
fn operand_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<DType> {
    if a.dtype() != b.dtype() {
        return Err(Error::Msg(format!(
            "{op}: operands of dtypes {:?} and {:?} on {}",
            a.dtype(),
            b.dtype(),
            a.device()
        )));
    }
    if lt_types(a.dtype()).is_none() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: a.dtype(),
        });
    }
    Ok(a.dtype())
}

/// Refuses a layout that reaches past its buffer (cuBLASLt would read out of bounds).
fn check_fits(
    what: &What,
    name: &str,
    s: &CudaStorage,
    l: &MatrixLayout,
    batch: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    match extent(l, batch, rows, cols) {
        Some(e) if e <= s.len() => Ok(()),
        e => Err(Error::Msg(format!(
            "{what}: the {name} layout reaches element {e:?} of a buffer of {}",
            s.len()
        ))),
    }
}

/// A contiguous copy of `batch` matrices of `rows×cols` read through `l`, and its layout.
fn pack(
    s: &CudaStorage,
    l: &MatrixLayout,
    batch: usize,
    rows: usize,
    cols: usize,
) -> Result<(CudaStorage, MatrixLayout)> {
    let c = packed_copy(l, batch, rows, cols);
    let view = Layout::new(Shape::from(c.dims), c.strides, c.offset);
    Ok((basic::copy_contiguous(s, &view)?, c.packed))
}

/// An operand as cuBLASLt will read it: borrowed in place or a packed copy.
struct Prepared<'a> {
    copy: Option<CudaStorage>,
    orig: &'a CudaStorage,
    layout: MatrixLayout,
}

impl Prepared<'_> {
    fn storage(&self) -> &CudaStorage {
        self.copy.as_ref().unwrap_or(self.orig)
    }
}

/// `s` read through `l` in place when `readable` says cuBLASLt can (and no copy is forced),
/// else packed.
fn prepare<'a>(
    s: &'a CudaStorage,
    l: MatrixLayout,
    batch: usize,
    rows: usize,
    cols: usize,
    readable: bool,
    force_copy: bool,
) -> Result<Prepared<'a>> {
    if readable && !force_copy {
        return Ok(Prepared {
            copy: None,
            orig: s,
            layout: l,
        });
    }
    let (copy, layout) = pack(s, &l, batch, rows, cols)?;
    Ok(Prepared {
        copy: Some(copy),
        orig: s,
        layout,
    })
}

/// What [`product`] did.
enum Outcome {
    /// The matmul was enqueued.
    Ran,
    /// cuBLASLt has no algorithm for it (nothing enqueued); the alignments its operands A and B
    /// were given.
    NoAlgorithm([u32; 2]),
}

/// What a product does besides `a · b`: add a bias (its device pointer), and apply GELU (tanh)
/// writing the pre-activation to a buffer the size of the output (its device pointer).
#[derive(Clone, Copy, Debug, Default)]
struct Extras {
    bias: Option<u64>,
    gelu_aux: Option<u64>,
}

/// Enqueues `out = a · b` with the `extras` for the checked operands (packing both first when
/// `force_copy`).
fn product(
    ctx: &Arc<DeviceContext>,
    what: &What,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    extras: Extras,
    force_copy: bool,
) -> Result<Outcome> {
    let Product {
        al,
        bl,
        batch,
        m,
        n,
        k,
    } = what.p;
    let internal = |side: &str| {
        Error::Msg(format!(
            "{what}: the packed {side} operand has no cuBLASLt layout (a bug in the mapping)"
        ))
    };
    let lhs_ok = lhs_operand(&al, batch, m, k).is_some();
    let rhs_ok = rhs_operand(&bl, batch, k, n).is_some();
    let pa = prepare(a, al, batch, m, k, lhs_ok, force_copy)?;
    let pb = prepare(b, bl, batch, k, n, rhs_ok, force_copy)?;
    let lhs = lhs_operand(&pa.layout, batch, m, k).ok_or_else(|| internal("left"))?;
    let rhs = rhs_operand(&pb.layout, batch, k, n).ok_or_else(|| internal("right"))?;
    let g = gemm(lhs, rhs, batch, m, n, k).map_err(|e| Error::Msg(format!("{what}: {e}")))?;
    let bias = extras.bias;
    let gelu = extras.gelu_aux.is_some();
    let epilogue = epilogue_for(&g.d, batch, bias.is_some(), gelu).ok_or_else(|| {
        Error::Msg(format!(
            "{what}: the GELU epilogue was asked for an output it cannot write (a bug in the \
             caller's check)"
        ))
    })?;
    // cuBLASLt's A is the logical right operand, its B the logical left one.
    let a_ptr = pb.storage().ptr_at(pb.layout.offset);
    let b_ptr = pa.storage().ptr_at(pa.layout.offset);
    let d_ptr = out.device_ptr();
    let eb = what.dtype.size_in_bytes();
    let align = [
        operand_alignment(a_ptr, &g.a, g.batch, eb),
        operand_alignment(b_ptr, &g.b, g.batch, eb),
        operand_alignment(d_ptr, &g.d, g.batch, eb),
        bias.map_or(0, alignment),
        extras.gelu_aux.map_or(0, alignment),
    ];
    let call = Call {
        key: PlanKey {
            dtype: what.dtype,
            epilogue,
            gemm: g,
            align,
        },
        a: a_ptr,
        b: b_ptr,
        d: d_ptr,
        bias,
        aux: extras.gelu_aux,
        what,
    };
    // The copies (if any) are dropped on return: their blocks are reused only after the stream
    // has run the matmul.
    let ran = with_blaslt(ctx, |lt| lt.matmul(ctx, &call))?;
    Ok(if ran {
        Outcome::Ran
    } else {
        Outcome::NoAlgorithm([align[0], align[1]])
    })
}

/// Runs the product in place, and once more on packed copies when cuBLASLt had no algorithm
/// for operands less than 16-byte aligned (fresh copies start 256-byte aligned). `Ok(false)`
/// when neither ran.
fn product_or_packed(
    ctx: &Arc<DeviceContext>,
    what: &What,
    a: &CudaStorage,
    b: &CudaStorage,
    out: &CudaStorage,
    extras: Extras,
) -> Result<bool> {
    match product(ctx, what, a, b, out, extras, false)? {
        Outcome::Ran => Ok(true),
        Outcome::NoAlgorithm(align) if align.iter().any(|&x| x < 16) => Ok(matches!(
            product(ctx, what, a, b, out, extras, true)?,
            Outcome::Ran
        )),
        Outcome::NoAlgorithm(_) => Ok(false),
    }
}

/// See `BackendStorage::matmul`.
pub(in crate::cuda_backend) fn matmul(
    a: &CudaStorage,
    b: &CudaStorage,
    p: &Product,
) -> Result<CudaStorage> {
    let (al, bl, batch, m, n, k) = (p.al, p.bl, p.batch, p.m, p.n, p.k);
    let (what, len) = What::new("matmul", a, b, p)?;
    let dtype = what.dtype;
    let ctx = a.ctx().clone();
    if len == 0 {
        return CudaStorage::uninit(&ctx, dtype, 0);
    }
    if k == 0 {
        return basic::zeros(a.device(), dtype, len);
    }
    check_fits(&what, "left", a, &al, batch, m, k)?;
    check_fits(&what, "right", b, &bl, batch, k, n)?;
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    if product_or_packed(&ctx, &what, a, b, &out, Extras::default())? {
        Ok(out)
    } else {
        Err(Error::Cuda {
            device: a.device(),
            message: format!("{what}: cuBLASLt has no algorithm for this product"),
        })
    }
}

/// A bias pointer cuBLASLt's epilogue can read: the contiguous `[n]` view `bl` of `s`, copied
/// to a fresh buffer when it is less than [`BIAS_ALIGNMENT`]-byte aligned. `Ok(None)` when the
/// view is not a contiguous `[n]` (the tensor layer then composes the op).
fn bias_pointer(
    ctx: &Arc<DeviceContext>,
    what: &What,
    s: &CudaStorage,
    bl: &Layout,
    n: usize,
) -> Result<Option<(u64, Option<CudaStorage>)>> {
    if s.dtype() != what.dtype {
        return Err(Error::Msg(format!("{what}: the bias is {:?}", s.dtype())));
    }
    let Some(range) = bl.contiguous_range() else {
        return Ok(None);
    };
    if range.len() != n || range.end > s.len() {
        return Ok(None);
    }
    let ptr = s.ptr_at(range.start);
    if alignment(ptr) >= BIAS_ALIGNMENT {
        return Ok(Some((ptr, None)));
    }
    let copy = CudaStorage::uninit(ctx, what.dtype, n)?;
    ctx.bind()?;
    // SAFETY: `copy` holds `n` elements and `s` holds `n` elements from `range.start` (checked
    // just above); the copy is ordered on the compute stream before the matmul reading it.
    unsafe {
        driver::memcpy_dtod_async(
            copy.device_ptr(),
            ptr,
            n * what.dtype.size_in_bytes(),
            ctx.stream.cu_stream(),
        )
    }
    .map_err(|e| ctx.err(&format!("{what}: copying the bias to an aligned buffer"), e))?;
    Ok(Some((copy.device_ptr(), Some(copy))))
}

/// The fused linear layer (`ops/fused/linear`): `x · wᵀ + bias` where `p.bl` already reads
/// `wᵀ` (`k×n`) through the weight's strides (`p.batch` is 1). With a bias: one cuBLASLt call
/// with the bias epilogue; `Ok(None)` when cuBLASLt has no algorithm with that epilogue (or
/// `k == 0`), and the tensor layer composes it.
pub(crate) fn linear(
    x: &CudaStorage,
    w: &CudaStorage,
    bias: Option<In<'_, CudaStorage>>,
    p: &Product,
) -> Result<Option<CudaStorage>> {
    let Some((bs, bl)) = bias else {
        return matmul(x, w, p).map(Some);
    };
    let (al, wl, m, n, k) = (p.al, p.bl, p.m, p.n, p.k);
    let (what, len) = What::new("linear", x, w, p)?;
    let dtype = what.dtype;
    let ctx = x.ctx().clone();
    if len == 0 {
        return CudaStorage::uninit(&ctx, dtype, 0).map(Some);
    }
    if k == 0 {
        return Ok(None);
    }
    check_fits(&what, "input", x, &al, 1, m, k)?;
    check_fits(&what, "weight", w, &wl, 1, k, n)?;
    let Some((bias_ptr, _bias_copy)) = bias_pointer(&ctx, &what, bs, bl, n)? else {
        return Ok(None);
    };
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    let extras = Extras {
        bias: Some(bias_ptr),
        gelu_aux: None,
    };
    if product_or_packed(&ctx, &what, x, w, &out, extras)? {
        Ok(Some(out))
    } else {
        Ok(None)
    }
}

/// The fused linear layer with the GELU epilogue (`ops/fused/linear`):
/// `(gelu(x · wᵀ + bias), x · wᵀ + bias)` in one cuBLASLt call with the `GELU_AUX(_BIAS)`
/// epilogue, which writes the activation to D and the pre-activation to the aux buffer.
/// `Ok(None)` (the tensor layer composes `linear` and `gelu`) for the erf form (cuBLASLt's GELU
/// is the tanh approximation), for f64 (not attempted), when the output width is not a multiple
/// of 8 (cuBLASLt's rule for the aux leading dimension), for a bias that is not a contiguous
/// `[n]`, for `k == 0` or an empty output, and when cuBLASLt has no algorithm with the epilogue.
pub(crate) fn linear_gelu(
    x: &CudaStorage,
    w: &CudaStorage,
    bias: Option<In<'_, CudaStorage>>,
    p: &Product,
    tanh_form: bool,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let (what, len) = What::new("linear_gelu", x, w, p)?;
    let dtype = what.dtype;
    if !tanh_form || dtype == DType::F64 {
        return Ok(None);
    }
    let (al, wl, m, n, k) = (p.al, p.bl, p.m, p.n, p.k);
    if len == 0
        || k == 0
        || epilogue_for(&output_operand(1, m, n), 1, bias.is_some(), true).is_none()
    {
        return Ok(None);
    }
    let ctx = x.ctx().clone();
    check_fits(&what, "input", x, &al, 1, m, k)?;
    check_fits(&what, "weight", w, &wl, 1, k, n)?;
    // The bias (copied when misaligned; the copy lives until the call is enqueued).
    let (bias_ptr, _bias_copy) = match bias {
        None => (None, None),
        Some((bs, bl)) => match bias_pointer(&ctx, &what, bs, bl, n)? {
            Some((ptr, copy)) => (Some(ptr), copy),
            None => return Ok(None),
        },
    };
    let out = CudaStorage::uninit(&ctx, dtype, len)?;
    let pre = CudaStorage::uninit(&ctx, dtype, len)?;
    let extras = Extras {
        bias: bias_ptr,
        gelu_aux: Some(pre.device_ptr()),
    };
    if product_or_packed(&ctx, &what, x, w, &out, extras)? {
        Ok(Some((out, pre)))
    } else {
        Ok(None)
    }
}
