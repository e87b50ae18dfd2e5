//! Reference mode's linears: every product of a split linear has the same shapes and operand
//! layouts on every layout, whatever share of the units or chunks a rank holds.
//!
//! A rank's products are computed by batched matmuls over its pieces (units of output
//! features, or chunks of input features): the operands are views or one copy each into
//! piece-major order (`[pieces, rows, width]`), so every piece's matrix has the row and column
//! strides a contiguous matrix of its own shape has, on one device as on any rank, and each
//! product is the same gemm call. No batch is ever folded into one taller product (which would
//! make a product's shape depend on the rank's share). Results go back to the feature-major
//! order by one copy per tensor (or need none: a column-parallel weight gradient is piece-major
//! already). No weight is copied but a row-parallel one (into chunk-major order).
//!
//! Products run whole on one thread each (a matmul called inside a rayon task does), side by
//! side on rayon tasks: the forward's pieces in groups, the backward's input and weight
//! gradients as two tasks. Which thread computes a product never changes its bits.

use meshgrad_autograd::Var;
use meshgrad_tensor::tree_sum::tree_sum;
use meshgrad_tensor::{Result, Tensor};

use super::{positions, splits_positions};

/// The rows of `x [..., in]` as a contiguous matrix `[rows, in]`, checked against a weight of
/// `in_f` input features.
fn rows_of(op: &str, x: &Tensor, weight: &Tensor) -> Result<(Tensor, usize)> {
    let in_f = weight.dims()[1];
    if x.rank() < 1 || x.dims().last() != Some(&in_f) {
        meshgrad_tensor::bail!(
            "reference mode: {op} input of shape {} does not end in the weight's {in_f} input \
             features (weight {})",
            x.shape(),
            weight.shape()
        );
    }
    let rows = x.elem_count() / in_f.max(1);
    Ok((x.contiguous()?.reshape((rows, in_f))?, rows))
}

/// `x`'s dims with the last one replaced by `last`.
fn dims_with_last(x: &Tensor, last: usize) -> Vec<usize> {
    let mut d = x.dims().to_vec();
    if let Some(l) = d.last_mut() {
        *l = last;
    }
    d
}

/// `t [p, ...]` cut into its `p` pieces along dimension 0 (views).
fn pieces(t: &Tensor) -> Result<Vec<Tensor>> {
    (0..t.dims()[0]).map(|p| t.narrow(0, p, 1)).collect()
}

/// The batched `a [batch, m, k] x b [batch, k, n]` (either batch may be 1, broadcast) with the
/// batch cut into groups of `size` consecutive products (the last one possibly shorter), each
/// group computed on its own rayon task, each product whole on its thread, and `then(result,
/// start)` applied to each group's result `[group, m, n]` (whose first product is product
/// `start`) on the same task: the groups' outputs, in order.
fn matmul_groups(
    a: &Tensor,
    b: &Tensor,
    size: usize,
    then: impl Fn(Tensor, usize) -> Result<Tensor> + Sync,
) -> Result<Vec<Tensor>> {
    use rayon::prelude::*;
    // A materialiser (a ZeRO-3 parameter's gather) must run on this thread, not a pool thread.
    for t in [a, b] {
        t.ensure_materialized()?;
    }
    let batch = a.dims()[0].max(b.dims()[0]);
    let size = size.max(1);
    let side = |t: &Tensor, start: usize, len: usize| {
        if t.dims()[0] == 1 {
            Ok(t.clone())
        } else {
            t.narrow(0, start, len)
        }
    };
    let ctx = meshgrad_tensor::alloc::AllocContext::capture();
    (0..batch.div_ceil(size))
        .into_par_iter()
        .map(|g| {
            ctx.run(|| {
                let (start, end) = (g * size, ((g + 1) * size).min(batch));
                let product = side(a, start, end - start)?.matmul(&side(b, start, end - start)?)?;
                then(product, start)
            })
        })
        .collect()
}

/// Products per group for `batch` products spread over the rayon threads.
fn group_size(batch: usize) -> usize {
    batch.div_ceil(rayon::current_num_threads().max(1))
}

