//! Fused scaled dot-product attention (flash-style: the score matrix is never stored), forward
//! and backward, over `[..., T, D]` operands or straight out of a fused `[B, T, 3C]` qkv
//! projection, with causal masking, a key padding mask and an additive score bias
//! ([`AttentionMask`], `mask.rs`): the argument structs [`Attention`], [`AttentionBackward`],
//! [`AttentionQkv`] and [`AttentionQkvBackward`], their paths (`cpu.rs`, `cuda/`, `fallback.rs`)
//! and the tensor ops [`Tensor::attention`], [`Tensor::attention_backward`],
//! [`Tensor::attention_qkv`] and [`Tensor::attention_qkv_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::attention`, the CUDA ones those of `kernels/cuda/attention.cu`; the
//! autograd rules are `Var::attention` and `Var::attention_qkv`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;
mod mask;

use meshgrad_derive::FusedArgs;
use meshgrad_kernels::ops::{AttentionShape, BiasLayout};

pub use mask::AttentionMask;
use mask::{resolve, Resolved};

use super::{fused_op, fused_paths, run, FusedOp};
use crate::backend::api::In;
use crate::backend::Variant;
use crate::ops::float_only;
use crate::ops::same_kind;
use crate::{Result, Tensor};

/// The mask of one call as the paths read it: `heads` heads per batch entry index both the key
/// padding mask (a contiguous integer `[batch, seq_k]` operand) and the bias (a contiguous float
/// operand in q's dtype read through its [`BiasLayout`], strides 0 where it broadcasts).
pub(crate) struct MaskArgs<'a, S> {
    /// Heads per batch entry.
    pub heads: usize,
    /// The key padding mask (nonzero = attend).
    pub key_padding: Option<In<'a, S>>,
    /// The additive bias and its layout.
    pub bias: Option<(In<'a, S>, BiasLayout)>,
}

impl<S> Clone for MaskArgs<'_, S> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<S> Copy for MaskArgs<'_, S> {}

/// The mask's shapes in an argument struct (its operands are [`Mask`]'s `key_padding` and
/// `bias`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct MaskLayout {
    /// Heads per batch entry (what the padding mask's and the bias's batch index counts).
    pub heads: usize,
    /// The bias's layout, when there is a bias.
    pub bias: Option<BiasLayout>,
}

/// The mask of one call in an argument struct, shared by the four attention argument structs:
/// its operands and their shapes.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct Mask<T> {
    /// The key padding mask, integer `[batch, seq_k]` (`[B, T]` for the qkv form).
    pub key_padding: Option<T>,
    /// The additive bias, in q's dtype.
    pub bias: Option<T>,
    /// The mask's shapes.
    pub layout: MaskLayout,
}

impl<'a, S> Mask<In<'a, S>> {
    /// The mask as the backend paths read it.
    pub(crate) fn args(&self) -> MaskArgs<'a, S> {
        MaskArgs {
            heads: self.layout.heads,
            key_padding: self.key_padding,
            bias: self.bias.zip(self.layout.bias),
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

/// Attention over `q [batch_heads, seq_q, head_dim]`, `k, v [batch_heads, seq_k, head_dim]`
/// (any batch dims folded): `(out, lse)`, `out` in q's dtype, `lse` `[batch_heads, seq_q]` in
/// compute precision. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct Attention<T> {
    /// The queries.
    pub q: T,
    /// The keys.
    pub k: T,
    /// The values.
    pub v: T,
    /// The padding mask and the bias.
    pub mask: Mask<T>,
    /// Sizes, causality and scale.
    pub shape: AttentionShape,
}

/// The backward of [`Attention`] from its `out`, `lse` and `dout`: `(dq, dk, dv, dz)`, the
/// gradients in q's dtype and, when `want_dz`, the `[batch.., seq_q, seq_k]` gradient of the
/// softmax inputs (compute precision; what the bias gradient sums). Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct AttentionBackward<T> {
    /// The forward's queries.
    pub q: T,
    /// The forward's keys.
    pub k: T,
    /// The forward's values.
    pub v: T,
    /// The forward's output.
    pub out: T,
    /// The forward's log-sum-exp.
    pub lse: T,
    /// The gradient of the output.
    pub dout: T,
    /// The padding mask and the bias.
    pub mask: Mask<T>,
    /// Sizes, causality and scale.
    pub shape: AttentionShape,
    /// Whether to return the softmax inputs' gradient.
    pub want_dz: bool,
}

/// [`Attention`] read straight from a `[B, T, 3C]` qkv buffer with `heads` heads: `(out
/// [B, T, C], lse [B, heads, T])`. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct AttentionQkv<T> {
    /// The fused projection, q, k and v side by side.
    pub qkv: T,
    /// The padding mask and the bias.
    pub mask: Mask<T>,
    /// Sizes (`batch_heads = B * heads`), causality and scale.
    pub shape: AttentionShape,
    /// Heads.
    pub heads: usize,
}

