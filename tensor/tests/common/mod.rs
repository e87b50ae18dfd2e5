//! Shared helpers of the tensor integration tests: a small local RNG, independent float64
//! reference implementations written with their own index arithmetic, builders of
//! non-contiguous views, and closeness checks that name the first mismatching element.
//!
//! Nothing here calls the op under test to compute an expected value.

#![allow(dead_code)]

use meshgrad_tensor::{DType, Device, Random, Tensor};

/// xorshift64* generator for shapes and choices (independent of the crate's Philox RNG).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Uniform integer in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    pub fn bool(&mut self) -> bool {
        self.next_u64() & 1 == 1
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
    /// Random dims: rank in `min_rank..=max_rank`, each size in `1..=max_size`.
    pub fn dims(&mut self, min_rank: usize, max_rank: usize, max_size: usize) -> Vec<usize> {
        let r = self.range(min_rank, max_rank);
        (0..r).map(|_| self.range(1, max_size)).collect()
    }
    /// A random permutation of `0..n`.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = self.below(i + 1);
            p.swap(i, j);
        }
        p
    }
}

// ----- index arithmetic -----

pub fn numel(dims: &[usize]) -> usize {
    dims.iter().product()
}

pub fn strides_of(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

/// Row-major multi-index of flat index `i`.
pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

pub fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    let mut f = 0;
    for (i, &d) in idx.iter().zip(dims) {
        f = f * d + i;
    }
    f
}

/// NumPy broadcast of two shapes.
pub fn bcast_shape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i < r - a.len() {
            1
        } else {
            a[i - (r - a.len())]
        };
        let db = if i < r - b.len() {
            1
        } else {
            b[i - (r - b.len())]
        };
        *o = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return None;
        };
    }
    Some(out)
}

/// The element of `vals` (shape `dims`) that lands at `out_idx` when broadcast to a larger shape.
pub fn bcast_get(vals: &[f64], dims: &[usize], out_idx: &[usize]) -> f64 {
    let lead = out_idx.len() - dims.len();
    let mut f = 0;
    for (j, &d) in dims.iter().enumerate() {
        let i = if d == 1 { 0 } else { out_idx[lead + j] };
        f = f * d + i;
    }
    vals[f]
}

// ----- references -----

pub fn ref_unary(x: &[f64], f: impl Fn(f64) -> f64) -> Vec<f64> {
    x.iter().map(|&v| f(v)).collect()
}

pub fn ref_binary(
    a: &[f64],
    ad: &[usize],
    b: &[f64],
    bd: &[usize],
    f: impl Fn(f64, f64) -> f64,
) -> (Vec<f64>, Vec<usize>) {
    let od = bcast_shape(ad, bd).expect("broadcastable");
    let out = (0..numel(&od))
        .map(|i| {
            let idx = unravel(i, &od);
            f(bcast_get(a, ad, &idx), bcast_get(b, bd, &idx))
        })
        .collect();
    (out, od)
}

/// Sum over the dims in `red` (resolved, non-negative).
pub fn ref_sum(x: &[f64], dims: &[usize], red: &[usize], keepdim: bool) -> (Vec<f64>, Vec<usize>) {
    let kept: Vec<usize> = dims
        .iter()
        .enumerate()
        .map(|(i, &d)| if red.contains(&i) { 1 } else { d })
        .collect();
    let mut out = vec![0.0; numel(&kept)];
    for (i, &v) in x.iter().enumerate() {
        let mut idx = unravel(i, dims);
        for &r in red {
            idx[r] = 0;
        }
        out[ravel(&idx, &kept)] += v;
    }
    let od = if keepdim {
        kept
    } else {
        dims.iter()
            .enumerate()
            .filter(|(i, _)| !red.contains(i))
            .map(|(_, &d)| d)
            .collect()
    };
    (out, od)
}

