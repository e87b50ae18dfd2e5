//! Backend dispatch: every primitive the tensor ops need, matched on the storage variant. This is
//! the only place that knows which backends exist; a new backend adds its arms here.

use crate::cpu_backend::{self as cpu, attention, fused, indexing, llama, math};
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Layout, Result};
use meshgrad_kernels::ops::{
    AttentionShape, BiasLayout, BinaryOp, CmpOp, MatrixLayout, ReduceOp, UnaryGrad, UnaryOp,
};

/// A storage with the layout of the view being read.
pub(crate) type Src<'a> = (&'a Storage, &'a Layout);

fn c(s: &Storage) -> &CpuStorage {
    match s {
        Storage::Cpu(c) => c,
    }
}

fn c_mut(s: &mut Storage) -> &mut CpuStorage {
    match s {
        Storage::Cpu(c) => c,
    }
}

fn cs<'a>(s: Src<'a>) -> (&'a CpuStorage, &'a Layout) {
    (c(s.0), s.1)
}

pub(crate) fn cast(s: &Storage, l: &Layout, dtype: DType) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::cast(c(s), l, dtype)?))
}

pub(crate) fn copy_contiguous(s: &Storage, l: &Layout) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::copy_contiguous(c(s), l)?))
}

pub(crate) fn copy_into(dst: &mut Storage, dl: &Layout, src: Src<'_>) -> Result<()> {
    cpu::copy_into(c_mut(dst), dl, c(src.0), src.1)
}

pub(crate) fn add_assign_contiguous(dst: &mut Storage, dl: &Layout, src: Src<'_>) -> Result<bool> {
    cpu::add_assign_contiguous(c_mut(dst), dl, c(src.0), src.1)
}

pub(crate) fn unary(s: Src<'_>, op: UnaryOp) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::unary(c(s.0), s.1, op)?))
}

pub(crate) fn binary(op: BinaryOp, a: Src<'_>, b: Src<'_>) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::binary(op, c(a.0), a.1, c(b.0), b.1)?))
}

pub(crate) fn compare(op: CmpOp, a: Src<'_>, b: Src<'_>) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::compare(op, c(a.0), a.1, c(b.0), b.1)?))
}

pub(crate) fn where_cond(cond: Src<'_>, t: Src<'_>, f: Src<'_>) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::where_cond(
        c(cond.0),
        cond.1,
        c(t.0),
        t.1,
        c(f.0),
        f.1,
    )?))
}

pub(crate) fn reduce(
    op: ReduceOp,
    s: Src<'_>,
    outer: usize,
    red: usize,
    inner: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::reduce(
        op,
        c(s.0),
        s.1,
        outer,
        red,
        inner,
    )?))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    a: &Storage,
    al: MatrixLayout,
    b: &Storage,
    bl: MatrixLayout,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::matmul(
        c(a),
        al,
        c(b),
        bl,
        batch,
        m,
        n,
        k,
    )?))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &Storage,
    xl: MatrixLayout,
    w: &Storage,
    wl: MatrixLayout,
    bias: Option<Src<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(fused::linear(
        c(x),
        xl,
        c(w),
        wl,
        bias.map(cs),
        m,
        n,
        k,
    )?))
}

pub(crate) fn softmax(s: Src<'_>, rows: usize, cols: usize, log: bool) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::softmax(c(s.0), s.1, rows, cols, log)?))
}

pub(crate) fn softmax_backward(
    y: Src<'_>,
    dy: Src<'_>,
    rows: usize,
    cols: usize,
    log: bool,
) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::softmax_backward(
        c(y.0),
        y.1,
        c(dy.0),
        dy.1,
        rows,
        cols,
        log,
    )?))
}

pub(crate) fn gelu_backward(x: Src<'_>, dy: Src<'_>, tanh_form: bool) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::gelu_backward(
        c(x.0),
        x.1,
        c(dy.0),
        dy.1,
        tanh_form,
    )?))
}

pub(crate) fn embedding(w: Src<'_>, ids: Src<'_>, vocab: usize, dim: usize) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::embedding(
        c(w.0),
        w.1,
        c(ids.0),
        ids.1,
        vocab,
        dim,
    )?))
}

pub(crate) fn embedding_backward(
    dout: Src<'_>,
    ids: Src<'_>,
    vocab: usize,
    dim: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(cpu::embedding_backward(
        c(dout.0),
        dout.1,
        c(ids.0),
        ids.1,
        vocab,
        dim,
    )?))
}

