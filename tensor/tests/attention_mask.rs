//! Attention with a key padding mask and an additive bias (`AttentionMask`), forward and
//! backward, against a float64 reference written here: an explicit softmax over the unmasked
//! scores of each row and the explicit softmax Jacobian. Padding only, bias only (every kind of
//! broadcast, strided bias views), causal + padding + bias, fully masked rows, the fused qkv
//! form, q of other ranks, f32 and bf16, and the errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, AttentionMask, DType, Device, Result, Tensor};

/// One masked attention problem with row-major f64 values: q `[batch.., tq, d]`, k and v
/// `[batch.., tk, d]`, a padding mask `[batch[0], tk]` and a bias of `bias_dims` that broadcasts
/// to `[batch.., tq, tk]`.
struct Case {
    batch: Vec<usize>,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
    pad: Option<Vec<i64>>,
    bias: Option<(Vec<f64>, Vec<usize>)>,
}

/// What the reference computes.
struct Want {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    /// The bias gradient, shaped like the bias.
    dbias: Option<Vec<f64>>,
}

impl Case {
    fn bh(&self) -> usize {
        numel(&self.batch)
    }
    fn q_dims(&self) -> Vec<usize> {
        let mut d = self.batch.clone();
        d.extend([self.tq, self.d]);
        d
    }
    fn k_dims(&self) -> Vec<usize> {
        let mut d = self.batch.clone();
        d.extend([self.tk, self.d]);
        d
    }
    fn score_dims(&self) -> Vec<usize> {
        let mut d = self.batch.clone();
        d.extend([self.tq, self.tk]);
        d
    }

    /// The softmax input of query `i`, key `j` of flat batch-head `b` from the scaled product
    /// `s`, or `None` where masked.
    fn score(&self, b: usize, i: usize, j: usize, s: f64) -> Option<f64> {
        if self.causal && j + self.tq > i + self.tk {
            return None;
        }
        let per_lead = numel(&self.batch[1.min(self.batch.len())..]);
        if let Some(p) = &self.pad {
            if p[(b / per_lead) * self.tk + j] == 0 {
                return None;
            }
        }
        let bias = match &self.bias {
            None => 0.0,
            Some((v, dims)) => {
                let mut idx = unravel(b, &self.batch);
                idx.extend([i, j]);
                bcast_get(v, dims, &idx)
            }
        };
        Some(s + bias)
    }

    /// Forward and backward in f64 from the definitions.
    fn reference(&self, q: &[f64], k: &[f64], v: &[f64], dout: &[f64], scale: f64) -> Want {
        let (bh, tq, tk, d) = (self.bh(), self.tq, self.tk, self.d);
        let mut out = vec![0.0; bh * tq * d];
        let mut lse = vec![f64::NEG_INFINITY; bh * tq];
        let mut dq = vec![0.0; bh * tq * d];
        let mut dk = vec![0.0; bh * tk * d];
        let mut dv = vec![0.0; bh * tk * d];
        let mut dz = vec![0.0; bh * tq * tk];
        for b in 0..bh {
            for i in 0..tq {
                let qi = &q[(b * tq + i) * d..(b * tq + i + 1) * d];
                let z: Vec<Option<f64>> = (0..tk)
                    .map(|j| {
                        let kj = &k[(b * tk + j) * d..(b * tk + j + 1) * d];
                        let s: f64 = qi.iter().zip(kj).map(|(a, b)| a * b).sum();
                        self.score(b, i, j, scale * s)
                    })
                    .collect();
                let m = z
                    .iter()
                    .flatten()
                    .cloned()
                    .fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // no visible key: out 0, lse -inf, no gradient
                }
                let tot: f64 = z.iter().flatten().map(|x| (x - m).exp()).sum();
                lse[b * tq + i] = m + tot.ln();
                let p: Vec<f64> = z
                    .iter()
                    .map(|x| x.map_or(0.0, |x| (x - m).exp() / tot))
                    .collect();
                let go = &dout[(b * tq + i) * d..(b * tq + i + 1) * d];
                let dp: Vec<f64> = (0..tk)
                    .map(|j| {
                        let vj = &v[(b * tk + j) * d..(b * tk + j + 1) * d];
                        go.iter().zip(vj).map(|(a, b)| a * b).sum()
                    })
                    .collect();
                for j in 0..tk {
                    // Softmax Jacobian: dz_j = Σ_j' dp_j' p_j' (δ_jj' - p_j).
                    let mut g = 0.0;
                    for jp in 0..tk {
                        g += dp[jp] * p[jp] * (if j == jp { 1.0 } else { 0.0 } - p[j]);
                    }
                    dz[(b * tq + i) * tk + j] = g;
                    for c in 0..d {
                        out[(b * tq + i) * d + c] += p[j] * v[(b * tk + j) * d + c];
                        dv[(b * tk + j) * d + c] += p[j] * go[c];
                        dq[(b * tq + i) * d + c] += scale * g * k[(b * tk + j) * d + c];
                        dk[(b * tk + j) * d + c] += scale * g * qi[c];
                    }
                }
            }
        }
        let dbias = self.bias.as_ref().map(|(bv, dims)| {
            let mut g = vec![0.0; bv.len()];
            let sd = self.score_dims();
            for (f, &x) in dz.iter().enumerate() {
                g[bcast_index(dims, &unravel(f, &sd))] += x;
            }
            g
        });
        Want {
            out,
            lse,
            dq,
            dk,
            dv,
            dbias,
        }
    }

    fn mask(
        &self,
        device: Device,
        pad_dtype: DType,
        bias_lay: &Lay,
        bias_dtype: DType,
    ) -> AttentionMask {
        let lead = self.batch.first().copied().unwrap_or(1);
        AttentionMask {
            causal: self.causal,
            key_padding: self.pad.as_ref().map(|p| {
                Tensor::from_vec(p.clone(), (lead, self.tk), device)
                    .unwrap()
                    .to_dtype(pad_dtype)
                    .unwrap()
            }),
            bias: self
                .bias
                .as_ref()
                .map(|(v, dims)| strided_on(device, v, dims, bias_lay, bias_dtype)),
        }
    }
}

