//! Attention on CUDA, forward and backward (attention.cu), on separate q, k, v buffers or
//! straight from a fused `[B, T, 3C]` qkv projection.
//!
//! Provided: f32, bf16 and f16 (computed in f32), head dims 64 and 128, causal masking and a key
//! padding mask (integer `[batch, seq_k]`, nonzero = attend; a u32 / i64 mask is turned into u8
//! 0/1 on the host, a round trip that waits for the stream: pass u8 masks on CUDA).
//!
//! `Ok(None)` (not provided: the composed fallback runs) for an additive score bias, other head dims, f64, and a backward that must
//! return `dz` (the `[batch_heads, seq_q, seq_k]` score gradient the bias gradient needs: the
//! kernels never form it).
//!
//! `lse` is f32 `[batch_heads, seq_q]` (as the CPU returns it); a row that sees no key gets out 0
//! and lse -inf. Backward order (attention.cu's header): `attn_bwd_delta` (delta = dout·out per
//! query row), then `attn_bwd_dq` and `attn_bwd_dkdv`, which overwrite dq, dk, dv. Batch-heads
//! beyond the grid's y limit (65535) are split over several launches (`params::bh_chunks`).

pub(crate) mod params;
#[cfg(test)]
mod tests;

use meshgrad_kernels::cuda::AttnParams;
use meshgrad_kernels::ops::AttentionShape;

use self::params::{
    bh_chunks, chunk_params, delta_launch, dkdv_launch, dq_launch, fwd_launch, mask_offset,
    qkv_params, row_offset, separate_params, HEAD_DIMS, MAX_GRID_Y,
};
use super::{Attention, AttentionBackward, AttentionQkv, AttentionQkvBackward, Grads, MaskArgs};
use crate::cuda_backend::fused::args::sfx;
use crate::cuda_backend::fused::operand::{
    as_dtype, check_len, mask_u8, output, ptr_or_null, Operand,
};
use crate::cuda_backend::{CudaStorage, DeviceContext};
use crate::ops::fused::CudaIn;
use crate::{DType, Error, Result};

/// The kernel dtype suffix for a call, or `None` when the kernels do not cover it.
fn covered(
    dt: DType,
    shape: &AttentionShape,
    mask: &MaskArgs<'_, CudaStorage>,
    want_dz: bool,
) -> Option<&'static str> {
    if mask.bias.is_some() || want_dz || !HEAD_DIMS.contains(&shape.head_dim) {
        return None;
    }
    sfx(dt)
}

/// The call described for error messages.
fn describe(op: &str, dt: DType, shape: &AttentionShape, has_mask: bool) -> String {
    format!(
        "{op} ({dt:?}, batch_heads {}, seq_q {}, seq_k {}, head_dim {}, causal {}, key padding {has_mask})",
        shape.batch_heads, shape.seq_q, shape.seq_k, shape.head_dim, shape.causal
    )
}

/// The key padding mask as a u8 operand, checked to be `[batch_heads / mask.heads, seq_k]`.
fn key_padding<'a>(
    op: &'static str,
    mask: &MaskArgs<'a, CudaStorage>,
    shape: &AttentionShape,
) -> Result<Option<Operand<'a>>> {
    let Some(kp) = mask.key_padding else {
        return Ok(None);
    };
    let h = mask.heads;
    if h == 0 || !shape.batch_heads.is_multiple_of(h) {
        return Err(Error::Msg(format!(
            "{op} (CUDA): {h} mask heads do not divide {} batch-heads",
            shape.batch_heads
        )));
    }
    check_len(op, "key_padding", kp.1, shape.batch_heads / h * shape.seq_k)?;
    mask_u8(kp, "attention (key padding mask)").map(Some)
}

/// Heads per batch entry of the key padding mask (1 without a mask: then the mask's `heads`
/// constrains nothing, in particular not the split of the batch-heads over launches).
fn mask_heads(mask: &MaskArgs<'_, CudaStorage>) -> usize {
    if mask.key_padding.is_some() {
        mask.heads
    } else {
        1
    }
}

