//! Attention on the CPU, the four functions: resolves dtypes and the mask, then calls
//! `meshgrad_kernels::cpu::attention`.

use std::borrow::Cow;

use meshgrad_kernels::cpu::attention::{self as kernel, HeadLayout, ScoreMask};
use meshgrad_kernels::ops::{AttentionShape, BiasLayout};
use meshgrad_kernels::Float;

use super::{Attention, AttentionBackward, AttentionQkv, AttentionQkvBackward, Grads, MaskArgs};
use crate::cpu_backend::{floats, pick, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::{Error, Result};

/// The padding mask and bias of one call on the CPU.
type CpuMask<'a> = MaskArgs<'a, CpuStorage>;

/// The mask's inputs in the kernel's terms: the padding mask as bytes (nonzero = attend) and
/// the bias in compute precision.
struct Prepared<'a> {
    heads: usize,
    pad: Option<Cow<'a, [u8]>>,
    bias: Option<(Floats<'a>, BiasLayout)>,
}

impl<'a> Prepared<'a> {
    fn new(m: &CpuMask<'a>, op: &'static str) -> Result<Self> {
        let pad = match m.key_padding {
            None => None,
            Some((s, l)) => {
                let r = range(l);
                Some(match s {
                    CpuStorage::U8(v) => Cow::Borrowed(&v[r]),
                    CpuStorage::U32(v) => {
                        Cow::Owned(v[r].iter().map(|&x| u8::from(x != 0)).collect())
                    }
                    CpuStorage::I64(v) => {
                        Cow::Owned(v[r].iter().map(|&x| u8::from(x != 0)).collect())
                    }
                    other => {
                        return Err(Error::UnsupportedDType {
                            op: "attention (key padding mask)",
                            dtype: other.dtype(),
                        })
                    }
                })
            }
        };
        let bias = m
            .bias
            .map(|((s, l), bl)| floats(s, range(l), op).map(|f| (f, bl)))
            .transpose()?;
        Ok(Prepared {
            heads: m.heads,
            pad,
            bias,
        })
    }

    /// The kernel's mask, with the bias as a slice of `like`'s element type.
    fn mask<T: Float>(&self, _like: &[T]) -> Result<ScoreMask<'_, T>> {
        let bias = match &self.bias {
            None => None,
            Some((f, l)) => Some((pick(f, _like)?, *l)),
        };
        Ok(ScoreMask {
            heads: self.heads,
            key_padding: self.pad.as_deref(),
            bias,
        })
    }
}

/// See [`Attention`]: `(out, lse)`.
pub(super) fn forward(a: &Attention<CpuIn<'_>>) -> Result<(CpuStorage, CpuStorage)> {
    let (q, k, v, shape) = (a.q, a.k, a.v, a.shape);
    let dt = q.0.dtype();
    let n = shape.batch_heads * shape.seq_q * shape.head_dim;
    let m = Prepared::new(&a.mask.args(), "attention")?;
    Ok(
        with_floats!("attention", (q.0, range(q.1)) => qv, (k.0, range(k.1)) => kv, (v.0, range(v.1)) => vv; {
            let sm = m.mask(qv)?;
            let mut out = crate::pool::output(n);
            let mut lse = vec![Float::ZERO; shape.batch_heads * shape.seq_q];
            kernel::attention_forward(shape, &sm, qv, kv, vv, &mut out, &mut lse);
            (out.into_storage(dt), lse.into_storage(crate::DType::F32))
        }),
    )
}

/// See [`AttentionBackward`]: `(dq, dk, dv, dz)` with `dz` (compute precision) when `want_dz`.
pub(super) fn backward(a: &AttentionBackward<CpuIn<'_>>) -> Result<Grads<CpuStorage>> {
    let (q, k, v, out, lse, dout) = (a.q, a.k, a.v, a.out, a.lse, a.dout);
    let (shape, want_dz, mask) = (a.shape, a.want_dz, a.mask.args());
    let dt = q.0.dtype();
    let nq = shape.batch_heads * shape.seq_q * shape.head_dim;
    let nk = shape.batch_heads * shape.seq_k * shape.head_dim;
    let nz = shape.batch_heads * shape.seq_q * shape.seq_k;
    let m = Prepared::new(&mask, "attention_backward")?;
    Ok(
        with_floats!("attention_backward", (q.0, range(q.1)) => qv, (k.0, range(k.1)) => kv, (v.0, range(v.1)) => vv, (out.0, range(out.1)) => ov, (lse.0, range(lse.1)) => lv, (dout.0, range(dout.1)) => gv; {
            let sm = m.mask(qv)?;
            let mut dq = crate::pool::output(nq);
            let mut dk = crate::pool::output(nk);
            let mut dv = crate::pool::output(nk);
            let mut dz = want_dz.then(|| crate::pool::output(nz));
            kernel::attention_backward(shape, &sm, qv, kv, vv, ov, lv, gv, &mut dq, &mut dk, &mut dv, dz.as_deref_mut());
            (dq.into_storage(dt), dk.into_storage(dt), dv.into_storage(dt), dz.map(|z| z.into_storage(crate::DType::F32)))
        }),
    )
}

