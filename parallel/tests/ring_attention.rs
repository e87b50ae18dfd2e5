//! Ring attention (`meshgrad_autograd::distributed::ring_attention`), and all-gather attention
//! (`allgather_attention`, `--cp-mode allgather`), against single-device fused
//! attention over the whole sequence: every rank of a context-parallel group of threads (the
//! in-process backend, with sends that rendezvous as NCCL's and MPI's large sends do) holds
//! chunks `i` and `2C - 1 - i`; its output rows and its gradients of q, k and v must equal the
//! same rows of the single-device run's, in f64 (to 1e-12) and f32 (to 1e-5). Causal (GPT,
//! Llama) and non-causal with key padding (BERT), for C = 1, 2, 3, 4.
//!
//! Reference mode's folded attention (`meshgrad_autograd::distributed::folded_attention`) and
//! per-leaf layers (`FoldedPositions::leafwise`) on C = 2, 4 ranks (with reference mode's tree
//! sums) give every rank's rows of one device's folded run bit for bit, and the plain
//! single-device attention's and linear's to rounding.

use std::sync::Arc;
use std::time::Duration;

use meshgrad_autograd::distributed::{
    allgather_attention, folded_attention, ring_attention, ChunkOrder, Collectives,
    FoldedPositions, RingAttention,
};
use meshgrad_autograd::Var;
use meshgrad_parallel::comm::tree::TreeReduce;
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

/// The single device's mask: causal or not, with the key padding `pad` if any.
fn mask_of(causal: bool, pad: Option<&Tensor>) -> AttentionMask<Var> {
    let mask = AttentionMask {
        causal,
        ..AttentionMask::none()
    };
    match pad {
        Some(p) => mask.with_key_padding(p.clone()),
        None => mask,
    }
}

/// This rank's chunks (`order`) of `q`, `k`, `v` (as leaves) and of the key padding.
fn local_operands(
    order: &ChunkOrder,
    qkv: [&Tensor; 3],
    pad: Option<&Tensor>,
) -> Result<([Var; 3], Option<Tensor>)> {
    let [q, k, v] = qkv.map(|x| order.local_of(x, 2).map(Var::leaf));
    let pad = pad.map(|p| order.local_of(p, 1)).transpose()?;
    Ok(([q?, k?, v?], pad))
}

/// Runs ring attention on `cp` threads and compares every rank's rows with the single device.
fn check(cp: usize, t: usize, causal: bool, padded: bool, dtype: DType, tol: f64) {
    check_with(ring_attention, cp, t, (causal, padded), dtype, tol)
}