/// The batch-head ranges of the tiled launches of `p`.
fn chunks(op: &str, p: &AttnParams) -> Result<Vec<(usize, usize)>> {
    bh_chunks(
        p.batch_heads as usize,
        p.heads as usize,
        p.mask_heads as usize,
        MAX_GRID_Y,
    )
    .ok_or_else(|| {
        Error::Msg(format!(
            "{op} (CUDA): {} heads / {} mask heads per batch entry exceed the grid's {MAX_GRID_Y} \
             y blocks",
            p.heads, p.mask_heads
        ))
    })
}

/// Base addresses of one kernel family's operands.
struct Ptrs {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    lse: u64,
    kp: u64,
}

/// Runs the forward kernels over every batch-head chunk.
fn run_forward(
    ctx: &DeviceContext,
    t: &str,
    head_dim: usize,
    p: &AttnParams,
    b: &Ptrs,
    what: &dyn Fn() -> String,
) -> Result<()> {
    if p.batch_heads == 0 || p.seq_q == 0 {
        return Ok(());
    }
    for (first, count) in chunks("attention", p)? {
        let cp = chunk_params(p, first, count);
        let kp = if b.kp == 0 {
            0
        } else {
            b.kp + mask_offset(p, first) as u64
        };
        let lse = b.lse + 4 * row_offset(p, first) as u64;
        fwd_launch(t, head_dim, [b.q, b.k, b.v, b.out, lse, kp], &cp).run(ctx, what)?;
    }
    Ok(())
}

/// Runs the backward kernels: delta over every row, then dq and dk/dv over every batch-head
/// chunk. `dout` and the gradients' bases follow `p`'s layouts 4..8.
fn run_backward(
    ctx: &DeviceContext,
    t: &str,
    head_dim: usize,
    p: &AttnParams,
    b: &Ptrs,
    [dout, delta, dq, dk, dv]: [u64; 5],
    what: &dyn Fn() -> String,
) -> Result<()> {
    if p.batch_heads == 0 {
        return Ok(());
    }
    if p.seq_q > 0 {
        delta_launch(t, head_dim, [b.out, dout, delta], p).run(ctx, what)?;
    }
    for (first, count) in chunks("attention_backward", p)? {
        let cp = chunk_params(p, first, count);
        let kp = if b.kp == 0 {
            0
        } else {
            b.kp + mask_offset(p, first) as u64
        };
        let rows = 4 * row_offset(p, first) as u64;
        let (lse, dl) = (b.lse + rows, delta + rows);
        if p.seq_q > 0 {
            let ptrs = [b.q, b.k, b.v, dout, lse, dl, dq, kp];
            dq_launch(t, head_dim, ptrs, &cp).run(ctx, what)?;
        }
        if p.seq_k > 0 {
            let ptrs = [b.q, b.k, b.v, dout, lse, dl, dk, dv, kp];
            dkdv_launch(t, head_dim, ptrs, &cp).run(ctx, what)?;
        }
    }
    Ok(())
}