/// Runs `f` and `g` side by side on two rayon tasks (each product inside runs whole on its
/// thread), after making the storage of every tensor in `reads` present on this thread.
fn both<A: Send, B: Send>(
    reads: &[&Tensor],
    f: impl FnOnce() -> Result<A> + Send,
    g: impl FnOnce() -> Result<B> + Send,
) -> Result<(A, B)> {
    for t in reads {
        t.ensure_materialized()?;
    }
    let (a, b) = meshgrad_tensor::alloc::join(f, g);
    Ok((a?, b?))
}

/// Piece-major products `[group, rows, width]` whose first piece is piece `start`, in
/// feature-major order `[rows, group, width]` (contiguous), with their pieces of `bias [pieces,
/// width]` added when given.
fn feature_major(products: Tensor, start: usize, bias: Option<&Tensor>) -> Result<Tensor> {
    let view = products.permute(&[1, 0, 2])?;
    match bias {
        Some(b) => view.add(&b.narrow(0, start, products.dims()[0])?),
        None => view.contiguous(),
    }
}

/// `dW_p = dy_pᵀ x` for every piece `p` of `gp [pieces, rows, width]` and `x [rows, in]`, as
/// `[pieces, width, in]`: one batched matmul, except where the matmul would fold the pieces
/// into one taller product (a width or a row count of 1), which would make the product's shape
/// depend on how many pieces a rank holds; there, one product per piece.
fn piece_weight_grads(gp: &Tensor, x: &Tensor) -> Result<Tensor> {
    let (rows, width) = (gp.dims()[1], gp.dims()[2]);
    if rows > 1 && width > 1 {
        return gp.transpose(1, 2)?.matmul(&x.unsqueeze(0)?);
    }
    let per_piece: Vec<Tensor> = pieces(gp)?
        .iter()
        .map(|p| p.transpose(1, 2)?.matmul(&x.unsqueeze(0)?))
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = per_piece.iter().collect();
    Tensor::cat(&refs, 0)
}

