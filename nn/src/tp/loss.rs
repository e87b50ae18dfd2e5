//! Loss-parallel cross-entropy over logits split by vocabulary: the full logits are never
//! gathered, only per-row statistics cross the group.

use meshgrad_autograd::distributed::FoldedPositions;
use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use super::TensorParallel;

/// Mean cross-entropy of `logits [N, V / tp]` (this rank's vocabulary slice `[r V/tp, (r+1) V/tp)`
/// of every row) against global `targets [N]`, skipping rows whose target is `ignore_index`; the
/// same value on every rank, equal to the single-device loss over the full logits.
///
/// Forward: each rank's row log-sum-exp is all-gathered (N values per rank) and combined into the
/// global one; the target logit comes from the rank that holds it (an all-reduce of N values).
/// Backward: `softmax - onehot` on the local slice, with no communication.
pub fn vocab_parallel_cross_entropy(
    logits: &Var,
    targets: &Tensor,
    ignore_index: Option<i64>,
    tp: &TensorParallel,
) -> Result<Var> {
    vocab_parallel_cross_entropy_chunked(logits, targets, ignore_index, tp, 1, None)
}

/// [`vocab_parallel_cross_entropy`] whose softmax statistics are per vocabulary chunk: this
/// rank's slice is cut into `chunks` equal chunks, each chunk's row log-sum-exp is computed on
/// its own (a contiguous `[N, V / (tp chunks)]` copy), and every rank combines the
/// `tp x chunks` values of a row in chunk order. With `chunks` = reference mode's `K / tp`, the
/// loss and its gradient are the same bits on one device (`tp = 1`, `K` chunks) as on `tp`
/// ranks. `chunks = 1` is the fast loss.
///
/// `folded`: reference mode's folded position order and the local sequence length `T` of the
/// rows (`N = B T`, row `b T + t`): the rows' losses are added per position leaf (in row order),
/// the leaves over their tree and the context-parallel group
/// ([`FoldedPositions::sum_over_group`]), and divided by the group's count of kept rows: one
/// device's loss, on the group's first rank; the others return zero (their rows' gradients are
/// the loss's all the same), so that the data-parallel sum over `dp x cp` ranks counts it once.
pub fn vocab_parallel_cross_entropy_chunked(
    logits: &Var,
    targets: &Tensor,
    ignore_index: Option<i64>,
    tp: &TensorParallel,
    chunks: usize,
    folded: Option<(&FoldedPositions, usize)>,
) -> Result<Var> {
    let x = logits.tensor().clone();
    if x.rank() != 2 || targets.dims() != [x.dims()[0]] {
        meshgrad_tensor::bail!(
            "vocab-parallel cross-entropy: logits must be [N, V/tp] and targets [N], got {} and {}",
            x.shape(),
            targets.shape()
        );
    }
    let (n, vl) = (x.dims()[0], x.dims()[1]);
    if chunks == 0 || !vl.is_multiple_of(chunks) {
        meshgrad_tensor::bail!(
            "vocab-parallel cross-entropy: the vocabulary slice of {vl} does not split into \
             {chunks} chunks"
        );
    }
    let (w, r) = (tp.degree(), tp.rank());
    let offset = (r * vl) as i64;
    let t: Vec<i64> = targets.to_vec_f64()?.iter().map(|&v| v as i64).collect();
    let vocab = (vl * w) as i64;
    if let Some(&bad) = t
        .iter()
        .find(|&&v| Some(v) != ignore_index && !(0..vocab).contains(&v))
    {
        meshgrad_tensor::bail!(
            "vocab-parallel cross-entropy: target {bad} is outside the vocabulary of {vocab}"
        );
    }
    // Global log-sum-exp per row from every rank's local ones (one per chunk, chunk-major).
    let local_lse = if chunks == 1 {
        x.logsumexp(1, false)?
    } else {
        let vc = vl / chunks;
        let parts: Vec<Tensor> = (0..chunks)
            .map(|c| x.narrow(1, c * vc, vc)?.contiguous()?.logsumexp(1, false))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, 0)?
    }
    .to_dtype(DType::F64)?;
    let all_lse = tp.group.all_gather(&local_lse)?.to_vec::<f64>()?;
    let total = w * chunks;
    let lse: Vec<f64> = (0..n)
        .map(|i| {
            let m = (0..total)
                .map(|k| all_lse[k * n + i])
                .fold(f64::NEG_INFINITY, f64::max);
            if m == f64::NEG_INFINITY {
                return m;
            }
            m + (0..total)
                .map(|k| (all_lse[k * n + i] - m).exp())
                .sum::<f64>()
                .ln()
        })
        .collect();
    // The target logit, from the rank whose slice holds it.
    let local_idx: Vec<i64> = t
        .iter()
        .map(|&v| {
            if (offset..offset + vl as i64).contains(&v) {
                v - offset
            } else {
                0
            }
        })
        .collect();
    let local_idx = Tensor::from_vec(local_idx, (n, 1), x.device())?;
    let picked = x.gather(1, &local_idx)?.to_vec_f64()?;
    let mine: Vec<f64> = (0..n)
        .map(|i| {
            if (offset..offset + vl as i64).contains(&t[i]) {
                picked[i]
            } else {
                0.0
            }
        })
        .collect();
    let target_logit = tp
        .group
        .all_reduce_sum(&Tensor::from_vec(mine, n, x.device())?)?
        .to_vec::<f64>()?;
    let keep: Vec<bool> = t.iter().map(|&v| Some(v) != ignore_index).collect();
    let mut count = keep.iter().filter(|&&k| k).count();
    if let Some((f, _)) = folded.filter(|(f, _)| f.group().size() > 1) {
        // Exact: a count below 2^53.
        let all =
            f.group()
                .all_reduce_sum(&Tensor::from_vec(vec![count as f64], 1, x.device())?)?;
        count = all.to_vec::<f64>()?[0] as usize;
    }
    let scale = 1.0 / count.max(1) as f64;
    let rows: Vec<f64> = (0..n)
        .map(|i| {
            if keep[i] {
                lse[i] - target_logit[i]
            } else {
                0.0
            }
        })
        .collect();
    // Half-precision logits give an f32 loss, as the fused single-device cross-entropy does.
    let loss_dtype = match x.dtype() {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    };
    let loss = match folded {
        None => Tensor::from_vec(rows, n, x.device())?.sum_all()?,
        Some((f, t)) => folded_row_sum(f, &rows, t, x.device())?,
    }
    .mul_scalar(scale)?
    .to_dtype(loss_dtype)?;
    let loss = match folded {
        Some((f, _)) if f.group().rank() > 0 => loss.zeros_like()?,
        _ => loss,
    };
    Ok(Var::from_op(
        "vocab_parallel_cross_entropy",
        loss,
        &[logits],
        Box::new(move |g, _| {
            // d loss / d x = (softmax(x) - onehot(target)) * g / count on kept rows: the local
            // slice of the softmax from the global log-sum-exp, minus the target's one-hot
            // scatter-added on the rank that holds it.
            // Computed in the loss's dtype (f32 for half logits), returned in the logits'.
            let g = g.to_dtype(DType::F64)?.item()? * scale;
            let (dtype, dev) = (loss_dtype, x.device());
            let column = |v: Vec<f64>| Tensor::from_vec(v, (n, 1), dev)?.to_dtype(dtype);
            let row_scale = column(keep.iter().map(|&k| if k { g } else { 0.0 }).collect())?;
            let hit = column(
                (0..n)
                    .map(|i| {
                        let local = (offset..offset + vl as i64).contains(&t[i]);
                        if keep[i] && local {
                            g
                        } else {
                            0.0
                        }
                    })
                    .collect(),
            )?;
            let softmax = x
                .to_dtype(dtype)?
                .sub(&column(lse.clone())?)?
                .exp()?
                .mul(&row_scale)?;
            let onehot = hit.gather_backward(1, &local_idx, (n, vl))?;
            Ok(vec![Some(softmax.sub(&onehot)?.to_dtype(x.dtype())?)])
        }),
    ))
}

/// The sum of per-row values `rows` (`B T` rows of local sequences of `t` positions, row
/// `b t + p`) in the folded order: per position leaf in row order, then the leaves' tree and
/// the context-parallel group's ([`FoldedPositions::sum_over_group`]), as an f64 scalar.
fn folded_row_sum(f: &FoldedPositions, rows: &[f64], t: usize, device: Device) -> Result<Tensor> {
    let batch = rows.len() / t.max(1);
    let leaves: Vec<Tensor> = (0..f.local_leaves())
        .map(|a| {
            let ranges = f.leaf_ranges(t, a)?;
            let mut sum = 0.0;
            for b in 0..batch {
                for r in &ranges {
                    for p in r.clone() {
                        sum += rows[b * t + p];
                    }
                }
            }
            Tensor::from_vec(vec![sum], 1, device)
        })
        .collect::<Result<_>>()?;
    f.sum_over_group(&leaves)?.reshape(())
}
