//! Index-driven reads and their backward passes: `gather` (torch.gather semantics) with its
//! scatter-add, and `index_select` with its index-add.
//!
//! Every index is validated before anything is written; a bad one is an error naming its value,
//! its position, the dimension and that dimension's size. The backward passes accumulate in a
//! fixed order (increasing position along the indexed dimension for every destination element)
//! that does not depend on the number of threads: threads only split sets of destination
//! elements that no other task writes.

use rayon::prelude::*;

use super::embedding;
use super::strided::PAR_THRESHOLD;
use super::vecops::for_each_row;
use crate::{Float, KernelError};

/// Row-major multi-index of flat index `i` over `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        if dims[d] > 0 {
            idx[d] = i % dims[d];
            i /= dims[d];
        }
    }
    idx
}

/// Flat row-major index of the multi-index `idx` over `dims`.
fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |f, (&i, &d)| f * d + i)
}

/// Checks every index against `0..size`, naming the first bad one (its position as a
/// multi-index over `index_dims`).
fn check_indices(
    op: &str,
    index: &[i64],
    index_dims: &[usize],
    dim: usize,
    size: usize,
) -> Result<(), KernelError> {
    for (p, &v) in index.iter().enumerate() {
        if v < 0 || v as u64 >= size as u64 {
            return Err(KernelError(format!(
                "{op}: index {v} at position {:?} is out of range for dim {dim} of size {size}",
                unravel(p, index_dims)
            )));
        }
    }
    Ok(())
}

/// The shapes of a gather: `[outer, n, inner]` over the index, and the input's matching sizes.
struct GatherGeometry {
    /// Index dims before `dim`, multiplied.
    outer: usize,
    /// Index size along `dim`.
    n: usize,
    /// Index dims after `dim`, multiplied.
    inner: usize,
    /// Input size along `dim`.
    x_n: usize,
    /// Input dims after `dim`, multiplied.
    x_inner: usize,
    /// For each inner index position, the offset of the matching input element in an input
    /// `dim`-slice (the input's inner dims can be larger than the index's).
    x_inner_of: Vec<usize>,
}

impl GatherGeometry {
    fn new(op: &str, x_dims: &[usize], dim: usize, index_dims: &[usize]) -> Self {
        assert!(
            x_dims.len() == index_dims.len()
                && dim < x_dims.len()
                && x_dims
                    .iter()
                    .zip(index_dims)
                    .enumerate()
                    .all(|(k, (&a, &b))| k == dim || b <= a),
            "{op}: index dims {index_dims:?} do not fit input dims {x_dims:?} along dim {dim}"
        );
        let inner_dims = &index_dims[dim + 1..];
        let x_inner_dims = &x_dims[dim + 1..];
        let inner: usize = inner_dims.iter().product();
        let x_inner_of = if inner_dims == x_inner_dims {
            (0..inner).collect()
        } else {
            (0..inner)
                .map(|i| ravel(&unravel(i, inner_dims), x_inner_dims))
                .collect()
        };
        GatherGeometry {
            outer: index_dims[..dim].iter().product(),
            n: index_dims[dim],
            inner,
            x_n: x_dims[dim],
            x_inner: x_inner_dims.iter().product(),
            x_inner_of,
        }
    }
}

/// `torch.gather`: `out[p] = x[p with its coordinate along dim replaced by index[p]]` for every
/// position `p` of `index` (for rank 2 and `dim = 0`, `out[i][j] = x[index[i][j]][j]`).
///
/// `x` is contiguous with dims `x_dims`; `index` and `out` are contiguous with dims
/// `index_dims`, of the same rank as `x_dims` and no larger in any dim but `dim` (checked by the
/// caller; asserted here). An index outside `0..x_dims[dim]` is an error, raised before anything
/// is written.
pub fn gather<T: Copy + Send + Sync>(
    x: &[T],
    x_dims: &[usize],
    dim: usize,
    index: &[i64],
    index_dims: &[usize],
    out: &mut [T],
) -> Result<(), KernelError> {
    let g = GatherGeometry::new("gather", x_dims, dim, index_dims);
    assert!(
        x.len() == x_dims.iter().product::<usize>()
            && index.len() == g.outer * g.n * g.inner
            && out.len() == index.len(),
        "gather: x has {} elements, index {}, out {} (x dims {x_dims:?}, index dims {index_dims:?})",
        x.len(),
        index.len(),
        out.len()
    );
    check_indices("gather", index, index_dims, dim, g.x_n)?;
    let outer_dims = &index_dims[..dim];
    let x_outer_dims = &x_dims[..dim];
    // Output row r = (o, j) holds the `inner` elements at index positions (o, j, ..).
    for_each_row(
        out,
        g.inner,
        #[inline(always)]
        |r, row| {
            let o = r / g.n;
            let xo = if outer_dims == x_outer_dims {
                o
            } else {
                ravel(&unravel(o, outer_dims), x_outer_dims)
            };
            let slab = &x[xo * g.x_n * g.x_inner..(xo + 1) * g.x_n * g.x_inner];
            let ids = &index[r * g.inner..(r + 1) * g.inner];
            for ((d, &id), &xi) in row.iter_mut().zip(ids).zip(&g.x_inner_of) {
                *d = slab[id as usize * g.x_inner + xi];
            }
        },
    );
    Ok(())
}