/// Max and first argmax over dim `d`; output dims with `d` kept as 1.
pub fn ref_max_argmax(x: &[f64], dims: &[usize], d: usize) -> (Vec<f64>, Vec<i64>) {
    let mut kept = dims.to_vec();
    kept[d] = 1;
    let n = numel(&kept);
    let mut mx = vec![f64::NEG_INFINITY; n];
    let mut am = vec![-1i64; n];
    for o in 0..n {
        let mut idx = unravel(o, &kept);
        for j in 0..dims[d] {
            idx[d] = j;
            let v = x[ravel(&idx, dims)];
            if am[o] < 0 || v > mx[o] {
                mx[o] = v;
                am[o] = j as i64;
            }
        }
    }
    (mx, am)
}

/// Permutes dims: result dim `i` is input dim `perm[i]`.
pub fn ref_permute(x: &[f64], dims: &[usize], perm: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let od: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let out = (0..x.len())
        .map(|i| {
            let oi = unravel(i, &od);
            let mut ii = vec![0; dims.len()];
            for (j, &p) in perm.iter().enumerate() {
                ii[p] = oi[j];
            }
            x[ravel(&ii, dims)]
        })
        .collect();
    (out, od)
}

/// Elements `start..start+len` of dim `d`.
pub fn ref_narrow(
    x: &[f64],
    dims: &[usize],
    d: usize,
    start: usize,
    len: usize,
) -> (Vec<f64>, Vec<usize>) {
    let mut od = dims.to_vec();
    od[d] = len;
    let out = (0..numel(&od))
        .map(|i| {
            let mut idx = unravel(i, &od);
            idx[d] += start;
            x[ravel(&idx, dims)]
        })
        .collect();
    (out, od)
}

/// `[..., m, k] @ [..., k, n]` with broadcast batch dims.
pub fn ref_matmul(a: &[f64], ad: &[usize], b: &[f64], bd: &[usize]) -> (Vec<f64>, Vec<usize>) {
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (k2, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    assert_eq!(k, k2);
    let ba = &ad[..ad.len() - 2];
    let bb = &bd[..bd.len() - 2];
    let bo = bcast_shape(ba, bb).expect("batch dims broadcast");
    let nb = numel(&bo);
    let mut out = vec![0.0; nb * m * n];
    let (sa, sb) = (m * k, k * n);
    for bi in 0..nb {
        let idx = unravel(bi, &bo);
        // Batch offsets of a and b via their own (broadcast) batch dims.
        let ia = bcast_index(ba, &idx);
        let ib = bcast_index(bb, &idx);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    s += a[ia * sa + i * k + p] * b[ib * sb + p * n + j];
                }
                out[bi * m * n + i * n + j] = s;
            }
        }
    }
    let mut od = bo;
    od.extend([m, n]);
    (out, od)
}

/// The flat index into a tensor of `dims` of the element that broadcasts to `out_idx`.
pub fn bcast_index(dims: &[usize], out_idx: &[usize]) -> usize {
    let lead = out_idx.len() - dims.len();
    let mut f = 0;
    for (j, &d) in dims.iter().enumerate() {
        f = f * d + if d == 1 { 0 } else { out_idx[lead + j] };
    }
    f
}

/// Softmax (or log-softmax) along dim `d`, computed naively in f64.
pub fn ref_softmax(x: &[f64], dims: &[usize], d: usize, log: bool) -> Vec<f64> {
    let mut out = vec![0.0; x.len()];
    let mut kept = dims.to_vec();
    kept[d] = 1;
    for o in 0..numel(&kept) {
        let mut idx = unravel(o, &kept);
        let pos: Vec<usize> = (0..dims[d])
            .map(|j| {
                idx[d] = j;
                ravel(&idx, dims)
            })
            .collect();
        let m = pos.iter().map(|&p| x[p]).fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = pos.iter().map(|&p| (x[p] - m).exp()).sum();
        for &p in &pos {
            out[p] = if log {
                x[p] - m - s.ln()
            } else {
                (x[p] - m).exp() / s
            };
        }
    }
    out
}

