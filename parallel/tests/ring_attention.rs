//! Ring attention (`meshgrad_autograd::distributed::ring_attention`) against single-device fused
//! attention over the whole sequence: every rank of a context-parallel group of threads (the
//! in-process backend, with sends that rendezvous as NCCL's and MPI's large sends do) holds
//! chunks `i` and `2C - 1 - i`; its output rows and its gradients of q, k and v must equal the
//! same rows of the single-device run's, in f64 (to 1e-12) and f32 (to 1e-5). Causal (GPT,
//! Llama) and non-causal with key padding (BERT), for C = 1, 2, 3, 4.

use std::sync::Arc;
use std::time::Duration;

use meshgrad_autograd::distributed::{ring_attention, ChunkOrder, Collectives, RingAttention};
use meshgrad_autograd::Var;
use meshgrad_parallel::comm::{run_ranks, RunOptions};
use meshgrad_parallel::tp::CommCollectives;
use meshgrad_tensor::{AttentionMask, DType, Device, Random, Result, Tensor};

const B: usize = 2;
const H: usize = 3;
const D: usize = 4;

/// What the single device computes: output and gradients of q, k, v for upstream gradient `w`.
struct Full {
    out: Tensor,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
}

fn randn(seed: u64, dims: &[usize], dtype: DType) -> Tensor {
    Random::new(seed)
        .dtype(DType::F64)
        .device(Device::Cpu)
        .normal(dims.to_vec(), 0.0, 1.0)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Key padding `[B, T]`: batch entry 1 hides a few keys (never all of a row's keys).
fn padding(t: usize) -> Tensor {
    let v: Vec<i64> = (0..B * t)
        .map(|i| i64::from(!(i / t == 1 && (i % t) % 3 == 1)))
        .collect();
    Tensor::from_vec(v, (B, t), Device::Cpu).unwrap()
}

fn single_device(ops: [&Tensor; 4], mask: &AttentionMask<Var>, scale: f64) -> Full {
    let [q, k, v, w] = ops;
    let (q, k, v) = (
        Var::leaf(q.clone()),
        Var::leaf(k.clone()),
        Var::leaf(v.clone()),
    );
    let out = Var::attention(&q, &k, &v, mask, scale).unwrap();
    out.backward_with(w.clone()).unwrap();
    Full {
        out: out.tensor().clone(),
        dq: q.grad().unwrap(),
        dk: k.grad().unwrap(),
        dv: v.grad().unwrap(),
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// Runs ring attention on `cp` threads and compares every rank's rows with the single device.
fn check(cp: usize, t: usize, causal: bool, padded: bool, dtype: DType, tol: f64) {
    let dims = [B, H, t, D];
    let (q, k, v, w) = (
        randn(1, &dims, dtype),
        randn(2, &dims, dtype),
        randn(3, &dims, dtype),
        randn(4, &dims, dtype),
    );
    let scale = 1.0 / (D as f64).sqrt();
    let pad = padded.then(|| padding(t));
    let mut mask = AttentionMask {
        causal,
        ..AttentionMask::none()
    };
    if let Some(p) = &pad {
        mask = mask.with_key_padding(p.clone());
    }
    let full = single_device([&q, &k, &v, &w], &mask, scale);
    let opts = RunOptions::with_timeout(Duration::from_secs(20)).rendezvous();
    let per_rank = run_ranks(cp, &opts, |ctx| -> Result<Vec<(String, f64)>> {
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(ctx.comm.clone(), "cp"));
        let order = ChunkOrder::new(ctx.rank, cp);
        let local = |x: &Tensor| order.local_of(x, 2);
        let (lq, lk, lv) = (
            Var::leaf(local(&q)?),
            Var::leaf(local(&k)?),
            Var::leaf(local(&v)?),
        );
        let lpad = pad.as_ref().map(|p| order.local_of(p, 1)).transpose()?;
        let out = ring_attention(RingAttention {
            q: &lq,
            k: &lk,
            v: &lv,
            key_padding: lpad.as_ref(),
            causal,
            scale,
            group: &group,
        })?;
        out.backward_with(local(&w)?)?;
        Ok(vec![
            ("out".into(), max_abs_diff(out.tensor(), &local(&full.out)?)),
            (
                "dq".into(),
                max_abs_diff(&lq.grad().unwrap(), &local(&full.dq)?),
            ),
            (
                "dk".into(),
                max_abs_diff(&lk.grad().unwrap(), &local(&full.dk)?),
            ),
            (
                "dv".into(),
                max_abs_diff(&lv.grad().unwrap(), &local(&full.dv)?),
            ),
        ])
    })
    .unwrap();
    for (rank, diffs) in per_rank.iter().enumerate() {
        for (what, d) in diffs {
            assert!(
                *d <= tol,
                "cp={cp} t={t} causal={causal} padded={padded} {dtype:?}: rank {rank} {what} \
                 differs by {d:e} (tolerance {tol:e})"
            );
        }
    }
}

#[test]
fn causal_ring_attention_equals_one_device_f64() {
    for cp in [1, 2, 3, 4] {
        check(cp, 4 * cp, true, false, DType::F64, 1e-12);
    }
    // Longer chunks than the kernel's tiles.
    check(2, 160, true, false, DType::F64, 1e-12);
}

#[test]
fn non_causal_ring_attention_with_padding_equals_one_device_f64() {
    for cp in [1, 2, 3, 4] {
        check(cp, 6 * cp, false, true, DType::F64, 1e-12);
        check(cp, 2 * cp, false, false, DType::F64, 1e-12);
    }
}

#[test]
fn ring_attention_equals_one_device_f32() {
    check(2, 32, true, false, DType::F32, 1e-5);
    check(4, 32, true, false, DType::F32, 1e-5);
    check(2, 24, false, true, DType::F32, 1e-5);
}

#[test]
fn ring_attention_refuses_bad_shapes_in_one_line() {
    let opts = RunOptions::with_timeout(Duration::from_secs(10));
    let e = run_ranks(2, &opts, |ctx| {
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(ctx.comm.clone(), "cp"));
        let q = Var::leaf(randn(1, &[1, 2, 3, 4], DType::F32));
        ring_attention(RingAttention {
            q: &q,
            k: &q,
            v: &q,
            key_padding: None,
            causal: true,
            scale: 1.0,
            group: &group,
        })
        .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("local sequence of 3 positions is not two equal chunks"),
        "{e}"
    );
    assert!(e.contains("cp[0,1]"), "{e}");
}