/// A column-parallel linear `x Wᵀ (+ bias)` in reference mode, for `weight [out, in]` whose
/// `out` local output features are `blocks` equal blocks (3 for a fused q/k/v projection) of
/// `units` units each.
///
/// The output features are cut into `blocks x units` pieces of `out / (blocks units)` rows
/// each, block-major (piece `c units + j` is unit `j`'s slice of block `c`; unit `j` of q/k/v
/// is the same heads of q, of k and of v). Forward: each piece's `x W_pᵀ`, `[rows, in] x [in,
/// out / (blocks units)]`, then its bias added. Backward: `dW_p = dy_pᵀ x` and `dbias_p = Σ_rows
/// dy_p` per piece; `dx` is, for each unit, the tree over its blocks of `dy_p W_p`, and the tree
/// over the units of those. A rank of a group of `T` holds `units` = `K / T` of the model's `K`
/// units, each with the pieces one device computes for it, so the rank's `dx` is the subtree
/// of its units and the group's all-reduce completes the one-device tree.
pub fn column_linear(
    x: &Var,
    weight: &Var,
    bias: Option<&Var>,
    blocks: usize,
    units: usize,
) -> Result<Var> {
    let wt = weight.tensor().contiguous()?;
    if wt.rank() != 2 {
        meshgrad_tensor::bail!(
            "reference mode: column linear weight must be [out, in], got {}",
            wt.shape()
        );
    }
    let (out_f, in_f) = (wt.dims()[0], wt.dims()[1]);
    let blocks = blocks.max(1);
    let count = blocks * units;
    if units == 0 || !out_f.is_multiple_of(count) {
        meshgrad_tensor::bail!(
            "reference mode: a column linear's {out_f} output features (weight {}) do not split \
             into {blocks} block(s) x {units} unit(s)",
            wt.shape()
        );
    }
    let xt = x.tensor().clone();
    let (x2, rows) = rows_of("column linear", &xt, &wt)?;
    let width = out_f / count;
    // [pieces, width, in]: piece p is rows p width .. (p + 1) width of the weight (a view).
    let w3 = wt.reshape((count, width, in_f))?;
    // [pieces, rows, width] in groups, then [rows, pieces, width] = [rows, out].
    let b = bias
        .map(|b| b.tensor().reshape((count, width)))
        .transpose()?;
    if let Some(b) = &b {
        b.ensure_materialized()?;
    }
    let groups = matmul_groups(
        &x2.unsqueeze(0)?,
        &w3.transpose(1, 2)?,
        group_size(count),
        |p, start| feature_major(p, start, b.as_ref()),
    )?;
    let y = match groups.as_slice() {
        [one] => one.clone(),
        many => Tensor::cat(&many.iter().collect::<Vec<_>>(), 1)?,
    };
    let y = y.reshape(dims_with_last(&xt, out_f))?;
    let mut inputs: Vec<&Var> = vec![x, weight];
    inputs.extend(bias);
    let has_bias = bias.is_some();
    Ok(Var::from_op(
        "column_linear",
        y,
        &inputs,
        Box::new(move |g, wanted| {
            // [pieces, rows, width]: piece p's output gradient as a contiguous matrix.
            let gp = g
                .contiguous()?
                .reshape((rows, count, width))?
                .permute(&[1, 0, 2])?
                .contiguous()?;
            let (dx, dw) = both(
                &[&gp, &w3, &x2],
                || {
                    if !wanted[0] {
                        return Ok(None);
                    }
                    let per_piece = pieces(&gp.matmul(&w3)?)?; // [rows, in] each
                    let per_unit: Vec<Tensor> = (0..units)
                        .map(|j| {
                            let blocks_of_j: Vec<Tensor> = (0..blocks)
                                .map(|c| per_piece[c * units + j].clone())
                                .collect();
                            tree_sum(&blocks_of_j)
                        })
                        .collect::<Result<_>>()?;
                    Ok(Some(tree_sum(&per_unit)?.reshape(xt.shape().clone())?))
                },
                || {
                    if !wanted[1] {
                        return Ok(None);
                    }
                    // [pieces, width, in] is the weight's [out, in] order already.
                    Ok(Some(piece_weight_grads(&gp, &x2)?.reshape((out_f, in_f))?))
                },
            )?;
            let mut grads = vec![dx, dw];
            if has_bias {
                grads.push(if wanted[2] {
                    Some(gp.sum(&[1], false)?.reshape(out_f)?)
                } else {
                    None
                });
            }
            Ok(grads)
        }),
    ))
}

