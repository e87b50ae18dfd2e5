//! Reference mode under tensor parallelism: the ops that make a tensor-parallel GPT compute the
//! same bits as one device.
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
//! * **Linears** ([`unit_linear`]): a column-parallel linear (q/k/v, the MLP's up-projection, the
//!   tied head) computes each of its `K` units of output features (a unit of q/k/v is one slice
//!   of heads of each of q, k and v) as its own product, and the input gradient as the tree over
//!   the units; a row-parallel linear (the output projections) computes its output as the tree
//!   over `K` chunks of input features. Every product has the same shapes on every layout, so
//!   no result depends on how the matmul kernel blocks other dimensions.
//! * **Sums over positions** ([`layer_norm_positions`], [`add_bias_positions`],
//!   [`linear_positions`]): the gradients of the LayerNorm parameters, of the row-parallel
//!   biases and of replicated sequence-parallel linears (BERT's MLM transform), which sequence
//!   parallelism sums
//!   over each rank's positions and then over the ranks, are trees over `K` chunks of positions
//!   on every layout (with or without sequence parallelism).
//! * **The loss** ([`super::vocab_parallel_cross_entropy_chunked`]): the softmax statistics are
//!   per vocabulary chunk (`K` chunks), combined in chunk order after an all-gather.
//!
//! Everything else a tensor-parallel rank does is either elementwise, per head, per row, or an
//! exact copy (all-gathers, the vocabulary-parallel embedding's sum of one row with zeros).

use std::ops::Range;

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

/// Whether `ranges` are one range covering `0..len`.
fn is_whole(ranges: &[Range<usize>], len: usize) -> bool {
    ranges.len() == 1 && ranges[0] == (0..len)
}

/// The pieces `ranges` of `t` along `dim`, side by side (a contiguous copy; `t` itself when the
/// ranges cover the whole dimension).
fn gather_ranges(t: &Tensor, dim: isize, ranges: &[Range<usize>]) -> Result<Tensor> {
    let d = if dim < 0 {
        (t.rank() as isize + dim) as usize
    } else {
        dim as usize
    };
    if is_whole(ranges, t.dims()[d]) {
        return Ok(t.clone());
    }
    let parts: Vec<Tensor> = ranges
        .iter()
        .map(|r| t.narrow(dim, r.start, r.len()))
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = parts.iter().collect();
    Tensor::cat(&refs, dim)?.contiguous()
}

/// The inverse of [`gather_ranges`] over a partition: `pieces[u]` holds ranges `units[u]` of a
/// dimension `dim` side by side; the result has every range at its place.
fn scatter_units(pieces: &[Tensor], dim: isize, units: &[Vec<Range<usize>>]) -> Result<Tensor> {
    if pieces.len() == 1 && units[0].len() == 1 {
        return Ok(pieces[0].clone());
    }
    let mut placed: Vec<(usize, Tensor)> = Vec::new();
    for (piece, ranges) in pieces.iter().zip(units) {
        let mut off = 0;
        for r in ranges {
            placed.push((r.start, piece.narrow(dim, off, r.len())?));
            off += r.len();
        }
    }
    placed.sort_by_key(|(start, _)| *start);
    let refs: Vec<&Tensor> = placed.iter().map(|(_, t)| t).collect();
    Tensor::cat(&refs, dim)
}

/// The units of a column-parallel weight of `rows` local output features in `blocks` equal
/// blocks (3 for a fused q/k/v projection), cut into `units` units: unit `j` holds slice `j` of
/// every block (for q/k/v: the same heads of q, of k and of v).
pub fn column_units(rows: usize, blocks: usize, units: usize) -> Result<Vec<Vec<Range<usize>>>> {
    let blocks = blocks.max(1);
    if units == 0 || !rows.is_multiple_of(blocks * units) {
        meshgrad_tensor::bail!(
            "reference mode: {rows} output features do not split into {blocks} block(s) x \
             {units} unit(s)"
        );
    }
    let (b, u) = (rows / blocks, rows / blocks / units);
    Ok((0..units)
        .map(|j| {
            (0..blocks)
                .map(|c| c * b + j * u..c * b + (j + 1) * u)
                .collect()
        })
        .collect())
}