/// A padding mask `[lead, tk]`: entry 0 pads a tail, entry 1 every third key, entry 2 all keys.
fn padding(lead: usize, tk: usize, rng: &mut Rng) -> Vec<i64> {
    let mut p = vec![1i64; lead * tk];
    for b in 0..lead {
        let row = &mut p[b * tk..(b + 1) * tk];
        match b {
            0 => {
                let keep = rng.range(1, tk.max(1));
                row[keep..].fill(0);
            }
            1 => row.iter_mut().step_by(3).for_each(|x| *x = 0),
            2 => row.fill(0),
            _ => {}
        }
    }
    p
}

fn bias(dims: &[usize], rng: &mut Rng) -> (Vec<f64>, Vec<usize>) {
    (rng.vec(numel(dims), -2.0, 2.0), dims.to_vec())
}

/// Runs `case` through `Tensor::attention` (random layouts) in `dtype` and checks the forward,
/// the backward and the bias gradient against the reference on rounded inputs.
fn run(device: Device, case: &Case, dtype: DType, rng: &mut Rng, what: &str) {
    let (qd, kd) = (case.q_dims(), case.k_dims());
    let q = rng.vec(numel(&qd), -2.0, 2.0);
    let k = rng.vec(numel(&kd), -1.5, 1.5);
    let v = rng.vec(numel(&kd), -1.0, 1.0);
    let dout = rng.vec(numel(&qd), -1.0, 1.0);
    let scale = 1.0 / (case.d.max(1) as f64).sqrt();
    let rounded = Case {
        batch: case.batch.clone(),
        pad: case.pad.clone(),
        bias: case
            .bias
            .as_ref()
            .map(|(v, d)| (round_to(v, bias_dtype(dtype)), d.clone())),
        ..*case
    };
    let want = rounded.reference(
        &round_to(&q, dtype),
        &round_to(&k, dtype),
        &round_to(&v, dtype),
        &round_to(&dout, dtype),
        scale,
    );
    let rank = qd.len();
    let tq_ = strided_on(device, &q, &qd, &Lay::random(rng, rank), dtype);
    let tk_ = strided_on(device, &k, &kd, &Lay::random(rng, rank), dtype);
    let tv_ = strided_on(device, &v, &kd, &Lay::random(rng, rank), dtype);
    let tdo = strided_on(device, &dout, &qd, &Lay::random(rng, rank), dtype);
    let bias_rank = case.bias.as_ref().map_or(1, |(_, d)| d.len());
    let pad_dtype = [DType::U8, DType::I64, DType::U32][rng.below(3)];
    let mask = case.mask(
        device,
        pad_dtype,
        &Lay::random(rng, bias_rank),
        bias_dtype(dtype),
    );
    let o = Tensor::attention(&tq_, &tk_, &tv_, &mask, scale).unwrap();
    let (rtol, atol) = match dtype {
        DType::F64 => (1e-10, 1e-12),
        DType::F32 => (1e-4, 1e-5),
        _ => (2e-2, 2e-2),
    };
    let w = format!(
        "{what} {dtype} batch {:?} tq {} tk {} d {}",
        case.batch, case.tq, case.tk, case.d
    );
    check(&o.out, &qd, &want.out, rtol, atol, &format!("out: {w}"));
    check(
        &o.lse,
        &qd[..rank - 1],
        &want.lse,
        rtol,
        atol,
        &format!("lse: {w}"),
    );
    assert!(
        vals(&o.out).iter().all(|x| x.is_finite()),
        "{w}: non-finite out"
    );
    let g = Tensor::attention_backward(&tq_, &tk_, &tv_, &o, &tdo, &mask, scale, true).unwrap();
    let gtol = if dtype == DType::F64 {
        (1e-9, 1e-11)
    } else {
        (rtol * 10.0, atol * 10.0)
    };
    check(&g.dq, &qd, &want.dq, gtol.0, gtol.1, &format!("dq: {w}"));
    check(&g.dk, &kd, &want.dk, gtol.0, gtol.1, &format!("dk: {w}"));
    check(&g.dv, &kd, &want.dv, gtol.0, gtol.1, &format!("dv: {w}"));
    match (&g.dbias, &want.dbias, &case.bias) {
        (Some(db), Some(wb), Some((_, dims))) => {
            assert_eq!(db.dtype(), bias_dtype(dtype), "{w}: dbias dtype");
            let n = (numel(&case.score_dims()) / wb.len()).max(1) as f64;
            check(
                db,
                dims,
                wb,
                gtol.0,
                gtol.1 * n.sqrt(),
                &format!("dbias: {w}"),
            );
        }
        (None, None, None) => {}
        _ => panic!("{w}: dbias presence"),
    }
    // Without asking for it there is no bias gradient, and the rest is unchanged.
    let g2 = Tensor::attention_backward(&tq_, &tk_, &tv_, &o, &tdo, &mask, scale, false).unwrap();
    assert!(g2.dbias.is_none());
    assert_eq!(vals(&g2.dq), vals(&g.dq), "{w}: dq depends on bias_grad");
}

