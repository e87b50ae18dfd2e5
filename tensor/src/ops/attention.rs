//! Fused scaled dot-product attention (flash-style: the score matrix is never stored), forward
//! and backward, over `[..., T, D]` operands or straight out of a fused `[B, T, 3C]` qkv
//! projection, with causal masking, a key padding mask and an additive score bias
//! ([`AttentionMask`]).

use super::same_kind;
use crate::backend::{self, AttentionMaskArgs};
use crate::{DType, Error, Result, Shape, Tensor};
use meshgrad_kernels::ops::{AttentionShape, BiasLayout};

/// The masking of one attention call beyond the scaling: causal masking, a key padding mask and
/// an additive bias, any combination. `B` is the bias's type: [`Tensor`] for the tensor ops,
/// an autograd variable one layer up (whose gradient is then computed when it requires one).
///
/// The softmax of query `i` of batch entry `b`, head `h` runs over
/// `scale · q_i·k_j + bias[b, h, i, j]` for the keys `j` that neither the causal mask nor the
/// padding mask hides. A query that sees no key at all (every key padded, or every visible bias
/// `-inf`) gets a zero output and zero gradients, never NaN.
///
/// ```
/// use meshgrad_tensor::{AttentionMask, DType, Device, Tensor};
/// let (b, h, t, d) = (2, 4, 5, 8);
/// let q = Tensor::randn((b, h, t, d), 1)?;
/// // GPT: causal only.
/// let gpt: AttentionMask = AttentionMask::causal();
/// // BERT: padding from the tokenizer's attention_mask [B, T] (1 = attend).
/// let attention_mask = Tensor::from_vec(vec![1u8, 1, 1, 0, 0, 1, 1, 1, 1, 1], (b, t), Device::Cpu)?;
/// let bert = AttentionMask::none().with_key_padding(attention_mask);
/// // T5-style relative position bias [H, T, T] on top of a causal mask.
/// let t5 = AttentionMask::causal().with_bias(Tensor::zeros((h, t, t), DType::F32, Device::Cpu)?);
/// for mask in [&gpt, &bert, &t5] {
///     let out = Tensor::attention(&q, &q, &q, mask, 1.0 / (d as f64).sqrt())?;
///     assert_eq!(out.out.dims(), &[b, h, t, d]);
/// }
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct AttentionMask<B = Tensor> {
    /// Causal masking aligned bottom-right: query `i` sees keys `j <= i + (Tk - Tq)` (needs
    /// `Tk >= Tq`). Key tiles wholly past the limit are skipped, not computed.
    pub causal: bool,
    /// An integer (u8, u32 or i64) tensor `[B, Tk]`: nonzero = the key may be attended to, 0 = it
    /// is hidden from every query and head of that batch entry (BERT's `attention_mask`). `B` is
    /// the leading dim of q (`[B, H, Tq, D]` or `[B, Tq, D]`; 1 for a `[Tq, D]` q) or of the
    /// fused qkv tensor.
    pub key_padding: Option<Tensor>,
    /// A float bias broadcastable to the scores' shape, `[..., Tq, Tk]` with q's batch dims
    /// (`[B, H, Tq, Tk]` for a `[B, H, Tq, D]` q and for the fused qkv form): for example
    /// `[H, Tq, Tk]`, `[B, 1, 1, Tk]` or `[Tq, Tk]`. It is added to the scaled scores before the
    /// softmax (`-inf` hides a score) in q's dtype; its gradient (the gradient of the scores,
    /// summed over the dims the bias was broadcast along) comes back in the bias's dtype.
    pub bias: Option<B>,
}

impl<B> Default for AttentionMask<B> {
    fn default() -> Self {
        AttentionMask {
            causal: false,
            key_padding: None,
            bias: None,
        }
    }
}

impl<B> AttentionMask<B> {
    /// No masking and no bias: every query sees every key.
    pub fn none() -> Self {
        Self::default()
    }

    /// Causal masking only.
    pub fn causal() -> Self {
        AttentionMask {
            causal: true,
            ..Self::default()
        }
    }

    /// The same masking with `key_padding` (`[B, Tk]`, nonzero = attend) as the padding mask.
    pub fn with_key_padding(self, key_padding: Tensor) -> Self {
        AttentionMask {
            key_padding: Some(key_padding),
            ..self
        }
    }

    /// The same masking with `bias` as the additive score bias.
    pub fn with_bias(self, bias: B) -> Self {
        AttentionMask {
            bias: Some(bias),
            ..self
        }
    }

