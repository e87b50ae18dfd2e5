//! Scaled dot-product attention, composed: the `[..., Tq, Tk]` score matrix is materialised
//! (the fused kernels never store it), masked and normalised with basic ops. Forward and
//! backward over `[..., T, D]` operands, and the fused-qkv forms in terms of them on slices of
//! the `[B, T, 3C]` buffer.
//!
//! Semantics are the fused kernel's: the softmax inputs are `z = scale q·k + bias`, `-inf`
//! where the causal mask (aligned bottom-right) or the key padding mask hides the key; a query
//! that sees no key (every input `-inf`) gets output 0, `lse = -inf` and zero gradients.

use meshgrad_kernels::ops::AttentionShape;

use super::{
    Attention, AttentionBackward, AttentionOutput, AttentionQkv, AttentionQkvBackward, Grads, Mask,
};
use crate::ops::compute_dtype;
use crate::ops::fallback::{replace, widen};
use crate::{DType, Result, Tensor};

/// `t` with the elements where `keep` (u8, broadcasting) is 0 set to `-inf`.
fn hide(t: &Tensor, keep: &Tensor) -> Result<Tensor> {
    let inf = Tensor::scalar(f64::NEG_INFINITY, t.dtype(), t.device())?;
    keep.where_cond(t, &inf)
}

/// The softmax inputs `[batch.., Tq, Tk]` in compute precision for q `[batch.., Tq, D]` and
/// k `[batch.., Tk, D]`: scaled scores plus bias, `-inf` where a mask hides the key. The padding
/// mask is integer `[B, Tk]` (nonzero = attend), `B` the leading batch dim of q (1 without one);
/// the bias is in q's dtype with the scores' rank, broadcastable to `[batch.., Tq, Tk]`.
fn scores(q: &Tensor, k: &Tensor, shape: &AttentionShape, mask: &Mask<&Tensor>) -> Result<Tensor> {
    let (tq, tk) = (shape.seq_q, shape.seq_k);
    let dev = q.device();
    let mut z = widen(q)?
        .matmul(&widen(k)?.transpose(-2, -1)?)?
        .mul_scalar(shape.scale)?;
    if let Some(b) = mask.bias {
        z = z.add(&widen(b)?)?;
    }
    if shape.causal {
        // Query i sees keys j <= i + (Tk - Tq).
        let limit = Tensor::arange((tk - tq) as i64, tk as i64, DType::I64, dev)?;
        let keys = Tensor::arange(0, tk as i64, DType::I64, dev)?;
        let seen = keys.reshape((1, tk))?.le(&limit.reshape((tq, 1))?)?;
        z = hide(&z, &seen)?;
    }
    if let Some(p) = mask.key_padding {
        let nb = q.rank() - 2;
        let mut dims = vec![1; nb + 2];
        dims[0] = p.dims()[0];
        dims[nb + 1] = tk;
        let keep = p.ne(&Tensor::scalar(0.0, p.dtype(), dev)?)?.reshape(dims)?;
        z = hide(&z, &keep)?;
    }
    Ok(z)
}

/// Whether the score matrix of `shape` has no elements.
fn empty(shape: &AttentionShape) -> bool {
    shape.batch_heads == 0 || shape.seq_q == 0 || shape.seq_k == 0
}

/// See [`Attention`] (any batch dims `[batch..]` kept): `out` in q's dtype and shape, `lse`
/// (compute precision) shaped like q without its last dim.
pub(super) fn forward(a: &Attention<&Tensor>) -> Result<AttentionOutput> {
    let (q, k, v, shape) = (a.q, a.k, a.v, a.shape);
    let r = q.rank();
    let lse_dims = q.dims()[..r - 1].to_vec();
    let ct = compute_dtype(q.dtype());
    if empty(&shape) {
        let lse = Tensor::full(f64::NEG_INFINITY, lse_dims, ct, q.device())?;
        let out = q.zeros_like()?;
        return Ok(AttentionOutput { out, lse });
    }
    let z = scores(q, k, &shape, &a.mask)?;
    // Shifted by the row max (by 0 for a row that sees no key).
    let m = replace(&z.max(-1, true)?, f64::NEG_INFINITY, 0.0)?;
    let e = z.sub(&m)?.exp()?;
    let l = e.sum(&[-1], true)?;
    let lse = m.add(&l.log()?)?.reshape(lse_dims)?;
    let p = e.div(&replace(&l, 0.0, 1.0)?)?;
    let out = p.matmul(&widen(v)?)?.to_dtype(q.dtype())?;
    Ok(AttentionOutput { out, lse })
}

