//! Embedding lookup: rows of a table picked by integer ids; the gradient scatter-adds back.

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Rows of `table` (`[vocab, dim]`) picked by integer `ids`; the gradient scatter-adds back.
    pub fn embedding(table: &Var, ids: &Tensor) -> Result<Var> {
        let v = table.tensor().embedding(ids)?;
        let ids = ids.clone();
        let vocab = table.tensor().dims()[0];
        let dtype = table.tensor().dtype();
        Ok(Var::from_op(
            "embedding",
            v,
            &[table],
            Box::new(move |g, _| {
                Ok(vec![Some(
                    g.embedding_backward(&ids, vocab)?.to_dtype(dtype)?,
                )])
            }),
        ))
    }
}
