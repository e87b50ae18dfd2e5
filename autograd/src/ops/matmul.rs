//! Matrix product of two `Var`s with broadcast batch dims, and its backward rule.

use meshgrad_tensor::Result;

use crate::Var;

impl Var {
    /// `self @ rhs` with broadcast batch dims. The backward computes only the wanted inputs'
    /// gradients (see [`BackwardFn`](crate::BackwardFn)).
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.tensor().clone(), rhs.tensor().clone());
        let v = a.matmul(&b)?;
        Ok(Var::from_op(
            "matmul",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let (ra, rb) = (wanted[0], wanted[1]);
                let ga = if ra {
                    Some(g.matmul(&b.t()?)?.sum_to_shape(a.shape())?)
                } else {
                    None
                };
                let gb = if rb {
                    let (k, n) = (b.dims()[b.rank() - 2], b.dims()[b.rank() - 1]);
                    if b.rank() == 2 && a.rank() > 2 {
                        // Fold the batch into rows: one [K, rows] @ [rows, N] product.
                        let a2 = a.reshape((a.elem_count() / k, k))?;
                        let g2 = g.reshape((g.elem_count() / n, n))?;
                        Some(a2.t()?.matmul(&g2)?)
                    } else {
                        Some(a.t()?.matmul(g)?.sum_to_shape(b.shape())?)
                    }
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }
}