    /// The same masking with the bias mapped through `f` (for example from an autograd variable
    /// to its tensor).
    pub fn map_bias<C>(&self, f: impl FnOnce(&B) -> C) -> AttentionMask<C> {
        AttentionMask {
            causal: self.causal,
            key_padding: self.key_padding.clone(),
            bias: self.bias.as_ref().map(f),
        }
    }
}

/// The results of [`Tensor::attention`] and [`Tensor::attention_qkv`].
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    /// `softmax(scale q kᵀ + bias + mask) v`, shaped like `q` (`[B, T, C]` for the qkv form).
    pub out: Tensor,
    /// Row log-sum-exp of the softmax inputs (compute precision; `-inf` for a query that sees no
    /// key), `q`'s shape without the last dim (`[B, heads, T]` for the qkv form).
    pub lse: Tensor,
}

/// The gradients returned by [`Tensor::attention_backward`].
#[derive(Clone, Debug)]
pub struct AttentionGrads {
    /// Gradient of q.
    pub dq: Tensor,
    /// Gradient of k.
    pub dk: Tensor,
    /// Gradient of v.
    pub dv: Tensor,
    /// Gradient of the bias, shaped and typed like it: present when the mask has a bias and it
    /// was asked for.
    pub dbias: Option<Tensor>,
}

/// A mask resolved against one call: contiguous operands for the backend, the kernel's view of
/// the bias, and what the bias gradient needs.
struct Resolved {
    heads: usize,
    key_padding: Option<Tensor>,
    /// The bias in q's dtype (contiguous), its kernel layout, and its original shape and dtype.
    bias: Option<(Tensor, BiasLayout, Shape, DType)>,
}

impl Resolved {
    /// Sums the full `[..batch, Tq, Tk]` score gradient down to the bias's shape and dtype.
    fn bias_grad(&self, dz: Tensor) -> Result<Option<Tensor>> {
        match &self.bias {
            None => Ok(None),
            Some((_, _, shape, dtype)) => Ok(Some(dz.sum_to_shape(shape)?.to_dtype(*dtype)?)),
        }
    }

    /// The mask as the composed fallbacks take it.
    fn parts(&self) -> super::fallback::MaskParts<'_> {
        super::fallback::MaskParts {
            key_padding: self.key_padding.as_ref(),
            bias: self.bias.as_ref().map(|(t, ..)| t),
        }
    }

    /// Calls `f` with the backend's view of the mask (its storages read for the duration).
    fn with_args<R>(
        &self,
        op: &'static str,
        f: impl FnOnce(&AttentionMaskArgs<'_>) -> Result<R>,
    ) -> Result<R> {
        let pad = self
            .key_padding
            .as_ref()
            .map(|t| t.read_storage(op))
            .transpose()?;
        let bias = self
            .bias
            .as_ref()
            .map(|(t, ..)| t.read_storage(op))
            .transpose()?;
        let args = AttentionMaskArgs {
            heads: self.heads,
            key_padding: pad
                .as_ref()
                .zip(self.key_padding.as_ref())
                .map(|(g, t)| (&**g, t.layout())),
            bias: bias
                .as_ref()
                .zip(self.bias.as_ref())
                .map(|(g, (t, l, ..))| ((&**g, t.layout()), *l)),
        };
        f(&args)
    }
}

/// Checks `mask` against a call whose scores are `[batch.., seq_q, seq_k]` (q is `q`, for dtype
/// and device) and prepares it for the backend.
fn resolve(
    op: &'static str,
    mask: &AttentionMask,
    q: &Tensor,
    batch: &[usize],
    seq_q: usize,
    seq_k: usize,
) -> Result<Resolved> {
    let lead = batch.first().copied().unwrap_or(1);
    let heads = batch.iter().skip(1).product::<usize>();
    let key_padding = match &mask.key_padding {
        None => None,
        Some(p) => {
            super::same_device(op, q, p)?;
            if !p.dtype().is_int() {
                return Err(Error::msg(format!(
                    "{op}: the key padding mask must be an integer tensor (nonzero = attend), got {}; an additive float mask is a bias",
                    p.dtype()
                )));
            }
            if p.dims() != [lead, seq_k] {
                crate::bail!(
                    "{op}: key padding mask {} must be [B, Tk] = [{lead}, {seq_k}] for q {}",
                    p.shape(),
                    q.shape()
                );
            }
            Some(p.contiguous()?)
        }
    };
    let bias = match &mask.bias {
        None => None,
        Some(b) => Some(resolve_bias(op, b, q, batch, seq_q, seq_k)?),
    };
    Ok(Resolved {
        heads: heads.max(1),
        key_padding,
        bias,
    })
}