/// Layer norm over the last dim (biased variance): returns `(y, mean, rstd)`.
pub fn ref_layer_norm(
    x: &[f64],
    cols: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / cols;
    let mut y = vec![0.0; x.len()];
    let (mut mean, mut rstd) = (vec![0.0; rows], vec![0.0; rows]);
    for r in 0..rows {
        let row = &x[r * cols..(r + 1) * cols];
        let mu = row.iter().sum::<f64>() / cols as f64;
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / cols as f64;
        let rs = 1.0 / (var + eps).sqrt();
        mean[r] = mu;
        rstd[r] = rs;
        for c in 0..cols {
            let mut v = (row[c] - mu) * rs;
            if let Some(w) = w {
                v *= w[c];
            }
            if let Some(b) = b {
                v += b[c];
            }
            y[r * cols + c] = v;
        }
    }
    (y, mean, rstd)
}

/// Naive attention over `[bh, tq, d]`, `[bh, tk, d]`: `softmax(q kᵀ·scale + mask) v`, with the
/// causal mask aligned bottom-right (query i sees keys j <= i + tk - tq). Returns `(out, lse)`.
#[allow(clippy::too_many_arguments)]
pub fn ref_attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    bh: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
    scale: f64,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0; bh * tq * d];
    let mut lse = vec![0.0; bh * tq];
    for b in 0..bh {
        for i in 0..tq {
            let mut s = vec![f64::NEG_INFINITY; tk];
            for (j, sj) in s.iter_mut().enumerate() {
                if causal && j > i + (tk - tq) {
                    continue;
                }
                let mut dot = 0.0;
                for c in 0..d {
                    dot += q[(b * tq + i) * d + c] * k[(b * tk + j) * d + c];
                }
                *sj = dot * scale;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|&x| (x - m).exp()).sum();
            lse[b * tq + i] = m + z.ln();
            for (j, &sj) in s.iter().enumerate() {
                let p = (sj - m).exp() / z;
                for c in 0..d {
                    out[(b * tq + i) * d + c] += p * v[(b * tk + j) * d + c];
                }
            }
        }
    }
    (out, lse)
}

