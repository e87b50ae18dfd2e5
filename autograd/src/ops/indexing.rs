//! `gather` and `index_select` on [`Var`]; their gradients scatter-add (index-add) back in a
//! fixed order, so they do not depend on the thread count.

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `torch.gather` along `dim` by the integer `index` (not differentiated; see
    /// [`Tensor::gather`]). The gradient scatter-adds the upstream gradient into zeros of the
    /// input's shape; an element read several times receives the sum, added in increasing
    /// position order.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Var> {
        let v = self.tensor().gather(dim, index)?;
        let index = index.clone();
        let shape = self.tensor().shape().clone();
        Ok(Var::from_op(
            "gather",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.gather_backward(dim, &index, shape.clone())?)])),
        ))
    }

    /// The slices along `dim` picked by the 1-D integer `ids` (not differentiated; see
    /// [`Tensor::index_select`]). The gradient index-adds the upstream gradient into zeros of
    /// the input's shape; a repeated id receives the sum, added in increasing id position.
    pub fn index_select(&self, dim: isize, ids: &Tensor) -> Result<Var> {
        let v = self.tensor().index_select(dim, ids)?;
        let ids = ids.clone();
        let shape = self.tensor().shape().clone();
        Ok(Var::from_op(
            "index_select",
            v,
            &[self],
            Box::new(move |g, _| {
                Ok(vec![Some(g.index_select_backward(
                    dim,
                    &ids,
                    shape.clone(),
                )?)])
            }),
        ))
    }
}