fn resolve_bias(
    op: &'static str,
    b: &Tensor,
    q: &Tensor,
    batch: &[usize],
    seq_q: usize,
    seq_k: usize,
) -> Result<(Tensor, BiasLayout, Shape, DType)> {
    super::same_device(op, q, b)?;
    if !b.dtype().is_float() {
        return Err(Error::UnsupportedDType {
            op: "attention (bias must be a float tensor)",
            dtype: b.dtype(),
        });
    }
    let mut full = batch.to_vec();
    full.extend([seq_q, seq_k]);
    let fits = b.rank() <= full.len()
        && b.dims()
            .iter()
            .rev()
            .zip(full.iter().rev())
            .all(|(&d, &f)| d == 1 || d == f);
    if !fits {
        crate::bail!(
            "{op}: bias {} does not broadcast to the scores {} (q {})",
            b.shape(),
            Shape::new(full),
            q.shape()
        );
    }
    // The bias with the full rank (leading 1s), in q's dtype, contiguous.
    let mut dims = vec![1; full.len() - b.rank()];
    dims.extend_from_slice(b.dims());
    let mut t = b.to_dtype(q.dtype())?.reshape(dims.clone())?;
    // Batch dims after the first fold into one "heads" index; that needs their strides to
    // nest (all of them broadcast, or none of them); otherwise expand them.
    let nb = batch.len();
    if nb > 2 {
        let inner = &dims[1..nb];
        let none = inner.iter().zip(&full[1..nb]).all(|(&d, &f)| d == f);
        let all = inner.iter().all(|&d| d == 1);
        if !none && !all {
            let mut target = dims.clone();
            target[1..nb].copy_from_slice(&full[1..nb]);
            t = t.expand(target.clone())?;
            dims = target;
        }
    }
    let t = t.contiguous()?;
    let strides = Shape::new(dims.clone()).contiguous_strides();
    let st = |i: usize| if dims[i] == 1 { 0 } else { strides[i] };
    let n = full.len();
    // The folded batch dims 1..nb nest contiguously (or all broadcast): head h is at h times the
    // innermost one's stride.
    let head_stride = if nb >= 2 && dims[1..nb].iter().any(|&d| d != 1) {
        strides[nb - 1]
    } else {
        0
    };
    let layout = BiasLayout {
        offset: 0,
        batch_stride: if nb >= 1 { st(0) } else { 0 },
        head_stride,
        row_stride: st(n - 2),
        col_stride: st(n - 1),
    };
    Ok((t, layout, b.shape().clone(), b.dtype()))
}

