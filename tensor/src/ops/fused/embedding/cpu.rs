//! Embedding lookup on the CPU, forward and backward: resolve dtypes and ids, then call
//! `meshgrad_kernels::cpu::embedding`.

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{Embedding, EmbeddingBackward};
use crate::cpu_backend::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Embedding`]: any dtype of table (the rows are copied).
pub(crate) fn forward(a: &Embedding<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((w, wl), (ids_s, il), vocab, dim) = (a.table, a.ids, a.vocab, a.dim);
    let ids = ids(ids_s, il, "embedding (ids)")?;
    let r = range(wl);
    let err;
    let out = crate::cpu_map!(w, v => {
        let mut out = vec![Default::default(); ids.len() * dim];
        err = cpu::embedding::embedding_forward(&v[r], vocab, dim, &ids, &mut out);
        crate::WithDType::into_cpu_storage(out)
    });
    err?;
    Ok(out)
}

/// See [`EmbeddingBackward`]: float gradients, summed in compute precision.
pub(super) fn backward(a: &EmbeddingBackward<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((dout, dl), (ids_s, il), vocab, dim) = (a.dout, a.ids, a.vocab, a.dim);
    let ids = ids(ids_s, il, "embedding_backward (ids)")?;
    let dt = dout.dtype();
    let err;
    let out = with_floats!("embedding_backward", (dout, range(dl)) => g; {
        let mut out = vec![Float::ZERO; vocab * dim];
        err = cpu::embedding::embedding_backward(g, &ids, vocab, dim, &mut out);
        out.into_storage(dt)
    });
    err?;
    Ok(out)
}