pub(crate) fn layer_norm(
    x: Src<'_>,
    w: Option<Src<'_>>,
    b: Option<Src<'_>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(Storage, Storage, Storage)> {
    let (y, m, r) = fused::layer_norm(cs(x), w.map(cs), b.map(cs), rows, cols, eps)?;
    Ok((Storage::Cpu(y), Storage::Cpu(m), Storage::Cpu(r)))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    x: Src<'_>,
    w: Option<Src<'_>>,
    mean: Src<'_>,
    rstd: Src<'_>,
    dy: Src<'_>,
    rows: usize,
    cols: usize,
    param_grads: bool,
) -> Result<(Storage, Option<Storage>, Option<Storage>)> {
    let (dx, dw, db) = fused::layer_norm_backward(
        cs(x),
        w.map(cs),
        cs(mean),
        cs(rstd),
        cs(dy),
        rows,
        cols,
        param_grads,
    )?;
    Ok((Storage::Cpu(dx), dw.map(Storage::Cpu), db.map(Storage::Cpu)))
}

/// The key padding mask and additive bias of one attention call, as the backend sees them:
/// `heads` heads per batch entry index both; the padding mask is a contiguous integer
/// `[batch, seq_k]` tensor, the bias a contiguous float tensor in q's dtype read through
/// `BiasLayout` (strides 0 where it broadcasts).
pub(crate) struct AttentionMaskArgs<'a> {
    pub heads: usize,
    pub key_padding: Option<Src<'a>>,
    pub bias: Option<(Src<'a>, BiasLayout)>,
}

fn cpu_mask<'a>(m: &AttentionMaskArgs<'a>) -> attention::CpuMask<'a> {
    attention::CpuMask {
        heads: m.heads,
        key_padding: m.key_padding.map(cs),
        bias: m.bias.map(|(s, l)| (cs(s), l)),
    }
}

pub(crate) fn attention(
    q: Src<'_>,
    k: Src<'_>,
    v: Src<'_>,
    shape: AttentionShape,
    mask: &AttentionMaskArgs<'_>,
) -> Result<(Storage, Storage)> {
    let (o, l) = attention::attention(cs(q), cs(k), cs(v), shape, &cpu_mask(mask))?;
    Ok((Storage::Cpu(o), Storage::Cpu(l)))
}

/// Returns `(dq, dk, dv, dz)`; `dz` (the `[batch_heads, seq_q, seq_k]` gradient of the softmax
/// inputs, compute precision) when `want_dz`.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn attention_backward(
    q: Src<'_>,
    k: Src<'_>,
    v: Src<'_>,
    out: Src<'_>,
    lse: Src<'_>,
    dout: Src<'_>,
    shape: AttentionShape,
    mask: &AttentionMaskArgs<'_>,
    want_dz: bool,
) -> Result<(Storage, Storage, Storage, Option<Storage>)> {
    let (dq, dk, dv, dz) = attention::attention_backward(
        [cs(q), cs(k), cs(v), cs(out), cs(lse), cs(dout)],
        shape,
        &cpu_mask(mask),
        want_dz,
    )?;
    Ok((
        Storage::Cpu(dq),
        Storage::Cpu(dk),
        Storage::Cpu(dv),
        dz.map(Storage::Cpu),
    ))
}

pub(crate) fn attention_qkv(
    qkv: Src<'_>,
    shape: AttentionShape,
    heads: usize,
    mask: &AttentionMaskArgs<'_>,
) -> Result<(Storage, Storage)> {
    let (o, l) = attention::attention_qkv(cs(qkv), shape, heads, &cpu_mask(mask))?;
    Ok((Storage::Cpu(o), Storage::Cpu(l)))
}

/// Returns `(dqkv, dz)` (see [`attention_backward`] for `dz`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_qkv_backward(
    qkv: Src<'_>,
    out: Src<'_>,
    lse: Src<'_>,
    dout: Src<'_>,
    shape: AttentionShape,
    heads: usize,
    mask: &AttentionMaskArgs<'_>,
    want_dz: bool,
) -> Result<(Storage, Option<Storage>)> {
    let (g, dz) = attention::attention_qkv_backward(
        [cs(qkv), cs(out), cs(lse), cs(dout)],
        shape,
        heads,
        &cpu_mask(mask),
        want_dz,
    )?;
    Ok((Storage::Cpu(g), dz.map(Storage::Cpu)))
}

pub(crate) fn rms_norm(
    x: Src<'_>,
    w: Option<Src<'_>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(Storage, Storage)> {
    let (y, r) = llama::rms_norm(cs(x), w.map(cs), rows, cols, eps)?;
    Ok((Storage::Cpu(y), Storage::Cpu(r)))
}