/// See [`Attention`]: `(out [batch_heads, seq_q, head_dim] in q's dtype, lse f32
/// [batch_heads, seq_q])`. `Ok(None)` for what the kernels do not cover (module docs).
pub(super) fn forward(a: &Attention<CudaIn<'_>>) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let (q, k, v, shape) = (a.q, a.k, a.v, a.shape);
    let mask = a.mask.args();
    let dt = q.0.dtype();
    let Some(t) = covered(dt, &shape, &mask, false) else {
        return Ok(None);
    };
    let op = "attention";
    let (bh, d) = (shape.batch_heads, shape.head_dim);
    check_len(op, "q", q.1, bh * shape.seq_q * d)?;
    check_len(op, "k", k.1, bh * shape.seq_k * d)?;
    check_len(op, "v", v.1, bh * shape.seq_k * d)?;
    let (qo, ko, vo) = (as_dtype(q, dt)?, as_dtype(k, dt)?, as_dtype(v, dt)?);
    let kp = key_padding(op, &mask, &shape)?;
    let ctx = q.0.ctx();
    let out = output(ctx, dt, bh * shape.seq_q * d)?;
    let lse = output(ctx, DType::F32, bh * shape.seq_q)?;
    let p = separate_params(&shape, mask_heads(&mask));
    let b = Ptrs {
        q: qo.ptr(),
        k: ko.ptr(),
        v: vo.ptr(),
        out: out.device_ptr(),
        lse: lse.device_ptr(),
        kp: ptr_or_null(&kp),
    };
    run_forward(ctx, t, d, &p, &b, &|| {
        describe(op, dt, &shape, kp.is_some())
    })?;
    Ok(Some((out, lse)))
}

/// See [`AttentionBackward`]: `(dq, dk, dv, None)` in q's dtype. `Ok(None)` for what the
/// kernels do not cover, `want_dz` included.
pub(super) fn backward(a: &AttentionBackward<CudaIn<'_>>) -> Result<Option<Grads<CudaStorage>>> {
    let (q, k, v, out, lse, dout) = (a.q, a.k, a.v, a.out, a.lse, a.dout);
    let (shape, want_dz, mask) = (a.shape, a.want_dz, a.mask.args());
    let dt = q.0.dtype();
    let Some(t) = covered(dt, &shape, &mask, want_dz) else {
        return Ok(None);
    };
    let op = "attention_backward";
    let (bh, d) = (shape.batch_heads, shape.head_dim);
    let (nq, nk) = (bh * shape.seq_q * d, bh * shape.seq_k * d);
    for (name, x, n) in [
        ("q", q, nq),
        ("k", k, nk),
        ("v", v, nk),
        ("out", out, nq),
        ("lse", lse, bh * shape.seq_q),
        ("dout", dout, nq),
    ] {
        check_len(op, name, x.1, n)?;
    }
    let (qo, ko, vo) = (as_dtype(q, dt)?, as_dtype(k, dt)?, as_dtype(v, dt)?);
    let (oo, go) = (as_dtype(out, dt)?, as_dtype(dout, dt)?);
    let lo = as_dtype(lse, DType::F32)?;
    let kp = key_padding(op, &mask, &shape)?;
    let ctx = q.0.ctx();
    let (dq, dk, dv) = (
        output(ctx, dt, nq)?,
        output(ctx, dt, nk)?,
        output(ctx, dt, nk)?,
    );
    let delta = output(ctx, DType::F32, bh * shape.seq_q)?;
    let p = separate_params(&shape, mask_heads(&mask));
    let b = Ptrs {
        q: qo.ptr(),
        k: ko.ptr(),
        v: vo.ptr(),
        out: oo.ptr(),
        lse: lo.ptr(),
        kp: ptr_or_null(&kp),
    };
    let grads = [
        go.ptr(),
        delta.device_ptr(),
        dq.device_ptr(),
        dk.device_ptr(),
        dv.device_ptr(),
    ];
    run_backward(ctx, t, d, &p, &b, grads, &|| {
        describe(op, dt, &shape, kp.is_some())
    })?;
    Ok(Some((dq, dk, dv, None)))
}

/// `(batch, channels)` of a qkv call: `B = batch_heads / heads`, `C = heads * head_dim`.
fn qkv_dims(op: &str, shape: &AttentionShape, heads: usize) -> Result<(usize, usize)> {
    if heads == 0 || !shape.batch_heads.is_multiple_of(heads) || shape.seq_q != shape.seq_k {
        return Err(Error::Msg(format!(
            "{op} (CUDA): {heads} heads do not fit batch_heads {} (seq_q {}, seq_k {})",
            shape.batch_heads, shape.seq_q, shape.seq_k
        )));
    }
    Ok((shape.batch_heads / heads, heads * shape.head_dim))
}