/// A row-parallel linear's partial product `x Wᵀ` in reference mode (no bias: it is added after
/// the group's sum), for `weight [out, in]` whose `in` local input features are `chunks` equal
/// chunks.
///
/// Forward: the tree over the chunks `i` of `x_i W_iᵀ` (`[rows, in / chunks] x [in / chunks,
/// out]`). Backward: `dx_i = dy W_i` and `dW_i = dyᵀ x_i`, placed at chunk `i`'s columns. A rank
/// of a group of `T` holds `K / T` of the model's `K` chunks, so its sum is the subtree of its
/// chunks and the group's all-reduce completes the one-device tree.
pub fn row_linear(x: &Var, weight: &Var, chunks: usize) -> Result<Var> {
    let wt = weight.tensor().contiguous()?;
    if wt.rank() != 2 {
        meshgrad_tensor::bail!(
            "reference mode: row linear weight must be [out, in], got {}",
            wt.shape()
        );
    }
    let (out_f, in_f) = (wt.dims()[0], wt.dims()[1]);
    if chunks == 0 || !in_f.is_multiple_of(chunks) {
        meshgrad_tensor::bail!(
            "reference mode: a row linear's {in_f} input features (weight {}) do not split into \
             {chunks} chunk(s)",
            wt.shape()
        );
    }
    let xt = x.tensor().clone();
    let (x2, rows) = rows_of("row linear", &xt, &wt)?;
    let width = in_f / chunks;
    // Chunk-major copies: [chunks, rows, width] and [chunks, out, width].
    let chunk_major = |t: &Tensor, n: usize| -> Result<Tensor> {
        t.reshape((n, chunks, width))?
            .permute(&[1, 0, 2])?
            .contiguous()
    };
    let (xp, wp) = both(
        &[&x2, &wt],
        || chunk_major(&x2, rows),
        || chunk_major(&wt, out_f),
    )?;
    // [chunks, rows, out] in groups of a power of two of chunks, each group's tree summed on its
    // task: an aligned block of the tree's leaves, so the groups' sums are subtrees of the tree
    // over all chunks, and the tree over the groups' sums is that tree.
    let size = group_size(chunks).next_power_of_two();
    let per_group = matmul_groups(&xp, &wp.transpose(1, 2)?, size, |p, _| {
        tree_sum(&pieces(&p)?)
    })?;
    let y = tree_sum(&per_group)?.reshape(dims_with_last(&xt, out_f))?;
    Ok(Var::from_op(
        "row_linear",
        y,
        &[x, weight],
        Box::new(move |g, wanted| {
            let g2 = g.contiguous()?.reshape((1, rows, out_f))?;
            let (dx, dw) = both(
                &[&g2, &wp, &xp],
                || {
                    if !wanted[0] {
                        return Ok(None);
                    }
                    let dxp = g2.matmul(&wp)?; // [chunks, rows, width]
                    let dx = dxp.permute(&[1, 0, 2])?.contiguous()?;
                    Ok(Some(dx.reshape(xt.shape().clone())?))
                },
                || {
                    if !wanted[1] {
                        return Ok(None);
                    }
                    let dwp = g2.transpose(1, 2)?.matmul(&xp)?; // [chunks, out, width]
                    let dw = dwp.permute(&[1, 0, 2])?.contiguous()?;
                    Ok(Some(dw.reshape((out_f, in_f))?))
                },
            )?;
            Ok(vec![dx, dw])
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
    use super::super::test_support::{bits, close, rand, run};
    use super::*;

    /// Plain f64 loops for `y = x Wᵀ + b` over `rows` rows and the gradients for `dy`:
    /// `(y, dx, dw, db)`.
    #[allow(clippy::type_complexity)]
    fn reference(
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        dy: &Tensor,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (out, inp) = (w.dims()[0], w.dims()[1]);
        let rows = x.elem_count() / inp;
        let (xv, wv, gv) = (
            x.to_vec_f64().unwrap(),
            w.to_vec_f64().unwrap(),
            dy.to_vec_f64().unwrap(),
        );
        let bv = b.map(|b| b.to_vec_f64().unwrap());
        let y = (0..rows * out)
            .map(|e| {
                let (i, j) = (e / out, e % out);
                bv.as_ref().map_or(0.0, |b| b[j])
                    + (0..inp)
                        .map(|k| xv[i * inp + k] * wv[j * inp + k])
                        .sum::<f64>()
            })
            .collect();
        let dx = (0..rows * inp)
            .map(|e| {
                let (i, k) = (e / inp, e % inp);
                (0..out).map(|j| gv[i * out + j] * wv[j * inp + k]).sum()
            })
            .collect();
        let dw = (0..out * inp)
            .map(|e| {
                let (j, k) = (e / inp, e % inp);
                (0..rows).map(|i| gv[i * out + j] * xv[i * inp + k]).sum()
            })
            .collect();
        let db = (0..out)
            .map(|j| (0..rows).map(|i| gv[i * out + j]).sum())
            .collect();
        (y, dx, dw, db)
    }

    /// Both linears against plain f64 arithmetic: column pieces (q/k/v style with a bias, plain
    /// units, one unit, and pieces one feature wide) and row chunks, forward and all gradients.
    #[test]
    fn linears_match_an_independent_computation() {
        let (inp, out) = (8, 12);
        let x = rand(1, &[2, 3, inp]);
        let w = rand(2, &[out, inp]);
        let b = rand(3, &[out]);
        let dy = rand(4, &[2, 3, out]);
        let (y, dx, dw, db) = reference(&x, &w, Some(&b), &dy);
        let (y0, dx0, dw0, _) = reference(&x, &w, None, &dy);
        for (blocks, units, with_bias) in [(3, 2, true), (1, 4, false), (1, 1, true), (3, 4, true)]
        {
            let bias = with_bias.then_some(&b);
            let got = run(&x, &w, bias, &dy, |x, w, b| {
                column_linear(x, w, b, blocks, units)
            });
            let what = format!("column {blocks}x{units}");
            let (wy, wdx, wdw) = if with_bias {
                (&y, &dx, &dw)
            } else {
                (&y0, &dx0, &dw0)
            };
            close(&got.0, wy, &format!("{what} y"));
            close(&got.1, wdx, &format!("{what} dx"));
            close(&got.2, wdw, &format!("{what} dw"));
            if with_bias {
                close(got.3.as_ref().unwrap(), &db, &format!("{what} db"));
            }
        }
        for chunks in [1, 2, 4] {
            let got = run(&x, &w, None, &dy, |x, w, _| row_linear(x, w, chunks));
            close(&got.0, &y0, &format!("row {chunks} y"));
            close(&got.1, &dx0, &format!("row {chunks} dx"));
            close(&got.2, &dw0, &format!("row {chunks} dw"));
        }
        // One row.
        let (x1, dy1) = (rand(5, &[1, inp]), rand(6, &[1, out]));
        let (y1, dx1, dw1, db1) = reference(&x1, &w, Some(&b), &dy1);
        let got = run(&x1, &w, Some(&b), &dy1, |x, w, b| {
            column_linear(x, w, b, 3, 4)
        });
        close(&got.0, &y1, "one row y");
        close(&got.1, &dx1, "one row dx");
        close(&got.2, &dw1, "one row dw");
        close(got.3.as_ref().unwrap(), &db1, "one row db");
    }

    /// The position-chunked linear against plain f64 loops (output and all three gradients),
    /// and its weight gradient over two halves of the positions (2 chunks each), tree-added,
    /// against the whole (4 chunks) bit for bit.
    #[test]
    fn position_chunked_linear_matches_an_independent_computation() {
        let (x, w, b, dy) = (
            rand(12, &[2, 8, 6]),
            rand(13, &[5, 6]),
            rand(14, &[5]),
            rand(15, &[2, 8, 5]),
        );
        let got = run(&x, &w, Some(&b), &dy, |x, w, b| {
            linear_positions(x, w, b, 4)
        });
        let (y, dx, dw, db) = reference(&x, &w, Some(&b), &dy);
        close(&got.0, &y, "y");
        close(&got.1, &dx, "dx");
        close(&got.2, &dw, "dw");
        close(got.3.as_ref().unwrap(), &db, "db");
        let half = |r: usize| {
            let part = |t: &Tensor| t.narrow(1, r * 4, 4).unwrap().contiguous().unwrap();
            run(&part(&x), &w, None, &part(&dy), |x, w, _| {
                linear_positions(x, w, None, 2)
            })
            .2
        };
        let split = half(0).add(&half(1)).unwrap();
        assert_eq!(bits(&got.2), bits(&split));
    }

    /// Rows `ranges` of `t` along `dim`, side by side (a contiguous copy).
    fn take(t: &Tensor, dim: isize, ranges: &[(usize, usize)]) -> Tensor {
        let parts: Vec<Tensor> = ranges
            .iter()
            .map(|&(s, l)| t.narrow(dim, s, l).unwrap())
            .collect();
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, dim).unwrap().contiguous().unwrap()
    }

    /// A q/k/v column linear split over two ranks (each the same 2 of the 4 units of q, of k and
    /// of v) is the one-device linear bit for bit: each rank's output, weight and bias gradients
    /// are the one-device ones at its features, and the two ranks' input gradients add up (the
    /// top of the tree over the 4 units) to the one-device input gradient.
    #[test]
    fn column_pieces_split_over_ranks_are_the_whole() {
        let (inp, out) = (16, 24); // 3 blocks of 8 = 4 units of 2 features each
        let x = rand(7, &[2, 5, inp]);
        let w = rand(8, &[out, inp]);
        let b = rand(9, &[out]);
        let dy = rand(10, &[2, 5, out]);
        let whole = run(&x, &w, Some(&b), &dy, |x, w, b| {
            column_linear(x, w, b, 3, 4)
        });
        let rank =
            |r: usize| -> Vec<(usize, usize)> { (0..3).map(|c| (c * 8 + r * 4, 4)).collect() };
        let half = |r: usize| {
            run(
                &x,
                &take(&w, 0, &rank(r)),
                Some(&take(&b, 0, &rank(r))),
                &take(&dy, -1, &rank(r)),
                |x, w, b| column_linear(x, w, b, 3, 2),
            )
        };
        let (h0, h1) = (half(0), half(1));
        for (r, h) in [(0, &h0), (1, &h1)] {
            assert_eq!(
                bits(&h.0),
                bits(&take(&whole.0, -1, &rank(r))),
                "y of rank {r}"
            );
            assert_eq!(
                bits(&h.2),
                bits(&take(&whole.2, 0, &rank(r))),
                "dw of rank {r}"
            );
            let db = take(whole.3.as_ref().unwrap(), 0, &rank(r));
            assert_eq!(bits(h.3.as_ref().unwrap()), bits(&db), "db of rank {r}");
        }
        assert_eq!(bits(&whole.1), bits(&h0.1.add(&h1.1).unwrap()), "dx");
    }

    /// A row linear split over two ranks (each 2 of the 4 chunks of input features) is the
    /// one-device linear bit for bit: the ranks' outputs add up (the top of the tree over the 4
    /// chunks) to the one-device output, and each rank's input and weight gradients are the
    /// one-device ones at its features.
    #[test]
    fn row_chunks_split_over_ranks_are_the_whole() {
        let (x, w) = (rand(11, &[3, 7, 16]), rand(12, &[10, 16]));
        let dy = rand(13, &[3, 7, 10]);
        let whole = run(&x, &w, None, &dy, |x, w, _| row_linear(x, w, 4));
        let half = |r: usize| {
            run(
                &x.narrow(-1, r * 8, 8).unwrap().contiguous().unwrap(),
                &w.narrow(1, r * 8, 8).unwrap().contiguous().unwrap(),
                None,
                &dy,
                |x, w, _| row_linear(x, w, 2),
            )
        };
        let (h0, h1) = (half(0), half(1));
        assert_eq!(bits(&whole.0), bits(&h0.0.add(&h1.0).unwrap()), "y");
        for (r, h) in [(0, &h0), (1, &h1)] {
            let dx = whole.1.narrow(-1, r * 8, 8).unwrap();
            assert_eq!(
                bits(&h.1),
                bits(&dx.contiguous().unwrap()),
                "dx of rank {r}"
            );
            let dw = whole.2.narrow(1, r * 8, 8).unwrap();
            assert_eq!(
                bits(&h.2),
                bits(&dw.contiguous().unwrap()),
                "dw of rank {r}"
            );
        }
    }

    /// The thread count (how the products are grouped onto tasks) changes no bit of either
    /// linear's output or gradients.
    #[test]
    fn linears_do_not_depend_on_the_thread_count() {
        let (x, w, b) = (rand(14, &[2, 6, 16]), rand(15, &[24, 16]), rand(16, &[24]));
        let (dy_col, dy_row) = (rand(17, &[2, 6, 24]), rand(18, &[2, 6, 24]));
        let all = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let c = run(&x, &w, Some(&b), &dy_col, |x, w, b| {
                    column_linear(x, w, b, 3, 4)
                });
                let r = run(&x, &w, None, &dy_row, |x, w, _| row_linear(x, w, 4));
                [c.0, c.1, c.2, c.3.unwrap(), r.0, r.1, r.2]
                    .iter()
                    .map(bits)
                    .collect::<Vec<_>>()
            })
        };
        let want = all(1);
        for threads in [2, 3, 4, 5] {
            assert!(all(threads) == want, "{threads} threads");
        }
    }
}