pub(crate) fn rms_norm_backward(
    x: Src<'_>,
    w: Option<Src<'_>>,
    rstd: Src<'_>,
    dy: Src<'_>,
    rows: usize,
    cols: usize,
    weight_grad: bool,
) -> Result<(Storage, Option<Storage>)> {
    let (dx, dw) =
        llama::rms_norm_backward(cs(x), w.map(cs), cs(rstd), cs(dy), rows, cols, weight_grad)?;
    Ok((Storage::Cpu(dx), dw.map(Storage::Cpu)))
}

pub(crate) fn rotary_embedding(
    x: Src<'_>,
    positions: Src<'_>,
    dims: [usize; 4],
    theta: f64,
    inverse: bool,
) -> Result<Storage> {
    Ok(Storage::Cpu(llama::rotary_embedding(
        cs(x),
        cs(positions),
        dims,
        theta,
        inverse,
    )?))
}

pub(crate) fn swiglu(gate: Src<'_>, up: Src<'_>) -> Result<Storage> {
    Ok(Storage::Cpu(llama::swiglu(cs(gate), cs(up))?))
}

pub(crate) fn swiglu_backward(
    gate: Src<'_>,
    up: Src<'_>,
    dy: Src<'_>,
) -> Result<(Storage, Storage)> {
    let (dg, du) = llama::swiglu_backward(cs(gate), cs(up), cs(dy))?;
    Ok((Storage::Cpu(dg), Storage::Cpu(du)))
}

pub(crate) fn cross_entropy(
    logits: Src<'_>,
    targets: Src<'_>,
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Result<(Storage, Storage)> {
    let (l, s) = fused::cross_entropy(cs(logits), cs(targets), rows, cols, ignore_index)?;
    Ok((Storage::Cpu(l), Storage::Cpu(s)))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    logits: Src<'_>,
    lse: Src<'_>,
    targets: Src<'_>,
    dloss: Src<'_>,
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Result<Storage> {
    Ok(Storage::Cpu(fused::cross_entropy_backward(
        cs(logits),
        cs(lse),
        cs(targets),
        cs(dloss),
        rows,
        cols,
        ignore_index,
    )?))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    param: &mut Storage,
    pl: &Layout,
    grad: Src<'_>,
    m: &mut Storage,
    ml: &Layout,
    v: &mut Storage,
    vl: &Layout,
    hp: &meshgrad_kernels::ops::AdamWStep,
) -> Result<()> {
    fused::adamw(c_mut(param), pl, cs(grad), c_mut(m), ml, c_mut(v), vl, hp)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd(
    param: &mut Storage,
    pl: &Layout,
    grad: Src<'_>,
    buf: &mut Storage,
    bl: &Layout,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
) -> Result<()> {
    fused::sgd(
        c_mut(param),
        pl,
        cs(grad),
        c_mut(buf),
        bl,
        lr,
        momentum,
        weight_decay,
        first_step,
    )
}

pub(crate) fn unary_backward(x: Src<'_>, dy: Src<'_>, op: UnaryGrad) -> Result<Storage> {
    Ok(Storage::Cpu(math::unary_backward(
        c(x.0),
        x.1,
        c(dy.0),
        dy.1,
        op,
    )?))
}

pub(crate) fn logsumexp(s: Src<'_>, outer: usize, red: usize, inner: usize) -> Result<Storage> {
    Ok(Storage::Cpu(math::logsumexp(
        c(s.0),
        s.1,
        outer,
        red,
        inner,
    )?))
}

pub(crate) fn gather(x: Src<'_>, index: Src<'_>, dim: usize) -> Result<Storage> {
    Ok(Storage::Cpu(indexing::gather(
        c(x.0),
        x.1,
        c(index.0),
        index.1,
        dim,
    )?))
}

pub(crate) fn gather_backward(
    dout: Src<'_>,
    index: Src<'_>,
    x_dims: &[usize],
    dim: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(indexing::gather_backward(
        c(dout.0),
        dout.1,
        c(index.0),
        index.1,
        x_dims,
        dim,
    )?))
}

pub(crate) fn index_select(
    x: Src<'_>,
    ids: Src<'_>,
    outer: usize,
    x_n: usize,
    inner: usize,
    dim: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(indexing::index_select(
        c(x.0),
        x.1,
        c(ids.0),
        ids.1,
        outer,
        x_n,
        inner,
        dim,
    )?))
}

pub(crate) fn index_select_backward(
    dout: Src<'_>,
    ids: Src<'_>,
    outer: usize,
    x_n: usize,
    inner: usize,
    dim: usize,
) -> Result<Storage> {
    Ok(Storage::Cpu(indexing::index_select_backward(
        c(dout.0),
        dout.1,
        c(ids.0),
        ids.1,
        outer,
        x_n,
        inner,
        dim,
    )?))
}
