//! Reference mode under tensor parallelism: the ops that make a tensor-parallel GPT, BERT or
//! Llama compute the same bits as one device.
//!
//! Reference mode fixes a chunk count `K` that depends only on the model (see
//! [`crate::gpt::reference_chunks`]), never on the layout. Every sum that tensor parallelism
//! splits across ranks is cut into the same `K` chunks on every layout, each chunk's partial sum
//! computed by the same kernel call on tensors of the same shape, and the `K` partial sums added
//! over the aligned binary tree of their indices (`((c0 + c1) + (c2 + c3))`). A rank of a group
//! of `T` ranks (a power of two dividing `K`) computes the subtree of its `K / T` chunks, and the
//! group's all-reduce (a `TreeReduce` in reference mode) adds the ranks' subtrees in the same
//! tree: the sum of one device.
//!
//! * **Linears** ([`column_linear`], [`row_linear`]): a column-parallel linear (q/k/v, the MLP's
//!   up-projection, the tied head) computes each of its pieces of output features (unit `j`'s
//!   slice of each block; for q/k/v the same heads of q, of k and of v) as its own product, and
//!   the input gradient as the tree over the units; a row-parallel linear (the output
//!   projections) computes its output as the tree over `K` chunks of input features. Every
//!   product has the same shapes and operand strides on every layout, so no result depends on
//!   how the matmul kernel blocks other dimensions. A rank's products run as batched matmuls,
//!   side by side on the rayon threads.
//! * **Sums over positions** ([`layer_norm_positions`], [`rms_norm_positions`], [`add_bias_positions`],
//!   [`linear_positions`]): the gradients of the LayerNorm and RMSNorm parameters, of the row-parallel
//!   biases and of replicated sequence-parallel linears (BERT's MLM transform), which sequence
//!   parallelism sums over each rank's positions and then over the ranks, are trees over `K`
//!   chunks of positions on every layout (with or without sequence parallelism).
//! * **The loss** ([`super::vocab_parallel_cross_entropy_chunked`]): the softmax statistics are
//!   per vocabulary chunk (`K` chunks), combined in chunk order after an all-gather.
//!
//! Everything else a tensor-parallel rank does is either elementwise, per head, per row, or an
//! exact copy (all-gathers, the vocabulary-parallel embedding's sum of one row with zeros).

mod linear;
#[cfg(test)]
mod test_support;

pub use linear::{column_linear, linear_positions, row_linear};

use meshgrad_autograd::distributed::Collectives;
use meshgrad_autograd::Var;
use meshgrad_tensor::tree_sum::tree_sum;
use meshgrad_tensor::{Result, Tensor};

/// A group of one rank: every collective returns its input. The reference-mode context of a
/// single-device run ([`super::TensorParallel::single_device`]).
pub(crate) struct OneRank;

impl Collectives for OneRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.clone())
    }
    fn describe(&self) -> String {
        "[one device]".to_string()
    }
}

/// Position chunk `k` of `t [B, T, ...]` (chunks of `len` positions along dimension 1), as a
/// contiguous copy.
pub(super) fn positions(t: &Tensor, k: usize, len: usize) -> Result<Tensor> {
    t.narrow(1, k * len, len)?.contiguous()
}

/// Whether `x` is `[B, T, C]` with `T` cut into `chunks` equal chunks (reference mode's training
/// sequences always are; generation's shorter contexts need not be, and are taken whole).
pub(super) fn splits_positions(x: &Tensor, chunks: usize) -> bool {
    x.rank() == 3 && chunks > 1 && x.dims()[1].is_multiple_of(chunks)
}

