//! Embedding lookup composed of basic ops (`index_select` along the table's rows and its
//! scatter-add backward), and the tests that it agrees with the fused paths.

use super::{Embedding, EmbeddingBackward};
use crate::{Result, Tensor};

/// See [`Embedding`]: the rows of the table selected by the flattened ids.
pub(super) fn forward(a: &Embedding<&Tensor>) -> Result<Tensor> {
    let ids = a.ids.reshape(a.ids.elem_count())?;
    a.table.index_select(0, &ids)?.reshape(a.out_dims.clone())
}

/// See [`EmbeddingBackward`]: the backward of that selection.
pub(super) fn backward(a: &EmbeddingBackward<&Tensor>) -> Result<Tensor> {
    let ids = a.ids.reshape(a.ids.elem_count())?;
    let dout = a.dout.reshape((ids.elem_count(), a.dim))?;
    dout.index_select_backward(0, &ids, (a.vocab, a.dim))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, rand};
    use crate::{DType, Device, Tensor};

    #[test]
    fn embedding_matches_its_composition() {
        let ids = Tensor::from_vec(vec![3i64, 0, 6, 3, 1, 6], (2, 3), Device::Cpu).unwrap();
        for (dt, rel, [table, dout]) in cases(31, [&[7, 5], &[2, 3, 5]]) {
            let (a, c) = both(|| table.embedding(&ids).unwrap());
            close(&format!("embedding {dt}"), &a, &c, rel);
            let (a, c) = both(|| dout.embedding_backward(&ids, 7).unwrap());
            close(&format!("embedding_backward {dt}"), &a, &c, rel);
        }
        let ids = ids.to_dtype(DType::U32).unwrap();
        let table = rand(&[7, 5], 33, DType::F32);
        let (a, c) = both(|| table.embedding(&ids).unwrap());
        close("embedding (u32 ids)", &a, &c, 0.0);
    }
}
