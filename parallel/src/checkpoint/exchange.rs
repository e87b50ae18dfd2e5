//! The two collective steps a save needs: every rank's bytes on every rank (the piece
//! descriptions), and agreeing on success (a barrier that also tells every rank whether some
//! rank failed, so no rank waits for one that gave up).
//!
//! `None` stands for a world of one rank (a single-device save): both steps are then local.

use meshgrad_tensor::{DType, Device, Error, Result, Tensor};

use crate::comm::{Communicator, ReduceOp};

/// This rank's index and the number of ranks.
pub(crate) fn rank_and_size(comm: Option<&dyn Communicator>) -> (usize, usize) {
    comm.map_or((0, 1), |c| (c.rank(), c.world_size()))
}

/// Every rank's `bytes`, in rank order (collective).
pub(crate) fn all_gather_bytes(
    comm: Option<&dyn Communicator>,
    bytes: &[u8],
) -> Result<Vec<Vec<u8>>> {
    let Some(comm) = comm.filter(|c| c.world_size() > 1) else {
        return Ok(vec![bytes.to_vec()]);
    };
    let len = Tensor::from_vec(vec![bytes.len() as i64], 1, Device::Cpu)?;
    let lens = comm.all_gather(&len)?.wait()?.to_vec::<i64>()?;
    let max = lens.iter().copied().max().unwrap_or(0).max(1) as usize;
    let mut padded = bytes.to_vec();
    padded.resize(max, 0);
    let all = comm
        .all_gather(&Tensor::from_vec(padded, max, Device::Cpu)?)?
        .wait()?;
    if all.dtype() != DType::U8 {
        meshgrad_tensor::bail!(
            "internal error: gathered bytes came back as {}",
            all.dtype()
        );
    }
    let all = all.to_vec::<u8>()?;
    Ok(lens
        .iter()
        .enumerate()
        .map(|(r, &n)| all[r * max..r * max + n as usize].to_vec())
        .collect())
}

/// A barrier that agrees on the outcome: when every rank's `local` is `Ok`, returns it; when a
/// rank failed, every rank returns an error (the failing rank its own, prefixed by `what` and
/// the rank; the others one naming the lowest failing rank). Collective.
pub(crate) fn agree<T>(comm: Option<&dyn Communicator>, what: &str, local: Result<T>) -> Result<T> {
    let (rank, size) = rank_and_size(comm);
    let flag = if local.is_err() {
        (size - rank) as f64
    } else {
        0.0
    };
    let max = match comm.filter(|c| c.world_size() > 1) {
        Some(c) => {
            let t = Tensor::from_vec(vec![flag], 1, Device::Cpu)?;
            c.all_reduce(&t, ReduceOp::Max)?.wait()?.to_vec::<f64>()?[0]
        }
        None => flag,
    };
    match local {
        Err(e) => Err(Error::msg(format!("{what}: rank {rank}: {e}"))),
        Ok(_) if max > 0.0 => Err(Error::msg(format!(
            "{what}: rank {} failed (its error says why); nothing was published",
            size - max as usize
        ))),
        Ok(v) => Ok(v),
    }
}