/// erf by its Maclaurin series (accurate to ~1e-14 absolute for |x| <= 3.5).
pub fn erf(x: f64) -> f64 {
    assert!(x.abs() <= 3.5, "reference erf only for |x| <= 3.5");
    let mut term = x;
    let mut sum = x;
    let x2 = x * x;
    for n in 1..200 {
        term *= -x2 / n as f64;
        let t = term / (2 * n + 1) as f64;
        sum += t;
        if t.abs() < 1e-18 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

pub fn gelu_tanh(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

pub fn gelu_erf(x: f64) -> f64 {
    0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
}

// ----- tensors -----

/// Values of a tensor as f64 (row-major).
pub fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("to_vec_f64")
}

/// A contiguous tensor of `dtype` holding `v` (rounded to the dtype), on the CPU.
pub fn tensor(v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    tensor_on(Device::Cpu, v, dims, dtype)
}

/// A contiguous tensor of `dtype` holding `v` (rounded to the dtype on the host), on `device`.
pub fn tensor_on(device: Device, v: &[f64], dims: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap()
}

/// How a test tensor is laid out in memory.
#[derive(Clone, Debug)]
pub enum Lay {
    /// Row-major, offset 0.
    Contig,
    /// Physically stored with dims in the order `perm` (result dim `perm[i]` is physical dim
    /// `i`), the last physical dim padded with `pad` NaN elements on each side, so the view is
    /// strided and at an offset. Reading a padding element poisons the result with NaN.
    Strided { perm: Vec<usize>, pad: usize },
}

impl Lay {
    /// A random layout for a tensor of rank `rank` (contiguous about a quarter of the time).
    pub fn random(rng: &mut Rng, rank: usize) -> Lay {
        if rng.below(4) == 0 {
            Lay::Contig
        } else {
            Lay::Strided {
                perm: rng.perm(rank),
                pad: rng.range(if rank < 2 { 1 } else { 0 }, 2),
            }
        }
    }
}

/// A tensor of `dtype` with logical values `v` (shape `dims`) in layout `lay`, on the CPU.
pub fn strided(v: &[f64], dims: &[usize], lay: &Lay, dtype: DType) -> Tensor {
    strided_on(Device::Cpu, v, dims, lay, dtype)
}

/// A tensor of `dtype` on `device` with logical values `v` (shape `dims`) in layout `lay`. The
/// values are placed with the test's own index arithmetic; only `from_vec`, `to_dtype` of a
/// contiguous buffer, `to_device`, `narrow` and `permute` are used to build the view.
pub fn strided_on(device: Device, v: &[f64], dims: &[usize], lay: &Lay, dtype: DType) -> Tensor {
    match lay {
        Lay::Contig => tensor_on(device, v, dims, dtype),
        Lay::Strided { perm, pad } => {
            let rank = dims.len();
            if rank == 0 {
                return tensor_on(device, v, dims, dtype);
            }
            // Physical dim i holds logical dim perm[i].
            let mut pd: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
            let last = pd[rank - 1];
            pd[rank - 1] = last + 2 * pad;
            let mut buf = vec![f64::NAN; numel(&pd)];
            for (i, &x) in v.iter().enumerate() {
                let li = unravel(i, dims);
                let mut pi: Vec<usize> = perm.iter().map(|&p| li[p]).collect();
                pi[rank - 1] += pad;
                buf[ravel(&pi, &pd)] = x;
            }
            let phys = tensor_on(device, &buf, &pd, dtype);
            let phys = phys.narrow(-1, *pad, last).unwrap();
            // Result dim j is logical dim j, which is physical dim inv[j].
            let mut inv = vec![0; rank];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            phys.permute(&inv).unwrap()
        }
    }
}

/// Uniform random values in `[lo, hi)` from the crate's counter-based RNG (as f64).
pub fn uniform_vals(seed: u64, n: usize, lo: f64, hi: f64) -> Vec<f64> {
    vals(
        &Random::new(seed)
            .dtype(DType::F64)
            .uniform(n, lo, hi)
            .unwrap(),
    )
}

/// Values rounded through `dtype` (what a tensor of that dtype holds).
pub fn round_to(v: &[f64], dtype: DType) -> Vec<f64> {
    vals(&tensor(v, &[v.len()], dtype))
}

// ----- checks -----

/// `(rtol, atol)` of the RMSNorm, rotary and SwiGLU tests for results in `dtype`.
pub fn tols(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-6),
        _ => (2e-2, 2e-2),
    }
}

/// Asserts `|a - e| <= atol + rtol |e|` elementwise (NaN never passes), naming the first
/// mismatching index.
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{what}: {} values, expected {}",
        actual.len(),
        expected.len()
    );
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let ok = if e.is_infinite() {
            a == e
        } else {
            (a - e).abs() <= atol + rtol * e.abs()
        };
        if !ok {
            panic!(
                "{what}: first mismatch at index {i}: got {a:e}, expected {e:e} (|diff| {:e}, rtol {rtol:e}, atol {atol:e})",
                (a - e).abs()
            );
        }
    }
}

/// Checks shape and values of `t` against a reference.
#[track_caller]
pub fn check(t: &Tensor, dims: &[usize], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(t.dims(), dims, "{what}: shape");
    assert_close(&vals(t), expected, rtol, atol, what);
}

/// Tight f64 tolerance.
pub const F64_TOL: (f64, f64) = (1e-12, 1e-12);
/// f32 tolerance.
pub const F32_TOL: (f64, f64) = (1e-5, 1e-6);