/// The bias dtype used with q of `dtype` (bf16 q takes an f32 bias, to check the conversion).
fn bias_dtype(dtype: DType) -> DType {
    if dtype == DType::BF16 {
        DType::F32
    } else {
        dtype
    }
}

const SIZES: &[(usize, usize, usize, usize, usize)] = &[
    // (b, h, tq, tk, d)
    (1, 1, 1, 1, 1),
    (2, 2, 5, 5, 8),
    (3, 2, 7, 13, 16),
    (3, 1, 33, 70, 8),
    (4, 2, 20, 65, 4),
];

fn padding_only(device: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for &(b, h, tq, tk, d) in SIZES {
        let case = Case {
            batch: vec![b, h],
            tq,
            tk,
            d,
            causal: false,
            pad: Some(padding(b, tk, &mut rng)),
            bias: None,
        };
        for dtype in [DType::F64, DType::F32] {
            run(device, &case, dtype, &mut rng, "padding");
        }
    }
    Ok(())
}
test_device!(padding_only);

fn bias_only_with_every_broadcast(device: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    for &(b, h, tq, tk, d) in SIZES {
        for dims in [
            vec![b, h, tq, tk],
            vec![h, tq, tk],
            vec![b, 1, 1, tk],
            vec![tq, tk],
            vec![tk],
            vec![b, h, tq, 1],
            vec![1, h, 1, tk],
        ] {
            let case = Case {
                batch: vec![b, h],
                tq,
                tk,
                d,
                causal: false,
                pad: None,
                bias: Some(bias(&dims, &mut rng)),
            };
            for dtype in [DType::F64, DType::F32] {
                run(device, &case, dtype, &mut rng, &format!("bias {dims:?}"));
            }
        }
    }
    Ok(())
}
test_device!(bias_only_with_every_broadcast);

fn causal_padding_and_bias(device: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    for &(b, h, tq, tk, d) in SIZES {
        let case = Case {
            batch: vec![b, h],
            tq,
            tk,
            d,
            causal: true,
            pad: Some(padding(b, tk, &mut rng)),
            bias: Some(bias(&[h, tq, tk], &mut rng)),
        };
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            run(device, &case, dtype, &mut rng, "causal+padding+bias");
        }
    }
    Ok(())
}
test_device!(causal_padding_and_bias);