/// `x Wᵀ (+ bias)` computed unit by unit: output features in the units `out_units` (a partition
/// of `0..out`, see [`column_units`]), input features in `in_chunks` equal contiguous chunks.
///
/// Forward: for each unit `o`, the tree over input chunks `i` of `x_i W_{o,i}ᵀ` (the bias of the
/// unit's features is the first product's starting value; a bias needs `in_chunks == 1`), placed
/// at the unit's columns. Backward: `dx_i` is the tree over the units of `dy_o W_{o,i}`, `dW_{o,i}
/// = dy_oᵀ x_i` and `dbias_o = Σ_rows dy_o`, each from [`Tensor::linear_backward`] on one
/// unit's contiguous pieces. Every product involves only one unit and one chunk, so its shapes,
/// and hence its bits, do not depend on how many units a rank holds.
pub fn unit_linear(
    x: &Var,
    weight: &Var,
    bias: Option<&Var>,
    out_units: &[Vec<Range<usize>>],
    in_chunks: usize,
) -> Result<Var> {
    let (xt, wt) = (x.tensor().clone(), weight.tensor().clone());
    let (out_f, in_f) = (wt.dims()[0], wt.dims()[1]);
    if in_chunks == 0 || !in_f.is_multiple_of(in_chunks) || (bias.is_some() && in_chunks > 1) {
        meshgrad_tensor::bail!(
            "reference mode: linear of {in_f} input features cannot take {in_chunks} input \
             chunk(s){}",
            if bias.is_some() { " with a bias" } else { "" }
        );
    }
    let mut covered: Vec<Range<usize>> = out_units.iter().flatten().cloned().collect();
    covered.sort_by_key(|r| r.start);
    let mut end = 0;
    for r in &covered {
        if r.start != end || r.is_empty() {
            end = usize::MAX;
            break;
        }
        end = r.end;
    }
    if end != out_f {
        meshgrad_tensor::bail!(
            "reference mode: the output units {out_units:?} do not partition 0..{out_f}"
        );
    }
    let ic = in_f / in_chunks;
    let chunk = |t: &Tensor, i: usize| -> Result<Tensor> {
        if in_chunks == 1 {
            Ok(t.clone())
        } else {
            t.narrow(-1, i * ic, ic)?.contiguous()
        }
    };
    let xs: Vec<Tensor> = (0..in_chunks)
        .map(|i| chunk(&xt, i))
        .collect::<Result<_>>()?;
    // w_blocks[o][i]: unit o's rows, chunk i's columns.
    let w_blocks: Vec<Vec<Tensor>> = out_units
        .iter()
        .map(|ranges| {
            let wo = gather_ranges(&wt, 0, ranges)?;
            (0..in_chunks).map(|i| chunk(&wo, i)).collect()
        })
        .collect::<Result<_>>()?;
    let bt = bias.map(|b| b.tensor().clone());
    let ys: Vec<Tensor> = out_units
        .iter()
        .zip(&w_blocks)
        .map(|(ranges, wo)| {
            let bo = bt
                .as_ref()
                .map(|b| gather_ranges(b, 0, ranges))
                .transpose()?;
            let parts: Vec<Tensor> = xs
                .iter()
                .zip(wo)
                .map(|(xi, woi)| xi.linear(woi, bo.as_ref()))
                .collect::<Result<_>>()?;
            tree_sum(&parts)
        })
        .collect::<Result<_>>()?;
    let y = scatter_units(&ys, -1, out_units)?;
    let mut inputs: Vec<&Var> = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    let units = out_units.to_vec();
    Ok(Var::from_op(
        "unit_linear",
        y,
        &inputs,
        Box::new(move |g, wanted| {
            let want_b = has_bias && wanted[2];
            let mut dx_parts: Vec<Vec<Tensor>> = vec![Vec::new(); in_chunks];
            let (mut dw_units, mut db_units) = (Vec::new(), Vec::new());
            for (ranges, wo) in units.iter().zip(&w_blocks) {
                let go = gather_ranges(g, -1, ranges)?;
                let mut dw_row = Vec::new();
                for (i, (xi, woi)) in xs.iter().zip(wo).enumerate() {
                    let (dx, dw, db) =
                        xi.linear_backward(woi, &go, (wanted[0], wanted[1], want_b && i == 0))?;
                    dx_parts[i].extend(dx);
                    dw_row.extend(dw);
                    db_units.extend(db);
                }
                if wanted[1] {
                    let refs: Vec<&Tensor> = dw_row.iter().collect();
                    dw_units.push(if refs.len() == 1 {
                        dw_row[0].clone()
                    } else {
                        Tensor::cat(&refs, 1)?
                    });
                }
            }
            let dx = if wanted[0] {
                let sums: Vec<Tensor> = dx_parts
                    .iter()
                    .map(|p| tree_sum(p))
                    .collect::<Result<_>>()?;
                let refs: Vec<&Tensor> = sums.iter().collect();
                Some(if refs.len() == 1 {
                    sums[0].clone()
                } else {
                    Tensor::cat(&refs, -1)?
                })
            } else {
                None
            };
            let dw = if wanted[1] {
                Some(scatter_units(&dw_units, 0, &units)?)
            } else {
                None
            };
            let mut grads = vec![dx, dw];
            if has_bias {
                grads.push(if want_b {
                    Some(scatter_units(&db_units, 0, &units)?)
                } else {
                    None
                });
            }
            Ok(grads)
        }),
    ))
}