impl Tensor {
    fn attention_shape(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<AttentionShape> {
        same_kind("attention", q, k)?;
        same_kind("attention", q, v)?;
        if q.rank() < 2 || k.shape() != v.shape() || k.rank() != q.rank() {
            crate::bail!(
                "attention: q {}, k {}, v {} must be [..., T, D] with k and v equal",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        let r = q.rank();
        if q.dims()[..r - 2] != k.dims()[..r - 2] || q.dims()[r - 1] != k.dims()[r - 1] {
            crate::bail!(
                "attention: q {} and k {} disagree on batch dims or head dim",
                q.shape(),
                k.shape()
            );
        }
        let (seq_q, seq_k) = (q.dims()[r - 2], k.dims()[r - 2]);
        if causal && seq_k < seq_q {
            crate::bail!(
                "attention: causal attention needs seq_k >= seq_q, got q {} and k {}",
                q.shape(),
                k.shape()
            );
        }
        Ok(AttentionShape {
            batch_heads: q.dims()[..r - 2].iter().product(),
            seq_q,
            seq_k,
            head_dim: q.dims()[r - 1],
            causal,
            scale,
        })
    }

    /// Fused scaled dot-product attention `softmax(scale q kᵀ + bias + mask) v` over
    /// `q [..., Tq, D]`, `k, v [..., Tk, D]` (flash-style; the score matrix is never stored),
    /// masked as `mask` says (see [`AttentionMask`]).
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &AttentionMask,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let _prof = crate::profile::scope("attention");
        let shape = Tensor::attention_shape(q, k, v, mask.causal, scale)?;
        let r = q.rank();
        let m = resolve(
            "attention",
            mask,
            q,
            &q.dims()[..r - 2],
            shape.seq_q,
            shape.seq_k,
        )?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let op = "attention";
        let res = {
            let (gq, gk, gv) = (
                q.read_storage(op)?,
                k.read_storage(op)?,
                v.read_storage(op)?,
            );
            m.with_args(op, |args| {
                backend::attention(
                    (&gq, q.layout()),
                    (&gk, k.layout()),
                    (&gv, v.layout()),
                    shape,
                    args,
                )
            })?
        };
        let Some((out, lse)) = res else {
            let (out, lse) = super::fallback::attention(&q, &k, &v, shape, m.parts())?;
            return Ok(AttentionOutput { out, lse });
        };
        let lse_shape = q.dims()[..r - 1].to_vec();
        Ok(AttentionOutput {
            out: Tensor::from_storage(out, q.shape()),
            lse: Tensor::from_storage(lse, lse_shape),
        })
    }

    /// The backward of [`Tensor::attention`] (same operands, `mask` and `scale`; `fwd` its
    /// result) from `dout`. The bias gradient is computed only when `bias_grad` (it needs a
    /// `[..., Tq, Tk]` buffer of score gradients before the sum over broadcast dims).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        fwd: &AttentionOutput,
        dout: &Tensor,
        mask: &AttentionMask,
        scale: f64,
        bias_grad: bool,
    ) -> Result<AttentionGrads> {
        let _prof = crate::profile::scope("attention_backward");
        let shape = Tensor::attention_shape(q, k, v, mask.causal, scale)?;
        let r = q.rank();
        let batch = &q.dims()[..r - 2];
        let m = resolve(
            "attention_backward",
            mask,
            q,
            batch,
            shape.seq_q,
            shape.seq_k,
        )?;
        same_kind("attention_backward", q, &fwd.out)?;
        same_kind("attention_backward", q, dout)?;
        if fwd.out.shape() != q.shape()
            || dout.shape() != q.shape()
            || fwd.lse.dims() != &q.dims()[..r - 1]
        {
            crate::bail!(
                "attention_backward: q {}, out {}, lse {}, dout {} do not fit together",
                q.shape(),
                fwd.out.shape(),
                fwd.lse.shape(),
                dout.shape()
            );
        }
        let want_dz = bias_grad && m.bias.is_some();
        let c = |t: &Tensor| t.contiguous();
        let (q, k, v, out, lse, dout) = (c(q)?, c(k)?, c(v)?, c(&fwd.out)?, c(&fwd.lse)?, c(dout)?);
        let op = "attention_backward";
        fn g<'a>(t: &'a Tensor, op: &'static str) -> Result<crate::storage::StorageRead<'a>> {
            t.read_storage(op)
        }
        let res = {
            let (gq, gk, gv, go, gl, gd) = (
                g(&q, op)?,
                g(&k, op)?,
                g(&v, op)?,
                g(&out, op)?,
                g(&lse, op)?,
                g(&dout, op)?,
            );
            m.with_args(op, |args| {
                backend::attention_backward(
                    (&gq, q.layout()),
                    (&gk, k.layout()),
                    (&gv, v.layout()),
                    (&go, out.layout()),
                    (&gl, lse.layout()),
                    (&gd, dout.layout()),
                    shape,
                    args,
                    want_dz,
                )
            })?
        };
        let mut z_dims = batch.to_vec();
        z_dims.extend([shape.seq_q, shape.seq_k]);
        let (dq, dk, dv, dz) = match res {
            Some((dq, dk, dv, dz)) => (
                Tensor::from_storage(dq, q.shape()),
                Tensor::from_storage(dk, k.shape()),
                Tensor::from_storage(dv, v.shape()),
                dz.map(|dz| Tensor::from_storage(dz, z_dims)),
            ),
            None => super::fallback::attention_backward(
                &q,
                &k,
                &v,
                &out,
                &lse,
                &dout,
                shape,
                m.parts(),
                want_dz,
            )?,
        };
        let dbias = match dz {
            None => None,
            Some(dz) => m.bias_grad(dz)?,
        };
        Ok(AttentionGrads { dq, dk, dv, dbias })
    }

    fn qkv_shape(qkv: &Tensor, heads: usize, causal: bool, scale: f64) -> Result<AttentionShape> {
        if qkv.rank() != 3 || heads == 0 || !qkv.dims()[2].is_multiple_of(3 * heads) {
            crate::bail!(
                "attention_qkv: expected a fused qkv tensor [B, T, 3C] with C divisible by {heads} heads, got {}",
                qkv.shape()
            );
        }
        if !qkv.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "attention_qkv",
                dtype: qkv.dtype(),
            });
        }
        let (b, t, c3) = (qkv.dims()[0], qkv.dims()[1], qkv.dims()[2]);
        Ok(AttentionShape {
            batch_heads: b * heads,
            seq_q: t,
            seq_k: t,
            head_dim: c3 / 3 / heads,
            causal,
            scale,
        })
    }

    /// Multi-head attention read straight from a fused qkv projection `self` (`[B, T, 3C]`: q, k,
    /// v each `[B, T, C]` side by side, `C = heads * D`, head `h` at columns `h*D .. (h+1)*D` of
    /// each), masked as `mask` says (padding `[B, T]`, bias broadcastable to `[B, heads, T, T]`):
    /// the output comes back as `[B, T, C]` (heads side by side), `lse` as `[B, heads, T]`.
    /// The same values as splitting, moving heads forward, [`Tensor::attention`] and moving them
    /// back, without any of the copies.
    pub fn attention_qkv(
        &self,
        heads: usize,
        mask: &AttentionMask,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let _prof = crate::profile::scope("attention");
        let shape = Tensor::qkv_shape(self, heads, mask.causal, scale)?;
        let (b, t, c3) = (self.dims()[0], self.dims()[1], self.dims()[2]);
        let m = resolve("attention_qkv", mask, self, &[b, heads], t, t)?;
        let x = self.contiguous()?;
        let op = "attention_qkv";
        let r = {
            let g = x.read_storage(op)?;
            m.with_args(op, |args| {
                backend::attention_qkv((&g, x.layout()), shape, heads, args)
            })?
        };
        let Some((out, lse)) = r else {
            let (out, lse) = super::fallback::attention_qkv(&x, shape, heads, m.parts())?;
            return Ok(AttentionOutput { out, lse });
        };
        Ok(AttentionOutput {
            out: Tensor::from_storage(out, (b, t, c3 / 3)),
            lse: Tensor::from_storage(lse, (b, heads, t)),
        })
    }

    /// The backward of [`Tensor::attention_qkv`] (`self` is its qkv input, `fwd` its result,
    /// same `heads`, `mask` and `scale`): `dqkv [B, T, 3C]` and, when `bias_grad` and the mask
    /// has a bias, the bias gradient.
    pub fn attention_qkv_backward(
        &self,
        fwd: &AttentionOutput,
        dout: &Tensor,
        heads: usize,
        mask: &AttentionMask,
        scale: f64,
        bias_grad: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let _prof = crate::profile::scope("attention_backward");
        let shape = Tensor::qkv_shape(self, heads, mask.causal, scale)?;
        same_kind("attention_qkv_backward", self, &fwd.out)?;
        same_kind("attention_qkv_backward", self, dout)?;
        let (b, t, c3) = (self.dims()[0], self.dims()[1], self.dims()[2]);
        if fwd.out.dims() != [b, t, c3 / 3]
            || dout.dims() != [b, t, c3 / 3]
            || fwd.lse.dims() != [b, heads, t]
        {
            crate::bail!(
                "attention_qkv_backward: qkv {}, out {}, dout {}, lse {} do not fit together",
                self.shape(),
                fwd.out.shape(),
                dout.shape(),
                fwd.lse.shape()
            );
        }
        let m = resolve("attention_qkv_backward", mask, self, &[b, heads], t, t)?;
        let want_dz = bias_grad && m.bias.is_some();
        let c = |t: &Tensor| t.contiguous();
        let (x, o, l, d) = (c(self)?, c(&fwd.out)?, c(&fwd.lse)?, c(dout)?);
        let op = "attention_qkv_backward";
        let r = {
            let (gx, go, gl, gd) = (
                x.read_storage(op)?,
                o.read_storage(op)?,
                l.read_storage(op)?,
                d.read_storage(op)?,
            );
            m.with_args(op, |args| {
                backend::attention_qkv_backward(
                    (&gx, x.layout()),
                    (&go, o.layout()),
                    (&gl, l.layout()),
                    (&gd, d.layout()),
                    shape,
                    heads,
                    args,
                    want_dz,
                )
            })?
        };
        let (dqkv, dz) = match r {
            Some((s, dz)) => (
                Tensor::from_storage(s, x.shape()),
                dz.map(|dz| Tensor::from_storage(dz, (b, heads, t, t))),
            ),
            None => super::fallback::attention_qkv_backward(
                &x,
                &o,
                &l,
                &d,
                shape,
                heads,
                m.parts(),
                want_dz,
            )?,
        };
        let dbias = match dz {
            None => None,
            Some(dz) => m.bias_grad(dz)?,
        };
        Ok((dqkv, dbias))
    }
}