fn fully_masked_rows_are_zero_with_zero_gradients(device: Device) -> Result<()> {
    // Batch entry 2 pads every key; in the others query row 1 has a bias of -inf everywhere.
    let (b, h, tq, tk, d) = (3, 2, 4, 9, 4);
    let mut rng = Rng::new(4);
    let mut bv = rng.vec(tq * tk, -1.0, 1.0);
    bv[tk..2 * tk].fill(f64::NEG_INFINITY);
    let case = Case {
        batch: vec![b, h],
        tq,
        tk,
        d,
        causal: false,
        pad: Some(padding(b, tk, &mut rng)),
        bias: Some((bv, vec![tq, tk])),
    };
    // The reference has -inf in the bias: its gradient there is 0.
    for dtype in [DType::F64, DType::F32] {
        run(device, &case, dtype, &mut rng, "fully masked");
    }
    let (qd, kd) = (case.q_dims(), case.k_dims());
    let q = tensor_on(device, &rng.vec(numel(&qd), -1.0, 1.0), &qd, DType::F32);
    let k = tensor_on(device, &rng.vec(numel(&kd), -1.0, 1.0), &kd, DType::F32);
    let mask = case.mask(device, DType::U8, &Lay::Contig, DType::F32);
    let o = Tensor::attention(&q, &k, &k, &mask, 0.5).unwrap();
    let dout = Tensor::ones(o.out.shape(), DType::F32, device).unwrap();
    let g = Tensor::attention_backward(&q, &k, &k, &o, &dout, &mask, 0.5, true).unwrap();
    let (out, dq, lse) = (vals(&o.out), vals(&g.dq), vals(&o.lse));
    for bh in 0..b * h {
        for i in 0..tq {
            if bh / h == 2 || i == 1 {
                let r = (bh * tq + i) * d;
                assert!(out[r..r + d].iter().all(|&x| x == 0.0), "out {bh} {i}");
                assert!(dq[r..r + d].iter().all(|&x| x == 0.0), "dq {bh} {i}");
                assert_eq!(lse[bh * tq + i], f64::NEG_INFINITY);
            }
        }
    }
    let all = [vals(&g.dk), vals(&g.dv), vals(g.dbias.as_ref().unwrap())];
    assert!(
        all.iter().flatten().all(|x| x.is_finite()),
        "non-finite gradient"
    );
    // Row 1's bias gradient is 0 (nothing flows through a -inf score).
    assert!(vals(g.dbias.as_ref().unwrap())[tk..2 * tk]
        .iter()
        .all(|&x| x == 0.0));
    Ok(())
}
test_device!(fully_masked_rows_are_zero_with_zero_gradients);

fn other_ranks_of_q(device: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    // [B, T, D] with padding [B, Tk] and a [Tq, Tk] bias.
    let case = Case {
        batch: vec![3],
        tq: 6,
        tk: 10,
        d: 4,
        causal: true,
        pad: Some(padding(3, 10, &mut rng)),
        bias: Some(bias(&[6, 10], &mut rng)),
    };
    run(device, &case, DType::F64, &mut rng, "rank 3");
    // [T, D]: padding [1, Tk].
    let case = Case {
        batch: vec![],
        tq: 5,
        tk: 7,
        d: 3,
        causal: false,
        pad: Some(vec![1, 1, 0, 1, 0, 1, 1]),
        bias: Some(bias(&[5, 7], &mut rng)),
    };
    run(device, &case, DType::F64, &mut rng, "rank 2");
    // [B, X, Y, T, D]: a bias broadcast over X but not Y has to be expanded to fold X and Y.
    for dims in [
        vec![2, 1, 3, 4, 6],
        vec![1, 2, 1, 4, 6],
        vec![2, 2, 3, 1, 6],
    ] {
        let case = Case {
            batch: vec![2, 2, 3],
            tq: 4,
            tk: 6,
            d: 5,
            causal: false,
            pad: Some(padding(2, 6, &mut rng)),
            bias: Some(bias(&dims, &mut rng)),
        };
        run(
            device,
            &case,
            DType::F64,
            &mut rng,
            &format!("rank 5 bias {dims:?}"),
        );
    }
    Ok(())
}
test_device!(other_ranks_of_q);