/// Position chunk `k` of `t [B, T, ...]` (chunks of `len` positions along dimension 1), as a
/// contiguous copy.
fn positions(t: &Tensor, k: usize, len: usize) -> Result<Tensor> {
    t.narrow(1, k * len, len)?.contiguous()
}

/// Whether `x` is `[B, T, C]` with `T` cut into `chunks` equal chunks (reference mode's training
/// sequences always are; generation's shorter contexts need not be, and are taken whole).
fn splits_positions(x: &Tensor, chunks: usize) -> bool {
    x.rank() == 3 && chunks > 1 && x.dims()[1].is_multiple_of(chunks)
}

/// Layer norm of `x [B, T, C]` whose parameter gradients are trees over `chunks` equal chunks of
/// positions: each chunk `[B, T / chunks, C]` is normalised (and back-propagated) by its own
/// kernel call, its `dweight`, `dbias` summed over its rows, and the chunks' sums added over
/// their aligned binary tree. Every row's output and input gradient are the plain layer norm's.
/// An input whose positions do not split is normalised whole.
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
    let len = xt.dims()[1] / chunks;
    let w = weight.tensor().clone();
    let b = bias.map(|b| b.tensor().clone());
    let mut ys = Vec::with_capacity(chunks);
    let mut stats = Vec::with_capacity(chunks);
    for k in 0..chunks {
        let out = positions(&xt, k, len)?.layer_norm(Some(&w), b.as_ref(), eps)?;
        ys.push(out.y);
        stats.push((out.mean, out.rstd));
    }
    let refs: Vec<&Tensor> = ys.iter().collect();
    let y = Tensor::cat(&refs, 1)?;
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

