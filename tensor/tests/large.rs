//! Sizes past the kernels' parallel thresholds (32K elements for elementwise, reductions, copies
//! and row ops; the gemm and attention work thresholds; 16K for random fills and optimizer
//! chunks), with strided operands and sizes that are not multiples of the tile or chunk sizes.

mod common;

use common::*;
use meshgrad_tensor::{
    test_device, AdamWStep, AttentionMask, DType, Device, Random, Result, Tensor,
};

fn perm_lay(perm: &[usize], pad: usize) -> Lay {
    Lay::Strided {
        perm: perm.to_vec(),
        pad,
    }
}

fn large_broadcast_binary_and_unary(device: Device) -> Result<()> {
    let (ad, bd) = (vec![37, 1, 1001], vec![53, 1]);
    let a = uniform_vals(1, numel(&ad), -2.0, 2.0);
    let b = uniform_vals(2, numel(&bd), 0.5, 2.0);
    for dtype in [DType::F64, DType::F32] {
        let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
        let ta = strided_on(device, &a, &ad, &perm_lay(&[2, 0, 1], 1), dtype);
        let tb = strided_on(device, &b, &bd, &perm_lay(&[1, 0], 1), dtype);
        let (exp, od) = ref_binary(&ar, &ad, &br, &bd, |x, y| x / y);
        let (rtol, atol) = if dtype == DType::F64 {
            F64_TOL
        } else {
            F32_TOL
        };
        check(
            &ta.div(&tb).unwrap(),
            &od,
            &exp,
            rtol,
            atol,
            &format!("large div {dtype}"),
        );
        let exp = ref_unary(&ar, |x| x.tanh());
        check(
            &ta.tanh().unwrap(),
            &ad,
            &exp,
            rtol,
            atol,
            &format!("large tanh {dtype}"),
        );
        let exp = ref_unary(&ar, gelu_erf);
        check(
            &ta.gelu(meshgrad_tensor::GeluKind::Erf).unwrap(),
            &ad,
            &exp,
            rtol,
            atol.max(1e-12),
            &format!("large gelu {dtype}"),
        );
        let (exp, od) = ref_binary(&ar, &ad, &br, &bd, |x, y| if x > y { 1.0 } else { 0.0 });
        check(
            &ta.gt(&tb).unwrap(),
            &od,
            &exp,
            0.0,
            0.0,
            &format!("large gt {dtype}"),
        );
    }
    Ok(())
}
test_device!(large_broadcast_binary_and_unary);

fn large_reductions(device: Device) -> Result<()> {
    let dims = vec![67, 33, 41];
    let x = uniform_vals(3, numel(&dims), -1.0, 1.0);
    for dtype in [DType::F64, DType::F32] {
        let xr = round_to(&x, dtype);
        let t = strided_on(device, &x, &dims, &perm_lay(&[1, 2, 0], 2), dtype);
        let (rtol, atol) = if dtype == DType::F64 {
            F64_TOL
        } else {
            (1e-5, 1e-4)
        };
        for d in 0..3 {
            let (s, od) = ref_sum(&xr, &dims, &[d], false);
            check(
                &t.sum(&[d as isize], false).unwrap(),
                &od,
                &s,
                rtol,
                atol,
                &format!("large sum dim {d} {dtype}"),
            );
            let (mx, am) = ref_max_argmax(&xr, &dims, d);
            check(
                &t.max(d as isize, true).unwrap(),
                &{
                    let mut k = dims.clone();
                    k[d] = 1;
                    k
                },
                &mx,
                0.0,
                0.0,
                &format!("large max dim {d} {dtype}"),
            );
            assert_eq!(
                t.argmax(d as isize, false)
                    .unwrap()
                    .to_vec::<i64>()
                    .unwrap(),
                am,
                "large argmax dim {d} {dtype}"
            );
        }
        let total: f64 = xr.iter().sum();
        check(
            &t.sum_all().unwrap(),
            &[],
            &[total],
            rtol,
            atol * 10.0,
            &format!("large sum_all {dtype}"),
        );
    }
    Ok(())
}
test_device!(large_reductions);

