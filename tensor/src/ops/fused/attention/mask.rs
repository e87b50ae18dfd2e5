//! The mask of an attention call: [`AttentionMask`] as the caller gives it, and the same checked
//! against one call and prepared for the kernels ([`Resolved`]: contiguous operands, the bias's
//! kernel layout, what the bias gradient needs).

use meshgrad_kernels::ops::BiasLayout;

use super::{Mask, MaskLayout};
use crate::ops::float_only;
use crate::ops::same_device;
use crate::{DType, Error, Result, Shape, Tensor};

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

/// A mask resolved against one call: contiguous operands for the backend, the kernel's view of
/// the bias, and what the bias gradient needs.
pub(super) struct Resolved {
    heads: usize,
    pub(super) key_padding: Option<Tensor>,
    /// The bias in q's dtype (contiguous), its kernel layout, and its original shape and dtype.
    pub(super) bias: Option<(Tensor, BiasLayout, Shape, DType)>,
}

impl Resolved {
    /// Sums the full `[..batch, Tq, Tk]` score gradient down to the bias's shape and dtype.
    pub(super) fn bias_grad(&self, dz: Tensor) -> Result<Option<Tensor>> {
        match &self.bias {
            None => Ok(None),
            Some((_, _, shape, dtype)) => Ok(Some(dz.sum_to_shape(shape)?.to_dtype(*dtype)?)),
        }
    }

    /// The mask of an argument struct: the operands (contiguous, the bias in q's dtype) and
    /// the kernels' view of them (heads per batch entry, the bias's layout).
    pub(super) fn mask(&self) -> Mask<&Tensor> {
        Mask {
            key_padding: self.key_padding.as_ref(),
            bias: self.bias.as_ref().map(|(t, ..)| t),
            layout: MaskLayout {
                heads: self.heads,
                bias: self.bias.as_ref().map(|(_, l, ..)| *l),
            },
        }
    }
}

/// Checks `mask` against a call whose scores are `[batch.., seq_q, seq_k]` (q is `q`, for dtype
/// and device) and prepares it for the backend.
pub(super) fn resolve(
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
            same_device(op, q, p)?;
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
    same_device(op, q, b)?;
    float_only("attention (bias must be a float tensor)", b)?;
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