/// The backward of [`gather`]: `dx[q] += Σ dout[p]` over the index positions `p` that read input
/// element `q` (a scatter-add), accumulated into `dx` (not zeroed first).
///
/// Shapes as in [`gather`], with `dx` shaped like the input. Each `dx` element receives its
/// contributions in increasing position order, whatever the thread count: tasks own whole
/// slabs of `dx` (one coordinate tuple of the dims before `dim`); a gather along dim 0 runs on
/// one thread.
pub fn gather_backward<T: Float>(
    dout: &[T],
    x_dims: &[usize],
    dim: usize,
    index: &[i64],
    index_dims: &[usize],
    dx: &mut [T],
) -> Result<(), KernelError> {
    let g = GatherGeometry::new("gather_backward", x_dims, dim, index_dims);
    assert!(
        dx.len() == x_dims.iter().product::<usize>()
            && index.len() == g.outer * g.n * g.inner
            && dout.len() == index.len(),
        "gather_backward: dx has {} elements, index {}, dout {} (x dims {x_dims:?}, index dims {index_dims:?})",
        dx.len(),
        index.len(),
        dout.len()
    );
    check_indices("gather_backward", index, index_dims, dim, g.x_n)?;
    let slab_len = g.x_n * g.x_inner;
    if slab_len == 0 || index.is_empty() {
        return Ok(());
    }
    let outer_dims = &index_dims[..dim];
    let x_outer_dims = &x_dims[..dim];
    // Slab xo of dx: its coordinates over the outer dims; skipped when the index does not reach
    // it (the index's outer dims can be smaller than the input's).
    let slab_fn = |xo: usize, slab: &mut [T]| {
        let o = if outer_dims == x_outer_dims {
            xo
        } else {
            let c = unravel(xo, x_outer_dims);
            if c.iter().zip(outer_dims).any(|(&a, &b)| a >= b) {
                return;
            }
            ravel(&c, outer_dims)
        };
        for j in 0..g.n {
            let p = (o * g.n + j) * g.inner;
            let (ids, src) = (&index[p..p + g.inner], &dout[p..p + g.inner]);
            for ((&id, &v), &xi) in ids.iter().zip(src).zip(&g.x_inner_of) {
                slab[id as usize * g.x_inner + xi] += v;
            }
        }
    };
    if dx.len() < PAR_THRESHOLD && dout.len() < PAR_THRESHOLD {
        for (xo, slab) in dx.chunks_mut(slab_len).enumerate() {
            slab_fn(xo, slab);
        }
    } else {
        dx.par_chunks_mut(slab_len)
            .enumerate()
            .for_each(|(xo, slab)| slab_fn(xo, slab));
    }
    Ok(())
}