/// See [`AttentionBackward`] (any batch dims `[batch..]` kept): `(dq, dk, dv)` in q's dtype
/// and, when `want_dz`, the `[batch.., Tq, Tk]` softmax-input gradient `dz` (compute
/// precision). Probabilities are recomputed as `P = exp(z - lse)`; with
/// `D_i = dout_i · out_i`, `dz = P (dout vᵀ - D)`, and `dv = Pᵀ dout`, `dq = scale dz k`,
/// `dk = scale dzᵀ q`.
pub(super) fn backward(a: &AttentionBackward<&Tensor>) -> Result<Grads<Tensor>> {
    let (q, k, v, out, lse, dout) = (a.q, a.k, a.v, a.out, a.lse, a.dout);
    let (shape, want_dz) = (a.shape, a.want_dz);
    let r = q.rank();
    let mut z_dims = q.dims()[..r - 1].to_vec();
    z_dims.push(shape.seq_k);
    let ct = compute_dtype(q.dtype());
    if empty(&shape) {
        let dz = match want_dz {
            true => Some(Tensor::zeros(z_dims, ct, q.device())?),
            false => None,
        };
        return Ok((q.zeros_like()?, k.zeros_like()?, v.zeros_like()?, dz));
    }
    let (qc, kc, vc) = (widen(q)?, widen(k)?, widen(v)?);
    let (oc, gc) = (widen(out)?, widen(dout)?);
    let z = scores(q, k, &shape, &a.mask)?;
    let mut col = lse.dims().to_vec();
    col.push(1);
    let l = replace(&widen(lse)?.reshape(col)?, f64::NEG_INFINITY, 0.0)?;
    let p = z.sub(&l)?.exp()?;
    let d = gc.mul(&oc)?.sum(&[-1], true)?;
    let dp = gc.matmul(&vc.transpose(-2, -1)?)?;
    let dz = p.mul(&dp.sub(&d)?)?;
    let ds = dz.mul_scalar(shape.scale)?;
    let dv = p.transpose(-2, -1)?.matmul(&gc)?.to_dtype(q.dtype())?;
    let dq = ds.matmul(&kc)?.to_dtype(q.dtype())?;
    let dk = ds.transpose(-2, -1)?.matmul(&qc)?.to_dtype(q.dtype())?;
    Ok((dq, dk, dv, want_dz.then_some(dz)))
}

/// The heads of `[B, T, C]` `t` (`C = heads · D`) moved forward: `[B, heads, T, D]`.
fn heads_forward(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, c) = (t.dims()[0], t.dims()[1], t.dims()[2]);
    t.contiguous()?
        .reshape((b, s, heads, c / heads))?
        .permute(&[0, 2, 1, 3])?
        .contiguous()
}

/// The inverse of [`heads_forward`]: `[B, heads, T, D]` back to `[B, T, heads · D]`.
fn heads_back(t: &Tensor) -> Result<Tensor> {
    let (b, h, s, d) = (t.dims()[0], t.dims()[1], t.dims()[2], t.dims()[3]);
    t.permute(&[0, 2, 1, 3])?
        .contiguous()?
        .reshape((b, s, h * d))
}

/// q, k and v of a `[B, T, 3C]` qkv buffer, each `[B, heads, T, D]`.
fn split_qkv(qkv: &Tensor, heads: usize) -> Result<[Tensor; 3]> {
    let c = qkv.dims()[2] / 3;
    let part = |i: usize| heads_forward(&qkv.narrow(2, i * c, c)?, heads);
    Ok([part(0)?, part(1)?, part(2)?])
}

