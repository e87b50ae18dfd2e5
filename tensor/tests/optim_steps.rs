//! In-place optimizer steps (AdamW, SGD with momentum) against float64 references of the
//! documented update rules, on every device of `meshgrad_tensor::test_devices()`.

mod common;

use common::*;
use meshgrad_tensor::{test_device, AdamWStep, DType, Device, Result, Tensor};

/// `t` (built on the CPU by the shared helpers) on `device`.
fn on(device: Device, t: Tensor) -> Tensor {
    t.to_device(device).unwrap()
}

fn adamw_ref(hp: &AdamWStep, p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64]) {
    let bc1 = 1.0 - hp.beta1.powi(hp.step as i32);
    let bc2 = 1.0 - hp.beta2.powi(hp.step as i32);
    for i in 0..p.len() {
        p[i] *= 1.0 - hp.lr * hp.weight_decay;
        m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g[i];
        v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g[i] * g[i];
        p[i] -= hp.lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + hp.eps);
    }
}

fn adamw_steps_match_reference(device: Device) -> Result<()> {
    let n = 37;
    for dtype in [DType::F64, DType::F32] {
        let mut p = uniform_vals(1, n, -1.0, 1.0);
        p = round_to(&p, dtype);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let tp = on(device, tensor(&p, &[n], dtype));
        let (tm, tv) = (
            Tensor::zeros(n, dtype, device)?,
            Tensor::zeros(n, dtype, device)?,
        );
        for step in 1..=5u64 {
            let g = round_to(&uniform_vals(10 + step, n, -1.0, 1.0), dtype);
            let hp = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
            };
            adamw_ref(&hp, &mut p, &g, &mut m, &mut v);
            tp.adamw_step_(&on(device, tensor(&g, &[n], dtype)), &tm, &tv, &hp)?;
            let (rtol, atol) = if dtype == DType::F64 {
                (1e-12, 1e-14)
            } else {
                (1e-5, 1e-6)
            };
            assert_close(
                &vals(&tp),
                &p,
                rtol,
                atol,
                &format!("adamw param step {step} {dtype}"),
            );
            assert_close(
                &vals(&tm),
                &m,
                rtol,
                atol,
                &format!("adamw m step {step} {dtype}"),
            );
            assert_close(
                &vals(&tv),
                &v,
                rtol,
                atol,
                &format!("adamw v step {step} {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(adamw_steps_match_reference);

fn sgd_momentum_steps_match_reference(device: Device) -> Result<()> {
    let n = 29;
    let (lr, mom, wd) = (0.1, 0.9, 0.01);
    let mut p = uniform_vals(2, n, -1.0, 1.0);
    let mut buf = vec![0.0; n];
    let tp = on(device, tensor(&p, &[n], DType::F64));
    let tb = Tensor::zeros(n, DType::F64, device)?;
    for step in 0..4u64 {
        let g = uniform_vals(20 + step, n, -1.0, 1.0);
        for i in 0..n {
            let gi = g[i] + wd * p[i];
            buf[i] = if step == 0 { gi } else { mom * buf[i] + gi };
            p[i] -= lr * buf[i];
        }
        let tg = on(device, tensor(&g, &[n], DType::F64));
        tp.sgd_step_(&tg, &tb, lr, mom, wd, step == 0)?;
        assert_close(
            &vals(&tp),
            &p,
            1e-12,
            1e-14,
            &format!("sgd param step {step}"),
        );
        assert_close(
            &vals(&tb),
            &buf,
            1e-12,
            1e-14,
            &format!("sgd buf step {step}"),
        );
    }
    Ok(())
}
test_device!(sgd_momentum_steps_match_reference);

fn optimizer_steps_check_their_operands(device: Device) -> Result<()> {
    let hp = AdamWStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
        step: 1,
    };
    let z = |s: (usize, usize), dt| Tensor::zeros(s, dt, device).unwrap();
    let p = z((3, 4), DType::F32);
    // A non-contiguous parameter, a mismatched grad shape or dtype are refused.
    assert!(p
        .t()
        .unwrap()
        .adamw_step_(
            &z((4, 3), DType::F32),
            &z((4, 3), DType::F32),
            &z((4, 3), DType::F32),
            &hp
        )
        .is_err());
    assert!(p
        .adamw_step_(
            &z((4, 3), DType::F32),
            &z((3, 4), DType::F32),
            &z((3, 4), DType::F32),
            &hp
        )
        .is_err());
    assert!(p
        .adamw_step_(
            &z((3, 4), DType::F64),
            &z((3, 4), DType::F32),
            &z((3, 4), DType::F32),
            &hp
        )
        .is_err());
    assert!(p
        .sgd_step_(
            &z((3, 4), DType::F32),
            &z((2, 6), DType::F32),
            0.1,
            0.9,
            0.0,
            true
        )
        .is_err());
    // Half-precision parameters are refused (use f32 master weights).
    let h = z((3, 4), DType::BF16);
    let hz = || h.zeros_like().unwrap();
    assert!(h.adamw_step_(&hz(), &hz(), &hz(), &hp).is_err());
    assert!(h.sgd_step_(&hz(), &hz(), 0.1, 0.9, 0.0, true).is_err());
    // Operands sharing storage are refused (not a deadlock on the storage lock).
    let m = z((3, 4), DType::F32);
    let e = p
        .adamw_step_(&p, &m, &z((3, 4), DType::F32), &hp)
        .unwrap_err()
        .to_string();
    assert!(e.contains("share storage"), "{e}");
    assert!(p
        .adamw_step_(&z((3, 4), DType::F32), &m, &m.reshape((3, 4)).unwrap(), &hp)
        .is_err());
    assert!(p.sgd_step_(&m, &m, 0.1, 0.9, 0.0, true).is_err());
    Ok(())
}
test_device!(optimizer_steps_check_their_operands);