/// `out[o, j, i] = x[o, ids[j], i]` for contiguous `x [outer, x_n, inner]` and
/// `out [outer, ids.len(), inner]` (`index_select` along the middle dim). An id outside `0..x_n`
/// is an error, raised before anything is written; `dim` is the tensor dimension being indexed,
/// only used in that message.
pub fn index_select<T: Copy + Send + Sync>(
    x: &[T],
    outer: usize,
    x_n: usize,
    inner: usize,
    ids: &[i64],
    dim: usize,
    out: &mut [T],
) -> Result<(), KernelError> {
    assert!(
        x.len() == outer * x_n * inner && out.len() == outer * ids.len() * inner,
        "index_select: x has {} elements, expected [{outer}, {x_n}, {inner}]; out {}, expected [{outer}, {}, {inner}]",
        x.len(),
        out.len(),
        ids.len()
    );
    check_indices("index_select", ids, &[ids.len()], dim, x_n)?;
    let k = ids.len();
    for_each_row(
        out,
        inner,
        #[inline(always)]
        |r, row| {
            let (o, j) = (r / k, r % k);
            let src = (o * x_n + ids[j] as usize) * inner;
            row.copy_from_slice(&x[src..src + inner]);
        },
    );
    Ok(())
}

/// The backward of [`index_select`]: `dx[o, ids[j], i] += dout[o, j, i]`, accumulated into `dx`
/// (`[outer, x_n, inner]`, not zeroed first) in increasing `j` for every element (`dim` as in
/// [`index_select`], for the error message).
///
/// Tasks own whole `[x_n, inner]` slabs of `dx`; with a single slab the columns are split as the
/// embedding backward does. Either way the order of additions into each element is fixed, so
/// the result does not depend on the thread count.
pub fn index_select_backward<T: Float>(
    dout: &[T],
    outer: usize,
    x_n: usize,
    inner: usize,
    ids: &[i64],
    dim: usize,
    dx: &mut [T],
) -> Result<(), KernelError> {
    assert!(
        dx.len() == outer * x_n * inner && dout.len() == outer * ids.len() * inner,
        "index_select_backward: dx has {} elements, expected [{outer}, {x_n}, {inner}]; dout {}, expected [{outer}, {}, {inner}]",
        dx.len(),
        dout.len(),
        ids.len()
    );
    check_indices("index_select_backward", ids, &[ids.len()], dim, x_n)?;
    let (slab, src) = (x_n * inner, ids.len() * inner);
    if slab == 0 || src == 0 {
        return Ok(());
    }
    // Each slab is exactly an embedding backward over a [x_n, inner] table (ids already checked).
    let run = |o: usize, d: &mut [T]| {
        embedding::embedding_backward(&dout[o * src..(o + 1) * src], ids, x_n, inner, d)
            .expect("ids were validated above");
    };
    if outer == 1 || dx.len() + dout.len() < PAR_THRESHOLD {
        for (o, d) in dx.chunks_mut(slab).enumerate() {
            run(o, d);
        }
    } else {
        dx.par_chunks_mut(slab)
            .enumerate()
            .for_each(|(o, d)| run(o, d));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{to_f32, Rng};

    /// Naive gather over explicit multi-indices.
    fn gather_ref(x: &[f64], xd: &[usize], dim: usize, index: &[i64], id: &[usize]) -> Vec<f64> {
        (0..index.len())
            .map(|p| {
                let mut c = unravel(p, id);
                c[dim] = index[p] as usize;
                x[ravel(&c, xd)]
            })
            .collect()
    }

    fn scatter_ref(g: &[f64], xd: &[usize], dim: usize, index: &[i64], id: &[usize]) -> Vec<f64> {
        let mut dx = vec![0.0; xd.iter().product()];
        for p in 0..index.len() {
            let mut c = unravel(p, id);
            c[dim] = index[p] as usize;
            dx[ravel(&c, xd)] += g[p];
        }
        dx
    }

    #[test]
    fn gather_and_scatter_add_match_reference() {
        let mut rng = Rng(9);
        // (x dims, dim, index dims): equal, smaller non-dim sizes, larger indexed dim, large.
        let cases: Vec<(Vec<usize>, usize, Vec<usize>)> = vec![
            (vec![5], 0, vec![9]),
            (vec![3, 4], 0, vec![5, 4]),
            (vec![3, 4], 1, vec![3, 6]),
            (vec![4, 5, 6], 1, vec![2, 7, 3]),
            (vec![4, 5, 6], 0, vec![3, 5, 2]),
            (vec![4, 5, 6], 2, vec![4, 1, 9]),
            (vec![64, 50, 30], 1, vec![64, 80, 30]),
            (vec![200, 300], 0, vec![400, 300]),
        ];
        for (xd, dim, id) in cases {
            let x = rng.vec(xd.iter().product(), -1.0, 1.0);
            let n: usize = id.iter().product();
            // Few distinct indices: heavy repetition, so accumulation order matters in f32.
            let index: Vec<i64> = (0..n).map(|_| rng.below(xd[dim].min(3)) as i64).collect();
            let mut out = vec![f64::NAN; n];
            gather(&x, &xd, dim, &index, &id, &mut out).unwrap();
            assert_eq!(
                out,
                gather_ref(&x, &xd, dim, &index, &id),
                "{xd:?} {dim} {id:?}"
            );

            let g = rng.vec(n, -1.0, 1.0);
            let mut dx = vec![0.0; x.len()];
            gather_backward(&g, &xd, dim, &index, &id, &mut dx).unwrap();
            // Same order (increasing position) as the naive loop: bit-exact.
            assert_eq!(
                dx,
                scatter_ref(&g, &xd, dim, &index, &id),
                "{xd:?} {dim} {id:?}"
            );
            let g32 = to_f32(&g);
            let mut dx32 = vec![0f32; x.len()];
            gather_backward(&g32, &xd, dim, &index, &id, &mut dx32).unwrap();
            let mut want32 = vec![0f32; x.len()];
            for p in 0..n {
                let mut c = unravel(p, &id);
                c[dim] = index[p] as usize;
                want32[ravel(&c, &xd)] += g32[p];
            }
            assert_eq!(dx32, want32, "f32 order {xd:?} {dim} {id:?}");
        }
    }

    #[test]
    fn index_select_and_backward_match_reference() {
        let mut rng = Rng(10);
        for (outer, x_n, inner, k) in [
            (1, 5, 3, 7),
            (3, 4, 1, 2),
            (2, 6, 5, 0),
            (1, 50, 300, 400),
            (40, 30, 40, 50),
        ] {
            let x = rng.vec(outer * x_n * inner, -1.0, 1.0);
            let ids: Vec<i64> = (0..k).map(|_| rng.below(x_n.min(4)) as i64).collect();
            let mut out = vec![f64::NAN; outer * k * inner];
            index_select(&x, outer, x_n, inner, &ids, 1, &mut out).unwrap();
            let g = to_f32(&rng.vec(out.len(), -1.0, 1.0));
            let mut want_dx = vec![0f32; x.len()];
            for o in 0..outer {
                for j in 0..k {
                    for i in 0..inner {
                        let src = (o * x_n + ids[j] as usize) * inner + i;
                        assert_eq!(out[(o * k + j) * inner + i], x[src]);
                        want_dx[src] += g[(o * k + j) * inner + i];
                    }
                }
            }
            let mut dx = vec![0f32; x.len()];
            index_select_backward(&g, outer, x_n, inner, &ids, 1, &mut dx).unwrap();
            assert_eq!(dx, want_dx, "[{outer}, {x_n}, {inner}] with {k} ids");
        }
    }

    #[test]
    fn bad_indices_are_errors_and_nothing_is_written() {
        let x = [1.0f64; 12];
        let mut out = [7.0f64; 4];
        let e = gather(&x, &[3, 4], 1, &[0, 1, 4, 2], &[1, 4], &mut out).unwrap_err();
        assert!(
            e.0.contains("index 4") && e.0.contains("[0, 2]") && e.0.contains("dim 1 of size 4"),
            "{e}"
        );
        assert_eq!(out, [7.0; 4]);
        let e = gather(&x, &[3, 4], 0, &[0, -1, 1, 2], &[1, 4], &mut out).unwrap_err();
        assert!(e.0.contains("index -1") && e.0.contains("size 3"), "{e}");
        let mut dx = [0.0f64; 12];
        assert!(gather_backward(&[1.0; 4], &[3, 4], 0, &[0, 3, 1, 2], &[1, 4], &mut dx).is_err());
        assert_eq!(dx, [0.0; 12]);
        let e = index_select(&x, 1, 3, 4, &[2, 3], 0, &mut [0.0; 8]).unwrap_err();
        assert!(
            e.0.contains("index 3") && e.0.contains("[1]") && e.0.contains("dim 0 of size 3"),
            "{e}"
        );
        assert!(index_select_backward(&[1.0; 8], 1, 3, 4, &[-2, 0], 0, &mut dx).is_err());
        assert_eq!(dx, [0.0; 12]);
    }
}