fn qkv_form_matches_the_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    for &(b, heads, t, d, causal) in &[(3usize, 2usize, 9usize, 4usize, true), (3, 3, 40, 8, false)]
    {
        let c = heads * d;
        let case = Case {
            batch: vec![b, heads],
            tq: t,
            tk: t,
            d,
            causal,
            pad: Some(padding(b, t, &mut rng)),
            bias: Some(bias(&[heads, t, t], &mut rng)),
        };
        let x = rng.vec(b * t * 3 * c, -2.0, 2.0);
        let dout = rng.vec(b * t * c, -1.0, 1.0);
        // Split heads with own index arithmetic: part p, batch bi, head h, position s, column cc.
        let split = |src: &[f64], width: usize, off: usize| -> Vec<f64> {
            let mut o = vec![0.0; b * heads * t * d];
            for bi in 0..b {
                for h in 0..heads {
                    for s in 0..t {
                        for cc in 0..d {
                            o[((bi * heads + h) * t + s) * d + cc] =
                                src[(bi * t + s) * width + off + h * d + cc];
                        }
                    }
                }
            }
            o
        };
        let (q, k, v) = (
            split(&x, 3 * c, 0),
            split(&x, 3 * c, c),
            split(&x, 3 * c, 2 * c),
        );
        let scale = 0.7;
        let want = case.reference(&q, &k, &v, &split(&dout, c, 0), scale);
        let tx = tensor_on(device, &x, &[b, t, 3 * c], DType::F64);
        let mask = case.mask(device, DType::I64, &Lay::random(&mut rng, 3), DType::F64);
        let o = tx.attention_qkv(heads, &mask, scale).unwrap();
        assert_eq!(o.out.dims(), [b, t, c]);
        assert_close(
            &split(&vals(&o.out), c, 0),
            &want.out,
            1e-10,
            1e-12,
            "qkv out",
        );
        check(&o.lse, &[b, heads, t], &want.lse, 1e-10, 1e-12, "qkv lse");
        let tdo = tensor_on(device, &dout, &[b, t, c], DType::F64);
        let (g, db) = tx
            .attention_qkv_backward(&o, &tdo, heads, &mask, scale, true)
            .unwrap();
        let gv = vals(&g);
        assert_close(&split(&gv, 3 * c, 0), &want.dq, 1e-9, 1e-11, "qkv dq");
        assert_close(&split(&gv, 3 * c, c), &want.dk, 1e-9, 1e-11, "qkv dk");
        assert_close(&split(&gv, 3 * c, 2 * c), &want.dv, 1e-9, 1e-11, "qkv dv");
        check(
            &db.unwrap(),
            &[heads, t, t],
            want.dbias.as_ref().unwrap(),
            1e-9,
            1e-11,
            "qkv dbias",
        );
    }
    Ok(())
}
test_device!(qkv_form_matches_the_reference);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn mask_errors_name_the_shapes() {
    let q = Tensor::zeros((2, 3, 4, 8), DType::F32, Device::Cpu).unwrap();
    let k = Tensor::zeros((2, 3, 5, 8), DType::F32, Device::Cpu).unwrap();
    let err = |m: AttentionMask| {
        Tensor::attention(&q, &k, &k, &m, 1.0)
            .unwrap_err()
            .to_string()
    };
    let pad = |dims: &[usize], dt| {
        Tensor::ones(dims, DType::U8, Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap()
    };
    let e = err(AttentionMask::none().with_key_padding(pad(&[3, 5], DType::U8)));
    assert!(e.contains("[3, 5]") && e.contains("[2, 5]"), "{e}");
    let e = err(AttentionMask::none().with_key_padding(pad(&[2, 5], DType::F32)));
    assert!(e.contains("integer"), "{e}");
    let e =
        err(AttentionMask::none()
            .with_bias(Tensor::zeros((3, 4, 4), DType::F32, Device::Cpu).unwrap()));
    assert!(e.contains("[3, 4, 4]") && e.contains("[2, 3, 4, 5]"), "{e}");
    let e =
        err(AttentionMask::none()
            .with_bias(Tensor::zeros((4, 5), DType::I64, Device::Cpu).unwrap()));
    assert!(e.contains("bias"), "{e}");
    let qkv = Tensor::zeros((2, 4, 12), DType::F32, Device::Cpu).unwrap();
    let m = AttentionMask::causal().with_key_padding(pad(&[2, 3], DType::U8));
    let e = qkv.attention_qkv(2, &m, 1.0).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[2, 4]"), "{e}");
}
