//! Embedding lookup (gather rows) and its backward (scatter-add rows).

use rayon::prelude::*;

use super::strided::PAR_THRESHOLD;
use super::vecops::{for_each_row, SendPtr};
use crate::{Float, KernelError};

/// Checks every id against `0..vocab`, naming the first bad one.
fn check_ids(what: &str, ids: &[i64], vocab: usize) -> Result<(), KernelError> {
    for (i, &id) in ids.iter().enumerate() {
        if id < 0 || id as u64 >= vocab as u64 {
            return Err(KernelError(format!(
                "{what}: id {id} at position {i} is outside 0..{vocab}"
            )));
        }
    }
    Ok(())
}

/// `out[i] = weight[ids[i]]` for a `[vocab, dim]` table; an id outside `0..vocab` is an error
/// naming its position and value.
///
/// Ids are validated before anything is written.
pub fn embedding_forward<T: Copy + Send + Sync>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    out: &mut [T],
) -> Result<(), KernelError> {
    assert_eq!(
        weight.len(),
        vocab * dim,
        "embedding_forward: weight has {} elements, expected [{vocab}, {dim}]",
        weight.len()
    );
    assert_eq!(
        out.len(),
        ids.len() * dim,
        "embedding_forward: out has {} elements, expected [{}, {dim}]",
        out.len(),
        ids.len()
    );
    check_ids("embedding", ids, vocab)?;
    for_each_row(
        out,
        dim,
        #[inline(always)]
        |i, row| {
            let id = ids[i] as usize;
            row.copy_from_slice(&weight[id * dim..(id + 1) * dim]);
        },
    );
    Ok(())
}

/// `dweight[ids[i]] += dout[i]`, accumulated in increasing `i` for each row (deterministic).
///
/// Accumulates into `dweight` (it is not zeroed first). Ids are validated before anything is
/// written. Large problems split the columns (never the positions `i`) across threads, so the
/// order of additions into each element is the same for any thread count.
pub fn embedding_backward<T: Float>(
    dout: &[T],
    ids: &[i64],
    vocab: usize,
    dim: usize,
    dweight: &mut [T],
) -> Result<(), KernelError> {
    assert_eq!(
        dweight.len(),
        vocab * dim,
        "embedding_backward: dweight has {} elements, expected [{vocab}, {dim}]",
        dweight.len()
    );
    assert_eq!(
        dout.len(),
        ids.len() * dim,
        "embedding_backward: dout has {} elements, expected [{}, {dim}]",
        dout.len(),
        ids.len()
    );
    check_ids("embedding_backward", ids, vocab)?;
    if dim == 0 {
        return Ok(());
    }
    let threads = rayon::current_num_threads();
    if ids.len() * dim < PAR_THRESHOLD || dim < 128 || threads < 2 {
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            let dst = &mut dweight[id * dim..(id + 1) * dim];
            for (d, &s) in dst.iter_mut().zip(&dout[i * dim..(i + 1) * dim]) {
                *d += s;
            }
        }
        return Ok(());
    }
    // Column blocks: task b owns columns [c0, c1) of every row of dweight and walks all
    // positions i in increasing order.
    let width = dim.div_ceil(threads * 2).max(64);
    let nblocks = dim.div_ceil(width);
    let base = SendPtr(dweight.as_mut_ptr());
    (0..nblocks).into_par_iter().for_each(|b| {
        let (c0, c1) = (b * width, ((b + 1) * width).min(dim));
        for (i, &id) in ids.iter().enumerate() {
            let src = &dout[i * dim + c0..i * dim + c1];
            // SAFETY: every id was checked to be < vocab, so row `id` columns [c0, c1) lie
            // inside dweight (vocab * dim elements, asserted above); column ranges of distinct
            // tasks are disjoint, and the unique borrow of dweight is held for the whole call, so
            // this task is the only one accessing these elements.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(base.get().add(id as usize * dim + c0), c1 - c0)
            };
            for (d, &s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{to_f32, Rng};

    #[test]
    fn forward_gathers_rows() {
        let mut rng = Rng(5);
        for (vocab, dim, n) in [(1, 1, 1), (5, 3, 7), (50, 64, 1000), (10, 1, 0)] {
            let weight = rng.vec(vocab * dim, -1.0, 1.0);
            let ids: Vec<i64> = (0..n).map(|_| rng.below(vocab) as i64).collect();
            let mut out = vec![0.0; n * dim];
            embedding_forward(&weight, vocab, dim, &ids, &mut out).unwrap();
            for i in 0..n {
                for c in 0..dim {
                    assert_eq!(out[i * dim + c], weight[ids[i] as usize * dim + c]);
                }
            }
        }
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        let w = [1.0f32; 6];
        let mut out = [0.0f32; 6];
        let err = embedding_forward(&w, 3, 2, &[0, 3, 1], &mut out).unwrap_err();
        assert!(
            err.0.contains("position 1") && err.0.contains("id 3"),
            "{err}"
        );
        assert_eq!(out, [0.0; 6]);
        let err = embedding_forward(&w, 3, 2, &[0, 1, -2], &mut out).unwrap_err();
        assert!(
            err.0.contains("position 2") && err.0.contains("-2"),
            "{err}"
        );
        let mut dw = [0.0f32; 6];
        let err = embedding_backward(&[1.0; 4], &[2, 7], 3, 2, &mut dw).unwrap_err();
        assert!(err.0.contains("position 1"), "{err}");
        assert_eq!(dw, [0.0; 6], "nothing written on error");
    }

    #[test]
    fn backward_scatter_adds_in_order() {
        let mut rng = Rng(6);
        // (vocab, dim, n): includes the column-parallel path (dim >= 128, large n * dim).
        for (vocab, dim, n) in [(1, 1, 3), (7, 5, 40), (50, 300, 400), (3, 1000, 100)] {
            let dout = to_f32(&rng.vec(n * dim, -1.0, 1.0));
            // Heavy repetition of a few ids so that order matters.
            let ids: Vec<i64> = (0..n).map(|_| rng.below(vocab.min(4)) as i64).collect();
            let init = to_f32(&rng.vec(vocab * dim, -1.0, 1.0));
            let mut dw = init.clone();
            embedding_backward(&dout, &ids, vocab, dim, &mut dw).unwrap();
            let mut want = init.clone();
            let mut want64: Vec<f64> = init.iter().map(|&v| v as f64).collect();
            for i in 0..n {
                let id = ids[i] as usize;
                for c in 0..dim {
                    want[id * dim + c] += dout[i * dim + c];
                    want64[id * dim + c] += dout[i * dim + c] as f64;
                }
            }
            for j in 0..vocab * dim {
                // Sequential order in increasing i: bit-exact.
                assert_eq!(dw[j].to_bits(), want[j].to_bits(), "element {j}");
                assert!((dw[j] as f64 - want64[j]).abs() < 1e-4 * (1.0 + (n as f64).sqrt()));
            }
        }
    }
}