/// The q, k, v head layouts inside a contiguous `[B, T, 3C]` qkv buffer with `heads` heads.
fn qkv_layouts(shape: &AttentionShape, heads: usize) -> [HeadLayout; 3] {
    let (t, d) = (shape.seq_q, shape.head_dim);
    let c = heads * d;
    let at = |offset| HeadLayout {
        offset,
        batch_stride: t * 3 * c,
        head_stride: d,
        row_stride: 3 * c,
    };
    [at(0), at(c), at(2 * c)]
}

/// The head layout of a contiguous `[B, T, C]` buffer with `heads` heads.
fn btc_layout(shape: &AttentionShape, heads: usize) -> HeadLayout {
    let (t, d) = (shape.seq_q, shape.head_dim);
    HeadLayout {
        offset: 0,
        batch_stride: t * heads * d,
        head_stride: d,
        row_stride: heads * d,
    }
}

/// See [`AttentionQkv`]: `(out [B, T, C], lse [B, H, T])`.
pub(super) fn qkv_forward(a: &AttentionQkv<CpuIn<'_>>) -> Result<(CpuStorage, CpuStorage)> {
    let (qkv, shape, heads, mask) = (a.qkv, a.shape, a.heads, a.mask.args());
    let dt = qkv.0.dtype();
    let [ql, kl, vl] = qkv_layouts(&shape, heads);
    let ol = btc_layout(&shape, heads);
    let n = shape.batch_heads * shape.seq_q * shape.head_dim;
    let m = Prepared::new(&mask, "attention_qkv")?;
    Ok(with_floats!("attention", (qkv.0, range(qkv.1)) => x; {
        let sm = m.mask(x)?;
        let mut out = crate::pool::output(n);
        let mut lse = vec![Float::ZERO; shape.batch_heads * shape.seq_q];
        kernel::attention_forward_strided(shape, &sm, heads, x, ql, x, kl, x, vl, &mut out, ol, &mut lse);
        (out.into_storage(dt), lse.into_storage(crate::DType::F32))
    }))
}

/// See [`AttentionQkvBackward`]: `dqkv [B, T, 3C]` and, when `want_dz`, the `[B, H, T, T]`
/// gradient of the softmax inputs (compute precision).
pub(super) fn qkv_backward(
    a: &AttentionQkvBackward<CpuIn<'_>>,
) -> Result<(CpuStorage, Option<CpuStorage>)> {
    let (qkv, out, lse, dout) = (a.qkv, a.out, a.lse, a.dout);
    let (shape, heads, want_dz) = (a.shape, a.heads, a.want_dz);
    let mask = a.mask.args();
    let dt = qkv.0.dtype();
    let [ql, kl, vl] = qkv_layouts(&shape, heads);
    let ol = btc_layout(&shape, heads);
    let n = 3 * shape.batch_heads * shape.seq_q * shape.head_dim;
    let nz = shape.batch_heads * shape.seq_q * shape.seq_k;
    let m = Prepared::new(&mask, "attention_qkv_backward")?;
    Ok(
        with_floats!("attention_backward", (qkv.0, range(qkv.1)) => x, (out.0, range(out.1)) => o, (lse.0, range(lse.1)) => l, (dout.0, range(dout.1)) => g; {
            let sm = m.mask(x)?;
            let mut dqkv = crate::pool::output(n);
            let mut dz = want_dz.then(|| crate::pool::output(nz));
            kernel::attention_backward_strided(shape, &sm, heads, x, ql, x, kl, x, vl, o, ol, l, g, ol, &mut dqkv, [ql, kl, vl], dz.as_deref_mut());
            (dqkv.into_storage(dt), dz.map(|z| z.into_storage(crate::DType::F32)))
        }),
    )
}