/// Layer norm of `x [B, T, C]` whose parameter gradients are trees over `chunks` equal chunks of
/// positions: the rows are normalised by one kernel call (each row on its own), each chunk
/// `[B, T / chunks, C]` is back-propagated by its own kernel call, its `dweight`, `dbias` summed
/// over its rows, and the chunks' sums added over their aligned binary tree. Every row's output
/// and input gradient are the plain layer norm's. An input whose positions do not split is
/// normalised whole.
pub fn layer_norm_positions(
    x: &Var,
    weight: &Var,
    bias: Option<&Var>,
    eps: f64,
    chunks: usize,
) -> Result<Var> {
    let xt = x.tensor().clone();
    if !splits_positions(&xt, chunks) {
        return x.layer_norm(Some(weight), bias, eps);
    }
    let (batch, t) = (xt.dims()[0], xt.dims()[1]);
    let len = t / chunks;
    let w = weight.tensor().clone();
    let b = bias.map(|b| b.tensor().clone());
    // Every row is normalised on its own, so one call over all rows gives each chunk's rows.
    let out = xt.layer_norm(Some(&w), b.as_ref(), eps)?;
    let (mean, rstd) = (out.mean.reshape((batch, t))?, out.rstd.reshape((batch, t))?);
    let stats: Vec<(Tensor, Tensor)> = (0..chunks)
        .map(|k| Ok((mean.narrow(1, k * len, len)?, rstd.narrow(1, k * len, len)?)))
        .collect::<Result<_>>()?;
    let y = out.y;
    let mut inputs: Vec<&Var> = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    Ok(Var::from_op(
        "layer_norm_positions",
        y,
        &inputs,
        Box::new(move |g, _| {
            let (mut dxs, mut dws, mut dbs) = (Vec::new(), Vec::new(), Vec::new());
            for (k, (mean, rstd)) in stats.iter().enumerate() {
                let (dx, pg) = positions(&xt, k, len)?.layer_norm_backward(
                    Some(&w),
                    mean,
                    rstd,
                    &positions(g, k, len)?,
                )?;
                dxs.push(dx);
                let (dw, db) = pg.ok_or_else(|| {
                    meshgrad_tensor::Error::msg("layer_norm_positions: no parameter gradients")
                })?;
                dws.push(dw);
                dbs.push(db);
            }
            let refs: Vec<&Tensor> = dxs.iter().collect();
            let mut grads = vec![Some(Tensor::cat(&refs, 1)?), Some(tree_sum(&dws)?)];
            if has_bias {
                grads.push(Some(tree_sum(&dbs)?));
            }
            Ok(grads)
        }),
    ))
}

/// RMS norm of `x [B, T, C]` whose weight gradient is a tree over `chunks` equal chunks of
/// positions, as [`layer_norm_positions`] does for the layer norm: one kernel call normalises
/// every row, each chunk is back-propagated by its own call and the chunks' weight gradients are
/// added over their aligned binary tree. An input whose positions do not split is normalised
/// whole.
pub fn rms_norm_positions(x: &Var, weight: &Var, eps: f64, chunks: usize) -> Result<Var> {
    let xt = x.tensor().clone();
    if !splits_positions(&xt, chunks) {
        return x.rms_norm(Some(weight), eps);
    }
    let (batch, t) = (xt.dims()[0], xt.dims()[1]);
    let len = t / chunks;
    let w = weight.tensor().clone();
    let out = xt.rms_norm(Some(&w), eps)?;
    let rstd = out.rstd.reshape((batch, t))?;
    let stats: Vec<Tensor> = (0..chunks)
        .map(|k| {
            rstd.narrow(1, k * len, len)?
                .contiguous()?
                .reshape(batch * len)
        })
        .collect::<Result<_>>()?;
    let weight_grad = weight.requires_grad();
    Ok(Var::from_op(
        "rms_norm_positions",
        out.y,
        &[x, weight],
        Box::new(move |g, _| {
            let (mut dxs, mut dws) = (Vec::new(), Vec::new());
            for (k, rstd) in stats.iter().enumerate() {
                let (dx, dw) = positions(&xt, k, len)?.rms_norm_backward(
                    Some(&w),
                    rstd,
                    &positions(g, k, len)?,
                    weight_grad,
                )?;
                dxs.push(dx);
                dws.extend(dw);
            }
            let refs: Vec<&Tensor> = dxs.iter().collect();
            let dw = if weight_grad {
                Some(tree_sum(&dws)?)
            } else {
                None
            };
            Ok(vec![Some(Tensor::cat(&refs, 1)?), dw])
        }),
    ))
}

