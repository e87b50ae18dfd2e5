//! Fused attention with its backward rule: over `[..., T, D]` operands or straight from a fused
//! qkv projection, masked as an [`AttentionMask`] says (causal, key padding, additive bias whose
//! gradient is computed when the bias requires one).

use meshgrad_tensor::{AttentionMask, Result, Tensor};

use crate::Var;

impl Var {
    /// Fused scaled dot-product attention `softmax(scale q kᵀ + bias + mask) v` over
    /// `q [..., Tq, D]`, `k, v [..., Tk, D]` (see [`Tensor::attention`] and [`AttentionMask`]);
    /// the backward recomputes probabilities from the saved row log-sum-exp instead of storing
    /// them. When the mask's bias requires a gradient it gets one (summed over the dims it was
    /// broadcast along); the padding mask is a plain tensor.
    ///
    /// ```ignore
    /// let y = Var::attention(&q, &k, &v, &AttentionMask::causal(), 1.0 / (d as f64).sqrt())?;
    /// ```
    pub fn attention(
        q: &Var,
        k: &Var,
        v: &Var,
        mask: &AttentionMask<Var>,
        scale: f64,
    ) -> Result<Var> {
        let (qt, kt, vt) = (
            q.tensor().contiguous()?,
            k.tensor().contiguous()?,
            v.tensor().contiguous()?,
        );
        let tmask = mask.map_bias(|b| b.tensor().clone());
        let fwd = Tensor::attention(&qt, &kt, &vt, &tmask, scale)?;
        let mut inputs: Vec<&Var> = vec![q, k, v];
        inputs.extend(mask.bias.as_ref());
        let bias_grad = mask.bias.as_ref().is_some_and(|b| b.requires_grad());
        let has_bias = mask.bias.is_some();
        let out = fwd.out.clone();
        Ok(Var::from_op(
            "attention",
            out,
            &inputs,
            Box::new(move |g, _| {
                let gr =
                    Tensor::attention_backward(&qt, &kt, &vt, &fwd, g, &tmask, scale, bias_grad)?;
                let mut grads = vec![Some(gr.dq), Some(gr.dk), Some(gr.dv)];
                if has_bias {
                    grads.push(gr.dbias);
                }
                Ok(grads)
            }),
        ))
    }

    /// Multi-head attention straight from a fused qkv projection `[B, T, 3C]` (see
    /// [`Tensor::attention_qkv`]; padding `[B, T]`, bias broadcastable to `[B, heads, T, T]`):
    /// returns `[B, T, C]`; the gradient comes back as one `[B, T, 3C]` tensor, with no split,
    /// transpose or copy on either pass, and the bias's when it requires one.
    pub fn attention_qkv(
        qkv: &Var,
        heads: usize,
        mask: &AttentionMask<Var>,
        scale: f64,
    ) -> Result<Var> {
        let x = qkv.tensor().clone();
        let tmask = mask.map_bias(|b| b.tensor().clone());
        let fwd = x.attention_qkv(heads, &tmask, scale)?;
        let mut inputs: Vec<&Var> = vec![qkv];
        inputs.extend(mask.bias.as_ref());
        let bias_grad = mask.bias.as_ref().is_some_and(|b| b.requires_grad());
        let has_bias = mask.bias.is_some();
        let out = fwd.out.clone();
        Ok(Var::from_op(
            "attention_qkv",
            out,
            &inputs,
            Box::new(move |g, _| {
                let (dx, dbias) =
                    x.attention_qkv_backward(&fwd, g, heads, &tmask, scale, bias_grad)?;
                let mut grads = vec![Some(dx)];
                if has_bias {
                    grads.push(dbias);
                }
                Ok(grads)
            }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use meshgrad_tensor::{AttentionMask, DType, Device, Random, Tensor};

    use crate::{gradcheck, GradcheckOptions, Var};

    /// The reference path: split the fused projection, move heads forward, contiguous attention,
    /// move heads back.
    fn split_path(
        qkv: &Var,
        heads: usize,
        mask: &AttentionMask<Var>,
    ) -> meshgrad_tensor::Result<Var> {
        let (b, t, c3) = {
            let d = qkv.tensor().dims();
            (d[0], d[1], d[2])
        };
        let c = c3 / 3;
        let d = c / heads;
        let parts = qkv.split(&[c, c, c], -1)?;
        let h = |v: &Var| v.reshape((b, t, heads, d))?.transpose(1, 2);
        let y = Var::attention(
            &h(&parts[0])?,
            &h(&parts[1])?,
            &h(&parts[2])?,
            mask,
            1.0 / (d as f64).sqrt(),
        )?;
        y.transpose(1, 2)?.reshape((b, t, c))
    }

    #[test]
    fn attention_qkv_matches_the_split_path_and_finite_differences() {
        for &(b, t, heads, d, causal, masked) in &[
            (2usize, 5usize, 2usize, 3usize, true, false),
            (1, 7, 3, 4, false, false),
            (2, 6, 2, 3, true, true),
        ] {
            let c3 = 3 * heads * d;
            let x = Random::new(11)
                .dtype(DType::F64)
                .device(Device::Cpu)
                .normal((b, t, c3), 0.0, 1.0)
                .unwrap();
            let scale = 1.0 / (d as f64).sqrt();
            let pad = Tensor::from_vec(
                (0..b * t)
                    .map(|i| i64::from(i % 4 != 3))
                    .collect::<Vec<_>>(),
                (b, t),
                Device::Cpu,
            )
            .unwrap();
            let bias = Random::new(3)
                .dtype(DType::F64)
                .device(Device::Cpu)
                .normal((heads, t, t), 0.0, 1.0)
                .unwrap();
            let mask = |bias: Option<&Var>| {
                let m = AttentionMask {
                    causal,
                    ..AttentionMask::none()
                };
                match (masked, bias) {
                    (true, Some(b)) => m.with_key_padding(pad.clone()).with_bias(b.clone()),
                    _ => m,
                }
            };
            let fused = |xs: &[Var]| Var::attention_qkv(&xs[0], heads, &mask(xs.get(1)), scale);
            let split = |xs: &[Var]| split_path(&xs[0], heads, &mask(xs.get(1)));
            let inputs = if masked {
                vec![x.clone(), bias.clone()]
            } else {
                vec![x.clone()]
            };
            gradcheck(fused, &inputs, GradcheckOptions::default()).unwrap();

            let va: Vec<Var> = inputs.iter().map(|t| Var::leaf(t.clone())).collect();
            let vb: Vec<Var> = inputs.iter().map(|t| Var::leaf(t.clone())).collect();
            let (ya, yb) = (fused(&va).unwrap(), split(&vb).unwrap());
            let (pa, pb) = (
                ya.tensor().to_vec_f64().unwrap(),
                yb.tensor().to_vec_f64().unwrap(),
            );
            for (p, q) in pa.iter().zip(&pb) {
                assert!((p - q).abs() < 1e-12, "forward {p} vs {q}");
            }
            let w = Random::new(5)
                .dtype(DType::F64)
                .device(Device::Cpu)
                .normal(ya.tensor().shape(), 0.0, 1.0)
                .unwrap();
            ya.backward_with(w.clone()).unwrap();
            yb.backward_with(w).unwrap();
            for (a, b) in va.iter().zip(&vb) {
                let (ga, gb) = (
                    a.grad().unwrap().to_vec_f64().unwrap(),
                    b.grad().unwrap().to_vec_f64().unwrap(),
                );
                for (p, q) in ga.iter().zip(&gb) {
                    assert!((p - q).abs() < 1e-12, "gradient {p} vs {q}");
                }
            }
        }
    }
}
