//! All-to-all cases shared by the backends' tests (threads, TCP, MPI, NCCL): every rank fills
//! the rows it sends with values that encode (source rank, destination rank, row, column), and
//! the rows it receives are compared with the same encoding computed here, never with another
//! backend's result. Splits are uneven and include zeros (whole ranks sending nothing).
#![allow(dead_code)]

use meshgrad_parallel::comm::{all_to_all_splits, Communicator};
use meshgrad_tensor::{DType, Device, Result, Tensor};

/// Rows group rank `src` sends group rank `dst` in case `seed`: 0 to 3, uneven, often 0.
pub fn split(seed: usize, src: usize, dst: usize) -> usize {
    (src * 3 + dst * 5 + seed * 7 + src * dst) % 4
}

/// The value of column `c` of row `k` of the block `src` sends `dst` (exact in f32 and i64;
/// bf16 rounds it, on the sending side as in the expectation).
pub fn value(src: usize, dst: usize, k: usize, c: usize) -> f64 {
    ((((src * 8 + dst) * 4 + k) * 8 + c) as f64) - 300.0
}

/// A tensor of `rows` rows of shape `trailing`, from `values` (row-major), in `dtype` on `device`.
fn tensor(
    values: Vec<f64>,
    rows: usize,
    trailing: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Tensor> {
    let mut dims = vec![rows];
    dims.extend_from_slice(trailing);
    Tensor::from_vec(values, dims, Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// The rows of the blocks `pairs` (source, destination) in order.
fn rows(
    seed: usize,
    pairs: impl Iterator<Item = (usize, usize)>,
    trailing: &[usize],
) -> (Vec<f64>, usize) {
    let row: usize = trailing.iter().product();
    let mut v = Vec::new();
    let mut n = 0;
    for (s, d) in pairs {
        for k in 0..split(seed, s, d) {
            v.extend((0..row).map(|c| value(s, d, k, c)));
            n += 1;
        }
    }
    (v, n)
}

/// One case on group rank `me` of `w`: the input, the send and receive splits, and the
/// expected result.
pub struct Case {
    pub input: Tensor,
    pub send: Vec<usize>,
    pub recv: Vec<usize>,
    pub want: Tensor,
}

pub fn case(
    seed: usize,
    me: usize,
    w: usize,
    trailing: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Case> {
    let (iv, irows) = rows(seed, (0..w).map(|d| (me, d)), trailing);
    let (wv, wrows) = rows(seed, (0..w).map(|s| (s, me)), trailing);
    Ok(Case {
        input: tensor(iv, irows, trailing, dtype, device)?,
        send: (0..w).map(|d| split(seed, me, d)).collect(),
        recv: (0..w).map(|s| split(seed, s, me)).collect(),
        want: tensor(wv, wrows, trailing, dtype, Device::Cpu)?,
    })
}

/// Shape, dtype and bytes of a tensor (on the host).
pub fn bits(t: &Tensor) -> (Vec<usize>, DType, Vec<u8>) {
    let t = t.to_device(Device::Cpu).unwrap();
    (
        t.dims().to_vec(),
        t.dtype(),
        t.to_cpu_storage().unwrap().as_bytes().to_vec(),
    )
}

/// The trailing shapes every case runs with: rows of 3, scalars (a 1-D tensor), 2x2 blocks.
pub const TRAILING: [&[usize]; 3] = [&[3], &[], &[2, 2]];

/// Runs every case on `comm` (tensors on `device`), all launched before the first wait, checks
/// each result against the expected rows, and checks [`all_to_all_splits`]. Returns how many
/// cases ran.
pub fn check(comm: &dyn Communicator, dtypes: &[DType], device: Device) -> usize {
    let (me, w) = (comm.rank(), comm.world_size());
    let mut pending = Vec::new();
    for seed in 0..3 {
        for trailing in TRAILING {
            for &dtype in dtypes {
                let c = case(seed, me, w, trailing, dtype, device).unwrap();
                let work = comm.all_to_all(&c.input, &c.send, &c.recv).unwrap();
                pending.push((seed, trailing, dtype, c, work));
            }
        }
    }
    let n = pending.len();
    for (seed, trailing, dtype, c, work) in pending {
        let got = work.wait().unwrap();
        assert_eq!(
            bits(&got),
            bits(&c.want),
            "rank {me} of {w}: seed {seed}, rows {trailing:?}, {dtype}: send {:?}, recv {:?}",
            c.send,
            c.recv
        );
        assert_eq!(got.device(), device, "the result is on the input's device");
    }
    // The receive splits from the send splits.
    for seed in 0..3 {
        let send: Vec<usize> = (0..w).map(|d| split(seed, me, d)).collect();
        let recv: Vec<usize> = (0..w).map(|s| split(seed, s, me)).collect();
        assert_eq!(
            all_to_all_splits(comm, &send).unwrap(),
            recv,
            "rank {me} seed {seed}"
        );
    }
    n
}