/// See [`AttentionQkv`]: [`forward`] on the heads split out of the qkv buffer.
pub(super) fn qkv_forward(a: &AttentionQkv<&Tensor>) -> Result<AttentionOutput> {
    let [q, k, v] = split_qkv(a.qkv, a.heads)?;
    let fwd = forward(&Attention {
        q: &q,
        k: &k,
        v: &v,
        mask: a.mask,
        shape: a.shape,
    })?;
    Ok(AttentionOutput {
        out: heads_back(&fwd.out)?,
        lse: fwd.lse,
    })
}

/// See [`AttentionQkvBackward`]: [`backward`] on the heads split out of the qkv buffer, the
/// gradients put back side by side.
pub(super) fn qkv_backward(a: &AttentionQkvBackward<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
    let [q, k, v] = split_qkv(a.qkv, a.heads)?;
    let (o, g) = (
        heads_forward(a.out, a.heads)?,
        heads_forward(a.dout, a.heads)?,
    );
    let (dq, dk, dv, dz) = backward(&AttentionBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &o,
        lse: a.lse,
        dout: &g,
        mask: a.mask,
        shape: a.shape,
        want_dz: a.want_dz,
    })?;
    let dqkv = Tensor::cat(
        &[&heads_back(&dq)?, &heads_back(&dk)?, &heads_back(&dv)?],
        2,
    )?;
    Ok((dqkv, dz))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, rand, CASES};
    use crate::{AttentionMask, DType, Device, Tensor};

    /// A `[batch, seq_k]` u8 padding mask: batch entry 0 hides keys 1 and 4, entry 1 (when
    /// there is one) hides every key when `all_hidden`, else only the last.
    fn padding(batch: usize, seq_k: usize, all_hidden: bool) -> Tensor {
        let mut v = vec![1u8; batch * seq_k];
        v[1] = 0;
        v[4.min(seq_k - 1)] = 0;
        if batch > 1 {
            let row = &mut v[seq_k..2 * seq_k];
            if all_hidden {
                row.fill(0);
            } else {
                row[seq_k - 1] = 0;
            }
        }
        Tensor::from_vec(v, (batch, seq_k), Device::Cpu).unwrap()
    }

    /// The masks every attention comparison runs: none, causal, padding (with a fully padded
    /// batch entry), bias, and all of them at once.
    fn masks(batch: usize, seq_k: usize, bias: &Tensor) -> Vec<(&'static str, AttentionMask)> {
        vec![
            ("none", AttentionMask::none()),
            ("causal", AttentionMask::causal()),
            (
                "padding",
                AttentionMask::none().with_key_padding(padding(batch, seq_k, true)),
            ),
            ("bias", AttentionMask::none().with_bias(bias.clone())),
            (
                "causal+padding+bias",
                AttentionMask::causal()
                    .with_key_padding(padding(batch, seq_k, false))
                    .with_bias(bias.clone()),
            ),
        ]
    }

    #[test]
    fn attention_matches_its_composition() {
        for (dt, rel) in CASES {
            // [B, H, T, D] with Tq < Tk, [B, T, D], and a [T, D] q.
            let shapes: [(&[usize], &[usize], &[usize]); 3] = [
                (&[2, 3, 5, 8], &[2, 3, 7, 8], &[3, 5, 7]),
                (&[2, 6, 4], &[2, 6, 4], &[2, 1, 6]),
                (&[5, 4], &[5, 4], &[5, 5]),
            ];
            for (i, (qs, ks, bs)) in shapes.into_iter().enumerate() {
                let seed = 100 + 10 * i as u64;
                let q = rand(qs, seed, dt);
                let (k, v) = (rand(ks, seed + 1, dt), rand(ks, seed + 2, dt));
                let dout = rand(qs, seed + 3, dt);
                let bias = rand(bs, seed + 4, dt);
                let batch = if qs.len() > 2 { qs[0] } else { 1 };
                let seq_k = ks[ks.len() - 2];
                for (name, mask) in masks(batch, seq_k, &bias) {
                    let what = format!("attention {dt} q={qs:?} {name}");
                    let scale = 0.35;
                    let (a, c) = both(|| {
                        let fwd = Tensor::attention(&q, &k, &v, &mask, scale).unwrap();
                        let g =
                            Tensor::attention_backward(&q, &k, &v, &fwd, &dout, &mask, scale, true)
                                .unwrap();
                        (fwd, g)
                    });
                    close(&format!("{what} out"), &a.0.out, &c.0.out, rel);
                    close(&format!("{what} lse"), &a.0.lse, &c.0.lse, rel);
                    close(&format!("{what} dq"), &a.1.dq, &c.1.dq, rel);
                    close(&format!("{what} dk"), &a.1.dk, &c.1.dk, rel);
                    close(&format!("{what} dv"), &a.1.dv, &c.1.dv, rel);
                    assert_eq!(a.1.dbias.is_some(), mask.bias.is_some(), "{what}");
                    assert_eq!(c.1.dbias.is_some(), mask.bias.is_some(), "{what}");
                    if let (Some(x), Some(y)) = (&a.1.dbias, &c.1.dbias) {
                        close(&format!("{what} dbias"), x, y, rel);
                    }
                }
            }
        }
    }

    #[test]
    fn a_query_that_sees_no_key_gets_zeros_from_the_composition() {
        // Batch entry 1 is fully padded: its outputs and gradients are 0 and its lse -inf,
        // with the fused kernels declined (checked against the definition, not the kernel).
        let (q, k, v) = (
            rand(&[2, 1, 3, 4], 1, DType::F32),
            rand(&[2, 1, 3, 4], 2, DType::F32),
            rand(&[2, 1, 3, 4], 3, DType::F32),
        );
        let mask = AttentionMask::none().with_key_padding(padding(2, 3, true));
        let (fwd, g) = crate::backend::with_fused_declined(|| {
            let fwd = Tensor::attention(&q, &k, &v, &mask, 0.5).unwrap();
            let g = Tensor::attention_backward(&q, &k, &v, &fwd, &q, &mask, 0.5, false).unwrap();
            (fwd, g)
        });
        let second = |t: &Tensor| t.narrow(0, 1, 1).unwrap().to_vec_f64().unwrap();
        assert!(second(&fwd.out).iter().all(|&x| x == 0.0));
        assert!(second(&fwd.lse).iter().all(|&x| x == f64::NEG_INFINITY));
        for t in [&g.dq, &g.dk, &g.dv] {
            assert!(second(t).iter().all(|&x| x == 0.0));
        }
        let first = fwd.out.narrow(0, 0, 1).unwrap().to_vec_f64().unwrap();
        assert!(first.iter().all(|x| x.is_finite() && *x != 0.0));
    }

    #[test]
    fn attention_qkv_matches_its_composition() {
        let (b, t, heads, d) = (2, 6, 2, 4);
        let c = heads * d;
        for (dt, rel, [qkv, dout, bias]) in cases(130, [&[b, t, 3 * c], &[b, t, c], &[heads, t, t]])
        {
            for (name, mask) in masks(b, t, &bias) {
                let what = format!("attention_qkv {dt} {name}");
                let (a, r) = both(|| {
                    let fwd = qkv.attention_qkv(heads, &mask, 0.5).unwrap();
                    let g = qkv
                        .attention_qkv_backward(&fwd, &dout, heads, &mask, 0.5, true)
                        .unwrap();
                    (fwd, g)
                });
                close(&format!("{what} out"), &a.0.out, &r.0.out, rel);
                close(&format!("{what} lse"), &a.0.lse, &r.0.lse, rel);
                close(&format!("{what} dqkv"), &a.1 .0, &r.1 .0, rel);
                assert_eq!(a.1 .1.is_some(), mask.bias.is_some(), "{what}");
                assert_eq!(r.1 .1.is_some(), mask.bias.is_some(), "{what}");
                if let (Some(x), Some(y)) = (&a.1 .1, &r.1 .1) {
                    close(&format!("{what} dbias"), x, y, rel);
                }
            }
        }
    }
}