/// See [`AttentionQkv`]: `(out [B, T, C] in qkv's dtype, lse f32 [B, heads, T])` read straight
/// from the `[B, T, 3C]` buffer. `Ok(None)` for what the kernels do not cover.
pub(super) fn qkv_forward(
    a: &AttentionQkv<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, CudaStorage)>> {
    let (qkv, shape, heads) = (a.qkv, a.shape, a.heads);
    let mask = a.mask.args();
    let dt = qkv.0.dtype();
    let Some(t) = covered(dt, &shape, &mask, false) else {
        return Ok(None);
    };
    let op = "attention_qkv";
    let (b, c) = qkv_dims(op, &shape, heads)?;
    let tq = shape.seq_q;
    check_len(op, "qkv", qkv.1, b * tq * 3 * c)?;
    let x = as_dtype(qkv, dt)?;
    let kp = key_padding(op, &mask, &shape)?;
    let ctx = qkv.0.ctx();
    let out = output(ctx, dt, b * tq * c)?;
    let lse = output(ctx, DType::F32, shape.batch_heads * tq)?;
    let p = qkv_params(&shape, heads, mask_heads(&mask));
    let ptrs = Ptrs {
        q: x.ptr(),
        k: x.ptr(),
        v: x.ptr(),
        out: out.device_ptr(),
        lse: lse.device_ptr(),
        kp: ptr_or_null(&kp),
    };
    run_forward(ctx, t, shape.head_dim, &p, &ptrs, &|| {
        describe(op, dt, &shape, kp.is_some())
    })?;
    Ok(Some((out, lse)))
}

/// See [`AttentionQkvBackward`]: `(dqkv [B, T, 3C], None)`. `Ok(None)` for what the kernels do
/// not cover, `want_dz` included.
pub(super) fn qkv_backward(
    a: &AttentionQkvBackward<CudaIn<'_>>,
) -> Result<Option<(CudaStorage, Option<CudaStorage>)>> {
    let (qkv, out, lse, dout) = (a.qkv, a.out, a.lse, a.dout);
    let (shape, heads, want_dz) = (a.shape, a.heads, a.want_dz);
    let mask = a.mask.args();
    let dt = qkv.0.dtype();
    let Some(t) = covered(dt, &shape, &mask, want_dz) else {
        return Ok(None);
    };
    let op = "attention_qkv_backward";
    let (b, c) = qkv_dims(op, &shape, heads)?;
    let tq = shape.seq_q;
    check_len(op, "qkv", qkv.1, b * tq * 3 * c)?;
    check_len(op, "out", out.1, b * tq * c)?;
    check_len(op, "lse", lse.1, shape.batch_heads * tq)?;
    check_len(op, "dout", dout.1, b * tq * c)?;
    let x = as_dtype(qkv, dt)?;
    let (oo, go) = (as_dtype(out, dt)?, as_dtype(dout, dt)?);
    let lo = as_dtype(lse, DType::F32)?;
    let kp = key_padding(op, &mask, &shape)?;
    let ctx = qkv.0.ctx();
    // Every element is written: dq by the dq kernel, dk and dv by the dkdv kernel.
    let dqkv = output(ctx, dt, b * tq * 3 * c)?;
    let delta = output(ctx, DType::F32, shape.batch_heads * tq)?;
    let p = qkv_params(&shape, heads, mask_heads(&mask));
    let ptrs = Ptrs {
        q: x.ptr(),
        k: x.ptr(),
        v: x.ptr(),
        out: oo.ptr(),
        lse: lo.ptr(),
        kp: ptr_or_null(&kp),
    };
    let g = dqkv.device_ptr();
    run_backward(
        ctx,
        t,
        shape.head_dim,
        &p,
        &ptrs,
        [go.ptr(), delta.device_ptr(), g, g, g],
        &|| describe(op, dt, &shape, kp.is_some()),
    )?;
    Ok(Some((dqkv, None)))
}