fn large_matmul_with_strided_operands(device: Device) -> Result<()> {
    let (ad, bd) = (vec![2, 150, 70], vec![70, 131]);
    let a = uniform_vals(4, numel(&ad), -1.0, 1.0);
    let b = uniform_vals(5, numel(&bd), -1.0, 1.0);
    for dtype in [DType::F64, DType::F32] {
        let (exp, od) = ref_matmul(&round_to(&a, dtype), &ad, &round_to(&b, dtype), &bd);
        let (rtol, atol) = if dtype == DType::F64 {
            F64_TOL
        } else {
            (1e-5, 1e-4)
        };
        for (la, lb) in [
            (Lay::Contig, Lay::Contig),
            (perm_lay(&[0, 2, 1], 0), perm_lay(&[1, 0], 1)),
            (perm_lay(&[1, 0, 2], 1), Lay::Contig),
        ] {
            let out = strided_on(device, &a, &ad, &la, dtype)
                .matmul(&strided_on(device, &b, &bd, &lb, dtype))
                .unwrap();
            check(
                &out,
                &od,
                &exp,
                rtol,
                atol,
                &format!("large matmul {la:?} {lb:?} {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(large_matmul_with_strided_operands);

fn large_softmax_and_layer_norm(device: Device) -> Result<()> {
    let dims = vec![300, 133];
    let x = uniform_vals(6, numel(&dims), -4.0, 4.0);
    for dtype in [DType::F64, DType::F32] {
        let xr = round_to(&x, dtype);
        let (rtol, atol) = if dtype == DType::F64 {
            (1e-11, 1e-12)
        } else {
            (1e-4, 1e-6)
        };
        let t = strided_on(device, &x, &dims, &perm_lay(&[1, 0], 1), dtype);
        for d in [0usize, 1] {
            for log in [false, true] {
                let out = if log {
                    t.log_softmax(d as isize)
                } else {
                    t.softmax(d as isize)
                }
                .unwrap();
                check(
                    &out,
                    &dims,
                    &ref_softmax(&xr, &dims, d, log),
                    rtol,
                    atol,
                    &format!("large softmax(log={log}) dim {d} {dtype}"),
                );
            }
        }
        let w = uniform_vals(7, 133, 0.5, 1.5);
        let b = uniform_vals(8, 133, -0.5, 0.5);
        let (y, _, _) = ref_layer_norm(
            &xr,
            133,
            Some(&round_to(&w, dtype)),
            Some(&round_to(&b, dtype)),
            1e-5,
        );
        let out = t
            .layer_norm(
                Some(&tensor_on(device, &w, &[133], dtype)),
                Some(&tensor_on(device, &b, &[133], dtype)),
                1e-5,
            )
            .unwrap();
        check(
            &out.y,
            &dims,
            &y,
            rtol,
            atol.max(1e-5),
            &format!("large layer_norm {dtype}"),
        );
    }
    Ok(())
}
test_device!(large_softmax_and_layer_norm);

fn large_attention_forward_and_backward(device: Device) -> Result<()> {
    // Tiles of 32 queries by 64 keys: 100 queries and 131 keys cross both; causal with
    // seq_q < seq_k skips and splits tiles on the diagonal.
    let (bh, tq, tk, d) = (3, 100, 131, 24);
    let q = uniform_vals(9, bh * tq * d, -1.0, 1.0);
    let k = uniform_vals(10, bh * tk * d, -1.0, 1.0);
    let v = uniform_vals(11, bh * tk * d, -1.0, 1.0);
    let scale = 1.0 / (d as f64).sqrt();
    for causal in [false, true] {
        for dtype in [DType::F64, DType::F32] {
            let (out, lse) = ref_attention(
                &round_to(&q, dtype),
                &round_to(&k, dtype),
                &round_to(&v, dtype),
                bh,
                tq,
                tk,
                d,
                causal,
                scale,
            );
            let tq_ = strided_on(device, &q, &[bh, tq, d], &perm_lay(&[1, 0, 2], 0), dtype);
            let tk_ = tensor_on(device, &k, &[bh, tk, d], dtype);
            let tv_ = strided_on(device, &v, &[bh, tk, d], &perm_lay(&[0, 2, 1], 1), dtype);
            let o = Tensor::attention(&tq_, &tk_, &tv_, &mask(causal), scale).unwrap();
            let (rtol, atol) = if dtype == DType::F64 {
                (1e-10, 1e-12)
            } else {
                (1e-4, 1e-5)
            };
            check(
                &o.out,
                &[bh, tq, d],
                &out,
                rtol,
                atol,
                &format!("large attention causal={causal} {dtype}"),
            );
            check(
                &o.lse,
                &[bh, tq],
                &lse,
                rtol,
                atol,
                &format!("large attention lse causal={causal} {dtype}"),
            );
        }
        // Backward against a directional finite difference of L = <dout, attention(q, k, v)> in f64.
        let dout = uniform_vals(12, bh * tq * d, -1.0, 1.0);
        let (tq_, tk_, tv_) = (
            tensor_on(device, &q, &[bh, tq, d], DType::F64),
            tensor_on(device, &k, &[bh, tk, d], DType::F64),
            tensor_on(device, &v, &[bh, tk, d], DType::F64),
        );
        let o = Tensor::attention(&tq_, &tk_, &tv_, &mask(causal), scale).unwrap();
        let tdo = tensor_on(device, &dout, &[bh, tq, d], DType::F64);
        let g = Tensor::attention_backward(&tq_, &tk_, &tv_, &o, &tdo, &mask(causal), scale, false)
            .unwrap();
        let (gq, gk, gv) = (g.dq, g.dk, g.dv);
        let dirs = [
            uniform_vals(13, q.len(), -1.0, 1.0),
            uniform_vals(14, k.len(), -1.0, 1.0),
            uniform_vals(15, v.len(), -1.0, 1.0),
        ];
        let loss = |dq: f64, dk: f64, dv: f64| -> f64 {
            let sh = |x: &[f64], dir: &[f64], e: f64| {
                x.iter()
                    .zip(dir)
                    .map(|(a, b)| a + e * b)
                    .collect::<Vec<_>>()
            };
            let (o, _) = ref_attention(
                &sh(&q, &dirs[0], dq),
                &sh(&k, &dirs[1], dk),
                &sh(&v, &dirs[2], dv),
                bh,
                tq,
                tk,
                d,
                causal,
                scale,
            );
            o.iter().zip(&dout).map(|(a, b)| a * b).sum()
        };
        let eps = 1e-5;
        let dot =
            |g: &Tensor, dir: &[f64]| vals(g).iter().zip(dir).map(|(a, b)| a * b).sum::<f64>();
        let fd = [
            (loss(eps, 0.0, 0.0) - loss(-eps, 0.0, 0.0)) / (2.0 * eps),
            (loss(0.0, eps, 0.0) - loss(0.0, -eps, 0.0)) / (2.0 * eps),
            (loss(0.0, 0.0, eps) - loss(0.0, 0.0, -eps)) / (2.0 * eps),
        ];
        let an = [dot(&gq, &dirs[0]), dot(&gk, &dirs[1]), dot(&gv, &dirs[2])];
        assert_close(
            &an,
            &fd,
            1e-6,
            1e-6,
            &format!("large attention backward (directional) causal={causal}"),
        );
    }
    Ok(())
}
test_device!(large_attention_forward_and_backward);

fn large_copies_casts_and_in_place_writes(device: Device) -> Result<()> {
    let dims = vec![97, 61, 13];
    let x = uniform_vals(16, numel(&dims), -100.0, 100.0);
    let t = strided_on(device, &x, &dims, &perm_lay(&[2, 0, 1], 1), DType::F64);
    check(
        &t.contiguous().unwrap(),
        &dims,
        &x,
        0.0,
        0.0,
        "large contiguous",
    );
    check(
        &t.to_dtype(DType::F32).unwrap(),
        &dims,
        &round_to(&x, DType::F32),
        0.0,
        0.0,
        "large cast to f32",
    );
    assert_eq!(
        t.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(),
        x.iter().map(|v| v.trunc() as i64).collect::<Vec<_>>()
    );
    let (pv, _) = ref_permute(&x, &dims, &[2, 1, 0]);
    check(
        &t.permute(&[2, 1, 0])
            .unwrap()
            .reshape(numel(&dims))
            .unwrap(),
        &[numel(&dims)],
        &pv,
        0.0,
        0.0,
        "large permuted flatten",
    );
    // copy_from into a large strided view.
    let base = Tensor::zeros((97, 70, 13), DType::F64, device).unwrap();
    let view = base.narrow(1, 5, 61).unwrap();
    view.copy_from(&t).unwrap();
    check(&view, &dims, &x, 0.0, 0.0, "large copy_from into a narrow");
    let untouched = vals(&base.narrow(1, 0, 5).unwrap());
    assert!(untouched.iter().all(|&v| v == 0.0));
    Ok(())
}
test_device!(large_copies_casts_and_in_place_writes);

fn large_random_fills_and_masks_are_layout_invariant(device: Device) -> Result<()> {
    let n = 100_003;
    let start = 12_345u64;
    let f64s = Random::new(7).device(device).dtype(DType::F64);
    let whole = vals(&f64s.uniform(n, 0.0, 1.0).unwrap());
    let shard = vals(&f64s.offset(start).uniform((101, 401), 0.0, 1.0).unwrap());
    assert_eq!(shard, whole[start as usize..start as usize + 101 * 401]);
    let wn = vals(&Random::new(7).device(device).normal(n, 0.0, 1.0).unwrap());
    let sn = vals(
        &Random::new(7)
            .device(device)
            .offset(start)
            .normal(50_000, 0.0, 1.0)
            .unwrap(),
    );
    assert_eq!(sn, wn[start as usize..start as usize + 50_000]);
    let wm = vals(&Tensor::dropout_mask(7, 0, 0.1, n, DType::F32, device).unwrap());
    let sm = vals(&Tensor::dropout_mask(7, start, 0.1, 50_000, DType::F32, device).unwrap());
    assert_eq!(sm, wm[start as usize..start as usize + 50_000]);
    let dropped = wm.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
    assert!((dropped - 0.1).abs() < 0.01, "{dropped}");
    Ok(())
}
test_device!(large_random_fills_and_masks_are_layout_invariant);

fn large_cross_entropy_embedding_and_adamw(device: Device) -> Result<()> {
    let (n, v) = (300, 257);
    let x = uniform_vals(17, n * v, -3.0, 3.0);
    let targets: Vec<i64> = (0..n).map(|r| ((r * 37) % v) as i64).collect();
    let tl = tensor_on(device, &x, &[n, v], DType::F64);
    let (loss, _) = tl
        .cross_entropy_rows(&Tensor::from_vec(targets.clone(), n, device).unwrap(), None)
        .unwrap();
    let want: Vec<f64> = (0..n)
        .map(|r| {
            let row = &x[r * v..(r + 1) * v];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            m + row.iter().map(|a| (a - m).exp()).sum::<f64>().ln() - row[targets[r] as usize]
        })
        .collect();
    check(&loss, &[n], &want, 1e-12, 1e-12, "large cross_entropy");
    // Embedding gather / scatter over many rows.
    let (vocab, dim) = (50, 700);
    let w = uniform_vals(18, vocab * dim, -1.0, 1.0);
    let ids: Vec<i64> = (0..64).map(|i| (i * 7 % vocab) as i64).collect();
    let tids = Tensor::from_vec(ids.clone(), 64, device).unwrap();
    let out = tensor_on(device, &w, &[vocab, dim], DType::F32)
        .embedding(&tids)
        .unwrap();
    let exp: Vec<f64> = ids
        .iter()
        .flat_map(|&i| round_to(&w[i as usize * dim..(i as usize + 1) * dim], DType::F32))
        .collect();
    check(&out, &[64, dim], &exp, 0.0, 0.0, "large embedding");
    let g = uniform_vals(19, 64 * dim, -1.0, 1.0);
    let mut gw = vec![0.0; vocab * dim];
    for (p, &i) in ids.iter().enumerate() {
        for c in 0..dim {
            gw[i as usize * dim + c] += g[p * dim + c];
        }
    }
    check(
        &tensor_on(device, &g, &[64, dim], DType::F64)
            .embedding_backward(&tids, vocab)
            .unwrap(),
        &[vocab, dim],
        &gw,
        1e-15,
        0.0,
        "large embedding_backward",
    );
    // AdamW over more than one chunk.
    let m = 40_001;
    let p0 = uniform_vals(20, m, -1.0, 1.0);
    let gr = uniform_vals(21, m, -1.0, 1.0);
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
        step: 1,
    };
    let tp = tensor_on(device, &p0, &[m], DType::F64);
    let (tm, tv) = (
        Tensor::zeros(m, DType::F64, device).unwrap(),
        Tensor::zeros(m, DType::F64, device).unwrap(),
    );
    tp.adamw_step_(&tensor_on(device, &gr, &[m], DType::F64), &tm, &tv, &hp)
        .unwrap();
    let want: Vec<f64> = p0
        .iter()
        .zip(&gr)
        .map(|(&p, &g)| {
            let p = p * (1.0 - hp.lr * hp.weight_decay);
            let (mm, vv) = ((1.0 - hp.beta1) * g, (1.0 - hp.beta2) * g * g);
            p - hp.lr * (mm / (1.0 - hp.beta1)) / ((vv / (1.0 - hp.beta2)).sqrt() + hp.eps)
        })
        .collect();
    assert_close(&vals(&tp), &want, 1e-12, 1e-15, "large adamw");
    Ok(())
}
test_device!(large_cross_entropy_embedding_and_adamw);

fn large_backward_kernels(device: Device) -> Result<()> {
    let (rows, cols) = (260, 131);
    let x = uniform_vals(30, rows * cols, -2.0, 2.0);
    let dy = uniform_vals(31, rows * cols, -1.0, 1.0);
    let tx = tensor_on(device, &x, &[rows, cols], DType::F64);
    let tdy = strided_on(
        device,
        &dy,
        &[rows, cols],
        &perm_lay(&[1, 0], 1),
        DType::F64,
    );
    // softmax / log-softmax backward.
    for log in [false, true] {
        let y = ref_softmax(&x, &[rows, cols], 1, log);
        let mut exp = vec![0.0; x.len()];
        for r in 0..rows {
            let (yr, gr) = (&y[r * cols..(r + 1) * cols], &dy[r * cols..(r + 1) * cols]);
            let s: f64 = if log {
                gr.iter().sum()
            } else {
                yr.iter().zip(gr).map(|(a, b)| a * b).sum()
            };
            for c in 0..cols {
                exp[r * cols + c] = if log {
                    gr[c] - yr[c].exp() * s
                } else {
                    yr[c] * (gr[c] - s)
                };
            }
        }
        let out = tensor_on(device, &y, &[rows, cols], DType::F64)
            .softmax_backward(&tdy, -1, log)
            .unwrap();
        check(
            &out,
            &[rows, cols],
            &exp,
            1e-10,
            1e-12,
            &format!("large softmax_backward log={log}"),
        );
    }
    // layer norm backward.
    let w = uniform_vals(32, cols, 0.5, 1.5);
    let (_, mean, rstd) = ref_layer_norm(&x, cols, None, None, 1e-5);
    let (mut dx, mut dw, mut db) = (vec![0.0; x.len()], vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        let xh: Vec<f64> = (0..cols)
            .map(|c| (x[r * cols + c] - mean[r]) * rstd[r])
            .collect();
        let g: Vec<f64> = (0..cols).map(|c| dy[r * cols + c] * w[c]).collect();
        let (mg, mgx) = (
            g.iter().sum::<f64>() / cols as f64,
            g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / cols as f64,
        );
        for c in 0..cols {
            dx[r * cols + c] = rstd[r] * (g[c] - mg - xh[c] * mgx);
            dw[c] += dy[r * cols + c] * xh[c];
            db[c] += dy[r * cols + c];
        }
    }
    let tw = tensor_on(device, &w, &[cols], DType::F64);
    let ln = tx.layer_norm(Some(&tw), None, 1e-5).unwrap();
    let (gx, pg) = tx
        .layer_norm_backward(Some(&tw), &ln.mean, &ln.rstd, &tdy)
        .unwrap();
    check(
        &gx,
        &[rows, cols],
        &dx,
        1e-9,
        1e-12,
        "large layer_norm_backward dx",
    );
    let (gw, gb) = pg.unwrap();
    check(
        &gw,
        &[cols],
        &dw,
        1e-9,
        1e-11,
        "large layer_norm_backward dw",
    );
    check(
        &gb,
        &[cols],
        &db,
        1e-9,
        1e-11,
        "large layer_norm_backward db",
    );
    // gelu backward (tanh form).
    let c0 = (2.0 / std::f64::consts::PI).sqrt();
    let exp: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &g)| {
            let t = (c0 * (v + 0.044715 * v * v * v)).tanh();
            g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c0 * (1.0 + 3.0 * 0.044715 * v * v))
        })
        .collect();
    check(
        &tx.gelu_backward(&tdy, meshgrad_tensor::GeluKind::Tanh)
            .unwrap(),
        &[rows, cols],
        &exp,
        1e-12,
        1e-12,
        "large gelu_backward",
    );
    // cross-entropy backward.
    let targets: Vec<i64> = (0..rows)
        .map(|r| {
            if r % 9 == 0 {
                -1
            } else {
                ((r * 13) % cols) as i64
            }
        })
        .collect();
    let tt = Tensor::from_vec(targets.clone(), rows, device).unwrap();
    let (_, lse) = tx.cross_entropy_rows(&tt, Some(-1)).unwrap();
    let dl = uniform_vals(33, rows, 0.5, 1.5);
    let g = tx
        .cross_entropy_backward(
            &lse,
            &tt,
            &tensor_on(device, &dl, &[rows], DType::F64),
            Some(-1),
        )
        .unwrap();
    let ls = ref_softmax(&x, &[rows, cols], 1, false);
    let exp: Vec<f64> = (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            if targets[r] == -1 {
                0.0
            } else {
                dl[r] * (ls[i] - if c as i64 == targets[r] { 1.0 } else { 0.0 })
            }
        })
        .collect();
    check(
        &g,
        &[rows, cols],
        &exp,
        1e-10,
        1e-12,
        "large cross_entropy_backward",
    );
    Ok(())
}
test_device!(large_backward_kernels);

/// The attention mask with only the causal flag set.
fn mask(causal: bool) -> AttentionMask {
    AttentionMask {
        causal,
        ..AttentionMask::none()
    }
}
