//! Matrix multiplication with broadcast batch dims; transposed operands are read through their
//! strides, never copied.

use super::same_kind;
use crate::backend::Product;
use crate::storage::Storage;
use crate::{Error, Layout, Result, Shape, Tensor};
use meshgrad_kernels::ops::MatrixLayout;

/// Collapses the batch dims of a broadcast layout into one stride when they form a single
/// arithmetic progression; `None` when they do not.
fn batch_stride(l: &Layout, nbatch: usize) -> Option<usize> {
    let dims = &l.dims()[..nbatch];
    let strides = &l.strides()[..nbatch];
    let live: Vec<(usize, usize)> = dims
        .iter()
        .zip(strides)
        .filter(|(&d, _)| d != 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    if live.is_empty() {
        return Some(0);
    }
    if live.iter().all(|&(_, s)| s == 0) {
        return Some(0);
    }
    for w in live.windows(2) {
        if w[0].1 != w[1].0 * w[1].1 {
            return None;
        }
    }
    Some(live.last().expect("non-empty").1)
}

impl Tensor {
    /// `self @ rhs` for operands of rank >= 2 (`[..., m, k] @ [..., k, n]`), batch dims broadcast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("matmul");
        same_kind("matmul", self, rhs)?;
        if self.rank() < 2 || rhs.rank() < 2 {
            crate::bail!(
                "matmul: operands need rank >= 2, got {} and {}",
                self.shape(),
                rhs.shape()
            );
        }
        let (m, k) = (self.dims()[self.rank() - 2], self.dims()[self.rank() - 1]);
        let (k2, n) = (rhs.dims()[rhs.rank() - 2], rhs.dims()[rhs.rank() - 1]);
        if k != k2 {
            return Err(crate::Error::shape_mismatch(
                "matmul",
                self.shape(),
                rhs.shape(),
            ));
        }
        let ba = Shape::from(&self.dims()[..self.rank() - 2]);
        let bb = Shape::from(&rhs.dims()[..rhs.rank() - 2]);
        let batch_shape =
            Shape::broadcast("matmul", &ba, &bb).map_err(|_| Error::ShapeMismatch {
                op: "matmul",
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            })?;
        let nb = batch_shape.rank();
        let batch = batch_shape.elem_count();
        let mut out_dims = batch_shape.dims().to_vec();
        out_dims.extend([m, n]);

        let full = |t: &Tensor, r: usize, c: usize| -> Result<Layout> {
            let mut d = batch_shape.dims().to_vec();
            d.extend([r, c]);
            t.layout().broadcast_as(&Shape::new(d))
        };
        let mut a = self.clone();
        let mut la = full(&a, m, k)?;
        let mut b = rhs.clone();
        let mut lb = full(&b, k, n)?;

        // Fold a batched lhs into one tall matrix when rhs is shared across the batch.
        let sa = batch_stride(&la, nb);
        let sb = batch_stride(&lb, nb);
        if sb == Some(0) && batch > 1 {
            if let Some(sa) = sa.filter(|&s| s != 0) {
                let (rs, cs) = (la.strides()[nb], la.strides()[nb + 1]);
                // Row i of batch b sits at b*sa + i*rs; that is one progression of batch*m rows
                // when sa == m*rs (or trivially when m == 1).
                let row_stride = if m == 1 {
                    Some(sa)
                } else {
                    (sa == m * rs).then_some(rs)
                };
                if let Some(row_stride) = row_stride {
                    let al = MatrixLayout {
                        offset: la.offset(),
                        batch_stride: 0,
                        row_stride,
                        col_stride: cs,
                    };
                    let bl = mat(&lb, nb, 0);
                    let (ga, gb) = (a.read_storage("matmul")?, b.read_storage("matmul")?);
                    let p = Product {
                        al,
                        bl,
                        batch: 1,
                        m: batch * m,
                        n,
                        k,
                    };
                    let s = Storage::matmul(&ga, &gb, &p)?;
                    return Ok(Tensor::from_storage(s, out_dims));
                }
            }
        }
        let sa = match sa {
            Some(s) => s,
            None => {
                a = a.expand(Shape::new(la.dims().to_vec()))?.contiguous()?;
                la = a.layout().clone();
                m * k
            }
        };
        let sb = match sb {
            Some(s) => s,
            None => {
                b = b.expand(Shape::new(lb.dims().to_vec()))?.contiguous()?;
                lb = b.layout().clone();
                k * n
            }
        };
        let (ga, gb) = (a.read_storage("matmul")?, b.read_storage("matmul")?);
        let p = Product {
            al: mat(&la, nb, sa),
            bl: mat(&lb, nb, sb),
            batch,
            m,
            n,
            k,
        };
        let s = Storage::matmul(&ga, &gb, &p)?;
        Ok(Tensor::from_storage(s, out_dims))
    }
}

/// The matrix layout of the last two dims of `l`, with `nb` batch dims read at `batch_stride`.
fn mat(l: &Layout, nb: usize, batch_stride: usize) -> MatrixLayout {
    MatrixLayout {
        offset: l.offset(),
        batch_stride,
        row_stride: l.strides()[nb],
        col_stride: l.strides()[nb + 1],
    }
}