/// The backward of [`AttentionQkv`]: `(dqkv [B, T, 3C], dz)`, `dz` `[B, heads, T, T]` when
/// `want_dz`. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct AttentionQkvBackward<T> {
    /// The forward's fused projection.
    pub qkv: T,
    /// The forward's output, `[B, T, C]`.
    pub out: T,
    /// The forward's log-sum-exp, `[B, heads, T]`.
    pub lse: T,
    /// The gradient of the output, `[B, T, C]`.
    pub dout: T,
    /// The padding mask and the bias.
    pub mask: Mask<T>,
    /// Sizes, causality and scale.
    pub shape: AttentionShape,
    /// Heads.
    pub heads: usize,
    /// Whether to return the softmax inputs' gradient.
    pub want_dz: bool,
}

/// What [`AttentionBackward`] returns: `(dq, dk, dv, dz)`.
pub(crate) type Grads<S> = (S, S, S, Option<S>);

impl FusedOp for Attention<&Tensor> {
    const NAME: &'static str = "attention";
    type Out<S> = (S, S);
    type Output = AttentionOutput;

    fn finish<S: Variant>(&self, (out, lse): (S, S)) -> AttentionOutput {
        let r = self.q.rank();
        AttentionOutput {
            out: Tensor::from_storage(out.wrap(), self.q.shape()),
            lse: Tensor::from_storage(lse.wrap(), self.q.dims()[..r - 1].to_vec()),
        }
    }

    fused_paths!(forward);
}

impl FusedOp for AttentionBackward<&Tensor> {
    const NAME: &'static str = "attention_backward";
    type Out<S> = Grads<S>;
    type Output = Grads<Tensor>;

    fn finish<S: Variant>(&self, (dq, dk, dv, dz): Grads<S>) -> Grads<Tensor> {
        let r = self.q.rank();
        let mut z_dims = self.q.dims()[..r - 2].to_vec();
        z_dims.extend([self.shape.seq_q, self.shape.seq_k]);
        (
            Tensor::from_storage(dq.wrap(), self.q.shape()),
            Tensor::from_storage(dk.wrap(), self.k.shape()),
            Tensor::from_storage(dv.wrap(), self.v.shape()),
            dz.map(|dz| Tensor::from_storage(dz.wrap(), z_dims)),
        )
    }

    fused_paths!(backward);
}

impl FusedOp for AttentionQkv<&Tensor> {
    const NAME: &'static str = "attention_qkv";
    type Out<S> = (S, S);
    type Output = AttentionOutput;

    fn finish<S: Variant>(&self, (out, lse): (S, S)) -> AttentionOutput {
        let (b, t, c3) = (self.qkv.dims()[0], self.qkv.dims()[1], self.qkv.dims()[2]);
        AttentionOutput {
            out: Tensor::from_storage(out.wrap(), (b, t, c3 / 3)),
            lse: Tensor::from_storage(lse.wrap(), (b, self.heads, t)),
        }
    }

    fused_paths!(qkv_forward);
}

fused_op!(AttentionQkvBackward, "attention_qkv_backward", qkv_backward, |a| (S, Option<S>) => (
    a.qkv.shape(),
    (a.qkv.dims()[0], a.heads, a.qkv.dims()[1], a.qkv.dims()[1])
));

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
        run(&Attention {
            q: &q,
            k: &k,
            v: &v,
            mask: m.mask(),
            shape,
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
        let (dq, dk, dv, dz) = run(&AttentionBackward {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            lse: &lse,
            dout: &dout,
            mask: m.mask(),
            shape,
            want_dz,
        })?;
        Ok(AttentionGrads {
            dq,
            dk,
            dv,
            dbias: bias_grad_of(&m, dz)?,
        })
    }

    fn qkv_shape(qkv: &Tensor, heads: usize, causal: bool, scale: f64) -> Result<AttentionShape> {
        if qkv.rank() != 3 || heads == 0 || !qkv.dims()[2].is_multiple_of(3 * heads) {
            crate::bail!(
                "attention_qkv: expected a fused qkv tensor [B, T, 3C] with C divisible by {heads} heads, got {}",
                qkv.shape()
            );
        }
        float_only("attention_qkv", qkv)?;
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
        let (b, t) = (self.dims()[0], self.dims()[1]);
        let m = resolve("attention_qkv", mask, self, &[b, heads], t, t)?;
        let x = self.contiguous()?;
        run(&AttentionQkv {
            qkv: &x,
            mask: m.mask(),
            shape,
            heads,
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
        let (dqkv, dz) = run(&AttentionQkvBackward {
            qkv: &x,
            out: &o,
            lse: &l,
            dout: &d,
            mask: m.mask(),
            shape,
            heads,
            want_dz,
        })?;
        Ok((dqkv, bias_grad_of(&m, dz)?))
    }
}

/// The bias gradient from the softmax inputs' gradient `dz`, when there is one.
fn bias_grad_of(m: &Resolved, dz: Option<Tensor>) -> Result<Option<Tensor>> {
    match dz {
        None => Ok(None),
        Some(dz) => m.bias_grad(dz),
    }
}