/// [`check`] with the attention `attend` (the ring or the all-gather).
fn check_with(
    attend: fn(RingAttention<'_>) -> Result<Var>,
    cp: usize,
    t: usize,
    (causal, padded): (bool, bool),
    dtype: DType,
    tol: f64,
) {
    let dims = [B, H, t, D];
    let (q, k, v, w) = (
        randn(1, &dims, dtype),
        randn(2, &dims, dtype),
        randn(3, &dims, dtype),
        randn(4, &dims, dtype),
    );
    let scale = 1.0 / (D as f64).sqrt();
    let pad = padded.then(|| padding(t));
    let mask = mask_of(causal, pad.as_ref());
    let full = single_device([&q, &k, &v, &w], &mask, scale);
    let opts = RunOptions::with_timeout(Duration::from_secs(20)).rendezvous();
    let per_rank = run_ranks(cp, &opts, |ctx| -> Result<Vec<(String, f64)>> {
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(ctx.comm.clone(), "cp"));
        let order = ChunkOrder::new(ctx.rank, cp);
        let local = |x: &Tensor| order.local_of(x, 2);
        let ([lq, lk, lv], lpad) = local_operands(&order, [&q, &k, &v], pad.as_ref())?;
        let out = attend(RingAttention {
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
fn allgather_attention_equals_one_device() {
    for cp in [1, 2, 3, 4] {
        check_with(
            allgather_attention,
            cp,
            4 * cp,
            (true, false),
            DType::F64,
            1e-12,
        );
        check_with(
            allgather_attention,
            cp,
            6 * cp,
            (false, true),
            DType::F64,
            1e-12,
        );
    }
    check_with(
        allgather_attention,
        2,
        160,
        (true, false),
        DType::F64,
        1e-12,
    );
    check_with(allgather_attention, 4, 32, (true, false), DType::F32, 1e-5);
    check_with(allgather_attention, 2, 24, (false, true), DType::F32, 1e-5);
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

/// Each rank's rows of folded attention's output and gradients on `cp` ranks (reference mode's
/// tree sums) with `leaves` position leaves, as f64 values: `[out, dq, dk, dv]` per rank.
fn folded_rows(
    cp: usize,
    leaves: usize,
    ops: [&Tensor; 4],
    pad: Option<&Tensor>,
    causal: bool,
) -> Vec<[Vec<f64>; 4]> {
    let [q, k, v, w] = ops;
    let opts = RunOptions::with_timeout(Duration::from_secs(20));
    run_ranks(cp, &opts, |ctx| -> Result<[Vec<f64>; 4]> {
        let comm = TreeReduce::for_reference(ctx.comm.clone());
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(comm, "cp"));
        let order = ChunkOrder::new(ctx.rank, cp);
        let local = |x: &Tensor| order.local_of(x, 2);
        let ([lq, lk, lv], lpad) = local_operands(&order, [q, k, v], pad)?;
        let args = RingAttention {
            q: &lq,
            k: &lk,
            v: &lv,
            key_padding: lpad.as_ref(),
            causal,
            scale: 1.0 / (D as f64).sqrt(),
            group: &group,
        };
        let out = folded_attention(args, leaves)?;
        out.backward_with(local(w)?)?;
        Ok([
            out.tensor().to_vec_f64()?,
            lq.grad().unwrap().to_vec_f64()?,
            lk.grad().unwrap().to_vec_f64()?,
            lv.grad().unwrap().to_vec_f64()?,
        ])
    })
    .unwrap()
}

/// One device's `got` values against the plain op's `want`, named `whats`, to `tol`.
fn assert_close(op: &str, whats: &[&str], got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) {
    for (what, (a, b)) in whats.iter().zip(got.iter().zip(want)) {
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(
            d <= tol,
            "one device: {op}'s {what} differs from the plain op's by {d:e}"
        );
    }
}

/// Folded attention on `cp` ranks against one device's folded attention (bit for bit) and
/// plain single-device attention (to `tol`), every rank's rows.
fn check_folded(cp: usize, t: usize, causal: bool, padded: bool, tol: f64) {
    let dims = [B, H, t, D];
    let dtype = DType::F32;
    let ops: Vec<Tensor> = (1..=4).map(|s| randn(s, &dims, dtype)).collect();
    let ops = [&ops[0], &ops[1], &ops[2], &ops[3]];
    let pad = padded.then(|| padding(t));
    let mask = mask_of(causal, pad.as_ref());
    let full = single_device(ops, &mask, 1.0 / (D as f64).sqrt());
    let one = folded_rows(1, 4, ops, pad.as_ref(), causal).remove(0);
    let plain = [&full.out, &full.dq, &full.dk, &full.dv].map(|x| x.to_vec_f64().unwrap());
    assert_close(
        "folded attention",
        &["out", "dq", "dk", "dv"],
        &one,
        &plain,
        tol,
    );
    let per_rank = folded_rows(cp, 4, ops, pad.as_ref(), causal);
    for (rank, got) in per_rank.iter().enumerate() {
        let order = ChunkOrder::new(rank, cp);
        for (i, what) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            let n = one[i].len();
            let whole = Tensor::from_vec(one[i].clone(), n, Device::Cpu)
                .unwrap()
                .reshape(dims.to_vec())
                .unwrap();
            let want = order.local_of(&whole, 2).unwrap().to_vec_f64().unwrap();
            assert!(
                got[i] == want,
                "cp={cp} causal={causal} padded={padded}: rank {rank}'s {what} is not one \
                 device's folded attention's bits"
            );
        }
    }
}

#[test]
fn folded_attention_is_one_devices_bit_for_bit() {
    check_folded(2, 16, true, false, 1e-5);
    check_folded(4, 16, true, false, 1e-5);
    check_folded(2, 24, false, true, 1e-5);
    check_folded(4, 8, false, true, 1e-5);
}

/// A linear layer run per position leaf on `cp` ranks: `[y, dx, dW]` per rank (f64 values).
fn leafwise_linear(cp: usize, x: &Tensor, w: &Tensor, dy: &Tensor) -> Vec<[Vec<f64>; 3]> {
    let opts = RunOptions::with_timeout(Duration::from_secs(20));
    run_ranks(cp, &opts, |ctx| -> Result<[Vec<f64>; 3]> {
        let comm = TreeReduce::for_reference(ctx.comm.clone());
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(comm, "cp"));
        let positions = FoldedPositions::new(4, group)?;
        let order = ChunkOrder::new(ctx.rank, cp);
        let (lx, weight) = (Var::leaf(order.local_of(x, 1)?), Var::leaf(w.clone()));
        let y = positions.leafwise(&lx, 1, &[&weight], |xl| Var::linear(xl, &weight, None))?;
        y.backward_with(order.local_of(dy, 1)?)?;
        Ok([
            y.tensor().to_vec_f64()?,
            lx.grad().unwrap().to_vec_f64()?,
            weight.grad().unwrap().to_vec_f64()?,
        ])
    })
    .unwrap()
}

#[test]
fn a_layer_run_per_position_leaf_is_one_devices_bit_for_bit() {
    let (t, c, o) = (16, 6, 5);
    let x = randn(5, &[B, t, c], DType::F32);
    let w = randn(6, &[o, c], DType::F32);
    let dy = randn(7, &[B, t, o], DType::F32);
    let one = leafwise_linear(1, &x, &w, &dy).remove(0);
    // Against the plain layer (the weight gradient's sum is in another order: to rounding).
    let (xv, wv) = (Var::leaf(x.clone()), Var::leaf(w.clone()));
    let y = Var::linear(&xv, &wv, None).unwrap();
    y.backward_with(dy.clone()).unwrap();
    let plain =
        [y.tensor(), &xv.grad().unwrap(), &wv.grad().unwrap()].map(|x| x.to_vec_f64().unwrap());
    assert_close(
        "the per-leaf linear",
        &["y", "dx", "dW"],
        &one,
        &plain,
        1e-5,
    );
    for cp in [2, 4] {
        let per_rank = leafwise_linear(cp, &x, &w, &dy);
        for (rank, got) in per_rank.iter().enumerate() {
            let order = ChunkOrder::new(rank, cp);
            for (i, what) in ["y", "dx"].iter().enumerate() {
                let whole = Tensor::from_vec(one[i].clone(), one[i].len(), Device::Cpu)
                    .unwrap()
                    .reshape(vec![B, t, if i == 0 { o } else { c }])
                    .unwrap();
                let want = order.local_of(&whole, 1).unwrap().to_vec_f64().unwrap();
                assert!(
                    got[i] == want,
                    "cp={cp}: rank {rank}'s {what} differs from one device's"
                );
            }
            // The weight gradient lands whole on the group's first rank, zero on the others.
            let want = if rank == 0 {
                one[2].clone()
            } else {
                vec![0.0; one[2].len()]
            };
            assert!(
                got[2] == want,
                "cp={cp}: rank {rank}'s dW is not one device's tree"
            );
        }
    }
}

#[test]
fn a_context_parallel_ranks_chunks_are_a_block_of_the_position_leaves() {
    // K = 4 leaves, 8 fine chunks of 2 positions, T = 16. Under cp = 2 rank 1 holds chunks 1
    // and 2 of 4 (positions 4..8 and 8..12): fine chunks 2, 3 and 4, 5, leaves 2 and 3.
    let opts = RunOptions::with_timeout(Duration::from_secs(10));
    let per_rank = run_ranks(2, &opts, |ctx| -> Result<_> {
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(ctx.comm.clone(), "cp"));
        let f = FoldedPositions::new(4, group)?;
        let t = Tensor::from_vec((0..8i64).collect::<Vec<_>>(), (1, 8), Device::Cpu)?;
        let leaves = [f.leaf(&t, 1, 0)?, f.leaf(&t, 1, 1)?];
        Ok((
            f.local_leaves(),
            [f.leaf_ranges(8, 0)?, f.leaf_ranges(8, 1)?],
            (0..4).map(|c| f.global_chunk(c)).collect::<Vec<_>>(),
            [f.owner_of(5), f.owner_of(7)],
            leaves[0].to_vec::<i64>()?,
            f.assemble(&leaves, 1)?.to_vec::<i64>()?,
        ))
    })
    .unwrap();
    let (n, ranges, chunks, owners, leaf0, back) = &per_rank[1];
    assert_eq!(*n, 2);
    // Leaf 2 = fine chunks 2 and 5: local 0..2 and, mirrored, 6..8.
    assert_eq!(*ranges, [[0..2, 6..8], [2..4, 4..6]]);
    assert_eq!(*chunks, [2, 3, 4, 5]);
    assert_eq!(*owners, [(1, 3), (0, 3)]);
    assert_eq!(*leaf0, [0, 1, 6, 7]);
    assert_eq!(*back, (0..8).collect::<Vec<i64>>());
    // Rank 0 holds chunks 0 and 3 of 4: fine chunks 0, 1 and 6, 7 (leaves 0 and 1).
    assert_eq!(per_rank[0].2, [0, 1, 6, 7]);
    let e = run_ranks(4, &opts, |ctx| {
        let group: Arc<dyn Collectives> = Arc::new(CommCollectives::new(ctx.comm.clone(), "cp"));
        FoldedPositions::new(2, group).map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("divisible by the context-parallel degree 4"),
        "{e}"
    );
}