/// `x Wᵀ (+ bias)` for `x [B, T, C]` (a replicated, sequence-parallel layer) whose parameter
/// gradients are trees over `chunks` equal chunks of positions: each chunk `[B, T / chunks, C]`
/// is its own product (forward and backward, the same shapes on every layout), and the chunks'
/// weight and bias gradients are added over their aligned binary tree. An input whose positions
/// do not split is computed whole.
pub fn linear_positions(x: &Var, weight: &Var, bias: Option<&Var>, chunks: usize) -> Result<Var> {
    let xt = x.tensor().clone();
    if !splits_positions(&xt, chunks) {
        return Var::linear(x, weight, bias);
    }
    let len = xt.dims()[1] / chunks;
    let w = weight.tensor().clone();
    let b = bias.map(|b| b.tensor().clone());
    let ys: Vec<Tensor> = (0..chunks)
        .map(|k| positions(&xt, k, len)?.linear(&w, b.as_ref()))
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = ys.iter().collect();
    let y = Tensor::cat(&refs, 1)?;
    let mut inputs: Vec<&Var> = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    Ok(Var::from_op(
        "linear_positions",
        y,
        &inputs,
        Box::new(move |g, wanted| {
            let want_b = has_bias && wanted[2];
            let (mut dxs, mut dws, mut dbs) = (Vec::new(), Vec::new(), Vec::new());
            for k in 0..chunks {
                let (dx, dw, db) = positions(&xt, k, len)?.linear_backward(
                    &w,
                    &positions(g, k, len)?,
                    (wanted[0], wanted[1], want_b),
                )?;
                dxs.extend(dx);
                dws.extend(dw);
                dbs.extend(db);
            }
            let dx = if wanted[0] {
                let refs: Vec<&Tensor> = dxs.iter().collect();
                Some(Tensor::cat(&refs, 1)?.reshape(xt.dims().to_vec())?)
            } else {
                None
            };
            let dw = if wanted[1] {
                Some(tree_sum(&dws)?)
            } else {
                None
            };
            let mut grads = vec![dx, dw];
            if has_bias {
                grads.push(if want_b { Some(tree_sum(&dbs)?) } else { None });
            }
            Ok(grads)
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_tensor::{DType, Device, Random};

    fn rand(seed: u64, dims: &[usize]) -> Tensor {
        Random::new(seed)
            .dtype(DType::F32)
            .normal(dims.to_vec(), 0.0, 1.0)
            .unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// Plain f64 loops: `x Wᵀ + b` and its gradients for `dy`, to compare within rounding.
    fn close(a: &Tensor, b: &[f64], what: &str) {
        let a = a.to_vec_f64().unwrap();
        assert_eq!(a.len(), b.len(), "{what}");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    #[test]
    fn column_units_interleave_the_blocks() {
        let u = column_units(12, 3, 2).unwrap();
        assert_eq!(u, vec![vec![0..2, 4..6, 8..10], vec![2..4, 6..8, 10..12]]);
        assert!(column_units(10, 3, 2).is_err());
    }

    /// The unit linear against plain f64 arithmetic, for column units (q/k/v style) and row
    /// chunks, forward and all three gradients.
    #[test]
    fn unit_linear_matches_an_independent_computation() {
        let (rows, inp, out) = (5, 8, 12);
        let x = rand(1, &[rows, inp]);
        let w = rand(2, &[out, inp]);
        let b = rand(3, &[out]);
        let dy = rand(4, &[rows, out]);
        let (xv, wv, bv, gv) = (
            x.to_vec_f64().unwrap(),
            w.to_vec_f64().unwrap(),
            b.to_vec_f64().unwrap(),
            dy.to_vec_f64().unwrap(),
        );
        for (units, chunks, with_bias) in [
            (column_units(out, 3, 2).unwrap(), 1, true),
            (column_units(out, 1, 4).unwrap(), 1, false),
            (column_units(out, 1, 1).unwrap(), 4, false),
        ] {
            let (xa, wa, ba) = (
                Var::leaf(x.clone()),
                Var::leaf(w.clone()),
                Var::leaf(b.clone()),
            );
            let y = unit_linear(&xa, &wa, with_bias.then_some(&ba), &units, chunks).unwrap();
            let bias = |j: usize| if with_bias { bv[j] } else { 0.0 };
            let want_y: Vec<f64> = (0..rows * out)
                .map(|e| {
                    let (i, j) = (e / out, e % out);
                    bias(j)
                        + (0..inp)
                            .map(|k| xv[i * inp + k] * wv[j * inp + k])
                            .sum::<f64>()
                })
                .collect();
            close(y.tensor(), &want_y, "y");
            y.mul(&Var::constant(dy.clone()))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let dx: Vec<f64> = (0..rows * inp)
                .map(|e| {
                    let (i, k) = (e / inp, e % inp);
                    (0..out).map(|j| gv[i * out + j] * wv[j * inp + k]).sum()
                })
                .collect();
            let dw: Vec<f64> = (0..out * inp)
                .map(|e| {
                    let (j, k) = (e / inp, e % inp);
                    (0..rows).map(|i| gv[i * out + j] * xv[i * inp + k]).sum()
                })
                .collect();
            close(&xa.grad().unwrap(), &dx, "dx");
            close(&wa.grad().unwrap(), &dw, "dw");
            if with_bias {
                let db: Vec<f64> = (0..out)
                    .map(|j| (0..rows).map(|i| gv[i * out + j]).sum())
                    .collect();
                close(&ba.grad().unwrap(), &db, "db");
            }
        }
    }

    /// A rank's half of a row-parallel unit linear, tree-added with the other half, is the
    /// one-device result bit for bit (the tree over 4 chunks = (rank 0's 2) + (rank 1's 2)).
    #[test]
    fn row_chunks_split_over_ranks_add_up_to_the_whole() {
        let (x, w) = (rand(5, &[3, 7, 16]), rand(6, &[10, 16]));
        let whole = unit_linear(
            &Var::constant(x.clone()),
            &Var::constant(w.clone()),
            None,
            &column_units(10, 1, 1).unwrap(),
            4,
        )
        .unwrap();
        let half = |r: usize| {
            unit_linear(
                &Var::constant(x.narrow(-1, r * 8, 8).unwrap().contiguous().unwrap()),
                &Var::constant(w.narrow(1, r * 8, 8).unwrap().contiguous().unwrap()),
                None,
                &column_units(10, 1, 1).unwrap(),
                2,
            )
            .unwrap()
            .tensor()
            .clone()
        };
        let split = half(0).add(&half(1)).unwrap();
        assert_eq!(bits(whole.tensor()), bits(&split));
    }

    #[test]
    fn position_chunked_norm_and_bias_match_the_plain_ops() {
        let x = rand(7, &[2, 8, 6]);
        let (w, b) = (rand(8, &[6]), rand(9, &[6]));
        let dy = rand(10, &[2, 8, 6]);
        let run = |chunked: bool| {
            let (xa, wa, ba) = (
                Var::leaf(x.clone()),
                Var::leaf(w.clone()),
                Var::leaf(b.clone()),
            );
            let y = if chunked {
                let n = layer_norm_positions(&xa, &wa, Some(&ba), 1e-5, 4).unwrap();
                add_bias_positions(&n, &ba, 4).unwrap()
            } else {
                let n = xa.layer_norm(Some(&wa), Some(&ba), 1e-5).unwrap();
                n.add(&ba).unwrap()
            };
            let out = y.tensor().to_vec_f64().unwrap();
            y.mul(&Var::constant(dy.clone()))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (
                out,
                xa.grad().unwrap(),
                wa.grad().unwrap(),
                ba.grad().unwrap(),
            )
        };
        let (y0, dx0, dw0, db0) = run(false);
        let (y1, dx1, dw1, db1) = run(true);
        assert_eq!(y0, y1, "outputs are per row");
        assert_eq!(bits(&dx0), bits(&dx1), "input gradients are per row");
        close(&dw1, &dw0.to_vec_f64().unwrap(), "dweight");
        close(&db1, &db0.to_vec_f64().unwrap(), "dbias");
    }

    /// The position-chunked linear against plain f64 loops (output and all three gradients),
    /// and its weight gradient split over two "ranks" of half the positions each, tree-added,
    /// against the whole bit for bit.
    #[test]
    fn position_chunked_linear_matches_an_independent_computation() {
        let (b, t, inp, out) = (2, 8, 6, 5);
        let x = rand(12, &[b, t, inp]);
        let w = rand(13, &[out, inp]);
        let bias = rand(14, &[out]);
        let dy = rand(15, &[b, t, out]);
        let (xa, wa, ba) = (
            Var::leaf(x.clone()),
            Var::leaf(w.clone()),
            Var::leaf(bias.clone()),
        );
        let y = linear_positions(&xa, &wa, Some(&ba), 4).unwrap();
        let (xv, wv, bv, gv) = (
            x.to_vec_f64().unwrap(),
            w.to_vec_f64().unwrap(),
            bias.to_vec_f64().unwrap(),
            dy.to_vec_f64().unwrap(),
        );
        let rows = b * t;
        let want_y: Vec<f64> = (0..rows * out)
            .map(|e| {
                let (i, j) = (e / out, e % out);
                bv[j]
                    + (0..inp)
                        .map(|k| xv[i * inp + k] * wv[j * inp + k])
                        .sum::<f64>()
            })
            .collect();
        close(y.tensor(), &want_y, "y");
        y.mul(&Var::constant(dy.clone()))
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dx: Vec<f64> = (0..rows * inp)
            .map(|e| {
                let (i, k) = (e / inp, e % inp);
                (0..out).map(|j| gv[i * out + j] * wv[j * inp + k]).sum()
            })
            .collect();
        let dw: Vec<f64> = (0..out * inp)
            .map(|e| {
                let (j, k) = (e / inp, e % inp);
                (0..rows).map(|i| gv[i * out + j] * xv[i * inp + k]).sum()
            })
            .collect();
        let db: Vec<f64> = (0..out)
            .map(|j| (0..rows).map(|i| gv[i * out + j]).sum())
            .collect();
        close(&xa.grad().unwrap(), &dx, "dx");
        close(&wa.grad().unwrap(), &dw, "dw");
        close(&ba.grad().unwrap(), &db, "db");
        // Two halves of the positions (2 chunks each), their weight gradients tree-added.
        let half = |r: usize| {
            let (xh, wh) = (
                Var::constant(x.narrow(1, r * 4, 4).unwrap().contiguous().unwrap()),
                Var::leaf(w.clone()),
            );
            let g = dy.narrow(1, r * 4, 4).unwrap().contiguous().unwrap();
            linear_positions(&xh, &wh, None, 2)
                .unwrap()
                .mul(&Var::constant(g))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            wh.grad().unwrap()
        };
        let split = half(0).add(&half(1)).unwrap();
        assert_eq!(bits(&wa.grad().unwrap()), bits(&split));
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
        let loss =
            super::super::vocab_parallel_cross_entropy_chunked(&xa, &targets, Some(-1), &tp, 4)
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