/// `y + bias` for `y [B, T, C]` and `bias [C]`, whose bias gradient is the tree over `chunks`
/// equal chunks of positions of each chunk's column sum. An input whose positions do not split
/// is added whole.
pub fn add_bias_positions(y: &Var, bias: &Var, chunks: usize) -> Result<Var> {
    let yt = y.tensor();
    if !splits_positions(yt, chunks) {
        return y.add(bias);
    }
    let len = yt.dims()[1] / chunks;
    let c = yt.dims()[2];
    let v = yt.add(bias.tensor())?;
    Ok(Var::from_op(
        "add_bias_positions",
        v,
        &[y, bias],
        Box::new(move |g, wanted| {
            let db = if wanted[1] {
                let sums: Vec<Tensor> = (0..chunks)
                    .map(|k| {
                        let p = positions(g, k, len)?;
                        let rows = p.elem_count() / c;
                        p.reshape((rows, c))?.sum(&[0], false)
                    })
                    .collect::<Result<_>>()?;
                Some(tree_sum(&sums)?)
            } else {
                None
            };
            Ok(vec![Some(g.clone()), db])
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::test_support::{bits, close, rand, run};
    use super::*;
    use meshgrad_tensor::Device;

    #[test]
    fn position_chunked_norm_and_bias_match_the_plain_ops() {
        let x = rand(7, &[2, 8, 6]);
        let (w, b) = (rand(8, &[6]), rand(9, &[6]));
        let dy = rand(10, &[2, 8, 6]);
        let (y0, dx0, dw0, db0) = run(&x, &w, Some(&b), &dy, |x, w, b| {
            x.layer_norm(Some(w), b, 1e-5)?.add(b.expect("a bias"))
        });
        let (y1, dx1, dw1, db1) = run(&x, &w, Some(&b), &dy, |x, w, b| {
            let n = layer_norm_positions(x, w, b, 1e-5, 4)?;
            add_bias_positions(&n, b.expect("a bias"), 4)
        });
        assert_eq!(bits(&y0), bits(&y1), "outputs are per row");
        assert_eq!(bits(&dx0), bits(&dx1), "input gradients are per row");
        close(&dw1, &dw0.to_vec_f64().unwrap(), "dweight");
        close(
            db1.as_ref().unwrap(),
            &db0.unwrap().to_vec_f64().unwrap(),
            "dbias",
        );
    }

    #[test]
    fn position_chunked_rms_norm_matches_the_plain_op() {
        let x = rand(12, &[2, 8, 6]);
        let w = rand(13, &[6]);
        let dy = rand(14, &[2, 8, 6]);
        let (y0, dx0, dw0, _) = run(&x, &w, None, &dy, |x, w, _| x.rms_norm(Some(w), 1e-6));
        let (y1, dx1, dw1, _) = run(&x, &w, None, &dy, |x, w, _| {
            rms_norm_positions(x, w, 1e-6, 4)
        });
        assert_eq!(bits(&y0), bits(&y1), "outputs are per row");
        assert_eq!(bits(&dx0), bits(&dx1), "input gradients are per row");
        close(&dw1, &dw0.to_vec_f64().unwrap(), "dweight");
    }

    /// The chunked vocabulary-parallel loss on one device (4 chunks) against a plain f64
    /// log-softmax, value and gradient, with an ignored target.
    #[test]
    fn chunked_cross_entropy_matches_an_independent_computation() {
        let (n, v) = (5, 16);
        let x = rand(11, &[n, v]);
        let targets = Tensor::from_vec(vec![3i64, 15, -1, 0, 8], n, Device::Cpu).unwrap();
        let tp = super::super::TensorParallel::single_device(4);
        let xa = Var::leaf(x.clone());
        let loss = super::super::vocab_parallel_cross_entropy_chunked(
            &xa,
            &targets,
            Some(-1),
            &tp,
            4,
            None,
        )
        .unwrap();
        loss.backward().unwrap();
        let xv = x.to_vec_f64().unwrap();
        let t = [3usize, 15, usize::MAX, 0, 8];
        let lse: Vec<f64> = (0..n)
            .map(|i| {
                xv[i * v..(i + 1) * v]
                    .iter()
                    .map(|a| a.exp())
                    .sum::<f64>()
                    .ln()
            })
            .collect();
        let kept: Vec<usize> = (0..n).filter(|&i| t[i] != usize::MAX).collect();
        let want = kept.iter().map(|&i| lse[i] - xv[i * v + t[i]]).sum::<f64>() / 4.0;
        close(loss.tensor(), &[want], "loss");
        let grad: Vec<f64> = (0..n * v)
            .map(|e| {
                let (i, j) = (e / v, e % v);
                if t[i] == usize::MAX {
                    return 0.0;
                }
                ((xv[e] - lse[i]).exp() - if j == t[i] { 1.0 } else { 0.0 }) / 4.0
            })
            .collect();
        close(&xa.grad().unwrap(), &grad, "dlogits");
    }
}
