//! All-reduce of many tensors in few collectives: consecutive tensors of the same dtype and
//! device are flattened into buckets of about `bucket_bytes`, every bucket's all-reduce is
//! launched before any is waited for, and the results are cut back into the tensors' shapes.
//! Reductions are elementwise, so each element gets what its own all-reduce would give (the
//! in-process backend: the same bits).

use meshgrad_tensor::{Error, Result, Tensor};

use super::{Communicator, ReduceOp};

/// The tensors of one bucket: indices into the input, all of one dtype and device.
fn buckets(tensors: &[Tensor], bucket_bytes: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0;
    for (i, t) in tensors.iter().enumerate() {
        let fits = out.last().is_some_and(|b| {
            let first = &tensors[b[0]];
            bytes < bucket_bytes && first.dtype() == t.dtype() && first.device() == t.device()
        });
        if !fits {
            out.push(Vec::new());
            bytes = 0;
        }
        out.last_mut().expect("a bucket was just pushed").push(i);
        bytes += t.elem_count() * t.dtype().size_in_bytes();
    }
    out
}

/// `comm.all_reduce(t, op)` of every tensor of `tensors`, returned in order with their shapes,
/// as one collective per bucket of about `bucket_bytes` (a bucket closes once it holds at least
/// that many bytes, or where the dtype or device changes). Every rank must pass tensors of the
/// same shapes and dtypes in the same order (as for the per-tensor calls).
pub fn all_reduce_coalesced(
    comm: &dyn Communicator,
    tensors: &[Tensor],
    op: ReduceOp,
    bucket_bytes: usize,
) -> Result<Vec<Tensor>> {
    let plan = buckets(tensors, bucket_bytes.max(1));
    let mut pending = Vec::with_capacity(plan.len());
    for b in &plan {
        let parts: Vec<Tensor> = b
            .iter()
            .map(|&i| tensors[i].reshape(tensors[i].elem_count()))
            .collect::<Result<_>>()?;
        let flat = if parts.len() == 1 {
            parts[0].contiguous()?
        } else {
            let refs: Vec<&Tensor> = parts.iter().collect();
            Tensor::cat(&refs, 0)?
        };
        pending.push(comm.all_reduce(&flat, op)?);
    }
    let mut out: Vec<Option<Tensor>> = vec![None; tensors.len()];
    for (b, work) in plan.iter().zip(pending) {
        let flat = work.wait()?;
        let mut offset = 0;
        for &i in b {
            let t = &tensors[i];
            let n = t.elem_count();
            out[i] = Some(flat.narrow(0, offset, n)?.reshape(t.shape())?);
            offset += n;
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, t)| t.ok_or_else(|| Error::msg(format!("coalesced all-reduce: tensor {i} lost"))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{run_ranks, RunOptions};
    use meshgrad_tensor::{DType, Device, Random};

    #[test]
    fn buckets_close_at_the_size_and_where_the_dtype_changes() {
        let f = |n: usize, dt: DType| Tensor::zeros(n, dt, Device::Cpu).unwrap();
        let ts = [
            f(4, DType::F32),
            f(4, DType::F32),
            f(4, DType::F32),
            f(2, DType::F64),
            f(2, DType::F32),
        ];
        // 32 bytes: two f32 tensors of 16 bytes fill a bucket.
        assert_eq!(
            buckets(&ts, 32),
            vec![vec![0, 1], vec![2], vec![3], vec![4]]
        );
        assert_eq!(buckets(&ts, 1 << 20), vec![vec![0, 1, 2], vec![3], vec![4]]);
        assert!(buckets(&[], 32).is_empty());
    }

    /// Every tensor equals its own all-reduce bit for bit (3 ranks, mixed dtypes and shapes,
    /// small buckets so that several are in flight at once), for sums and averages.
    #[test]
    fn equals_one_all_reduce_per_tensor() {
        let out = run_ranks(3, &RunOptions::default(), |ctx| {
            let r = ctx.comm.rank() as u64;
            let shapes: [&[usize]; 5] = [&[3, 5], &[7], &[2, 2, 2], &[1], &[4, 3]];
            let tensors: Vec<Tensor> = shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let dt = if i == 3 { DType::F64 } else { DType::F32 };
                    Random::new(10 * r + i as u64)
                        .dtype(dt)
                        .normal(s.to_vec(), 0.0, 1.0)
                })
                .collect::<Result<_>>()?;
            let mut same = true;
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let got = all_reduce_coalesced(ctx.comm.as_ref(), &tensors, op, 40)?;
                for (t, g) in tensors.iter().zip(&got) {
                    let want = ctx.comm.all_reduce(t, op)?.wait()?;
                    same &= g.dims() == want.dims()
                        && g.dtype() == want.dtype()
                        && g.to_vec_f64()?
                            .iter()
                            .map(|v| v.to_bits())
                            .collect::<Vec<_>>()
                            == want
                                .to_vec_f64()?
                                .iter()
                                .map(|v| v.to_bits())
                                .collect::<Vec<_>>();
                }
            }
            Ok(same)
        })
        .unwrap();
        assert!(out.iter().all(|&same| same));
    }
}
