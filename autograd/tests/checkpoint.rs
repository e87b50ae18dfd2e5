//! Activation checkpointing: same outputs and (bitwise) same gradients as running the block
//! normally, for inputs and for parameters captured by the closure; recomputation during
//! backward; dropout masks reproduced; nested blocks; memory actually saved.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::*;
use meshgrad_autograd::{
    checkpoint, gradcheck, no_grad, BlockFn, DropoutSpec, GradcheckOptions, Var,
};
use meshgrad_tensor::alloc::{self, MemoryTracker};
use meshgrad_tensor::{DType, Result};

struct Params {
    w: Var,
    b: Var,
}

fn params(seed: u64, d: usize) -> Params {
    Params {
        w: Var::leaf(rand(seed, &[d, d], -0.5, 0.5)),
        b: Var::leaf(rand(seed + 1, &[d], -0.1, 0.1)),
    }
}

/// `tanh(x @ W + b)` with W and b captured, not passed.
fn block(p: &Params) -> impl Fn(&Var) -> Result<Var> + Send + Sync + Clone + 'static {
    let (w, b) = (p.w.clone(), p.b.clone());
    move |x: &Var| x.matmul(&w)?.add(&b)?.tanh()
}

fn as_block(f: impl Fn(&Var) -> Result<Var> + Send + Sync + 'static) -> BlockFn {
    Arc::new(move |v: &[Var]| f(&v[0]))
}

#[test]
fn checkpointed_block_matches_the_plain_run_bitwise() {
    let xt = rand(1, &[3, 4], -1.0, 1.0);
    // Plain.
    let p1 = params(10, 4);
    let x1 = Var::leaf(xt.clone());
    let y1 = block(&p1)(&x1).unwrap();
    y1.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    // Checkpointed, with identical parameter values.
    let p2 = params(10, 4);
    let x2 = Var::leaf(xt);
    let y2 = checkpoint(as_block(block(&p2)), std::slice::from_ref(&x2)).unwrap();
    assert_eq!(y2.op_name(), Some("checkpoint"));
    assert_bitwise(&vals(y2.tensor()), &vals(y1.tensor()), "output");
    y2.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_bitwise(&grad_of(&x2), &grad_of(&x1), "grad x");
    assert_bitwise(&grad_of(&p2.w), &grad_of(&p1.w), "grad W");
    assert_bitwise(&grad_of(&p2.b), &grad_of(&p1.b), "grad b");
}

#[test]
fn the_block_is_recomputed_during_backward() {
    let calls = Arc::new(AtomicUsize::new(0));
    let p = params(20, 3);
    let f = block(&p);
    let c = calls.clone();
    let blk: BlockFn = Arc::new(move |v: &[Var]| {
        c.fetch_add(1, Ordering::SeqCst);
        f(&v[0])
    });
    let x = Var::leaf(rand(21, &[2, 3], -1.0, 1.0));
    let y = checkpoint(blk, std::slice::from_ref(&x)).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // The forward ran without recording: the output's only node is the checkpoint.
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "recomputed once in backward"
    );
    assert!(x.grad().is_some() && p.w.grad().is_some() && p.b.grad().is_some());
}

#[test]
fn checkpoint_gradcheck() {
    // Inputs passed explicitly (W and b as inputs too, so finite differences see them).
    let blk: BlockFn = Arc::new(|v: &[Var]| v[0].matmul(&v[1])?.add(&v[2])?.tanh());
    let inputs = [
        rand(30, &[2, 3], -1.0, 1.0),
        rand(31, &[3, 3], -1.0, 1.0),
        rand(32, &[3], -0.5, 0.5),
    ];
    let r = gradcheck(
        |v| checkpoint(blk.clone(), v)?.sqr(),
        &inputs,
        GradcheckOptions::default(),
    );
    r.unwrap_or_else(|e| panic!("checkpoint gradcheck: {e}"));
}

#[test]
fn dropout_inside_a_checkpoint_reproduces_the_mask() {
    let spec = DropoutSpec {
        p: 0.5,
        seed: 99,
        start: 0,
    };
    let xt = rand(40, &[4, 6], -1.0, 1.0);
    let run = |ckpt: bool| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let p = params(41, 6);
        let x = Var::leaf(xt.clone());
        let f = {
            let w = p.w.clone();
            move |x: &Var| {
                x.matmul(&w)?
                    .dropout(spec)?
                    .gelu(meshgrad_tensor::GeluKind::Tanh)
            }
        };
        let y = if ckpt {
            checkpoint(as_block(f), std::slice::from_ref(&x)).unwrap()
        } else {
            f(&x).unwrap()
        };
        y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        (vals(y.tensor()), grad_of(&x), grad_of(&p.w))
    };
    let (y1, gx1, gw1) = run(false);
    let (y2, gx2, gw2) = run(true);
    assert!(y1.contains(&0.0), "dropout dropped something");
    assert_bitwise(&y2, &y1, "output");
    assert_bitwise(&gx2, &gx1, "grad x");
    assert_bitwise(&gw2, &gw1, "grad W");
}

#[test]
fn nested_checkpoints_match_the_plain_run() {
    let xt = rand(50, &[2, 4], -1.0, 1.0);
    // outer(x) = inner(x) @ W2 then tanh; inner(x) = tanh(x @ W1 + b1). W1 and b1 are used only
    // inside the inner block.
    let run = |mode: usize| -> Vec<Vec<f64>> {
        let p1 = params(51, 4);
        let p2 = params(53, 4);
        let x = Var::leaf(xt.clone());
        let inner = block(&p1);
        let inner_ck = {
            let inner = inner.clone();
            move |x: &Var| checkpoint(as_block(inner.clone()), std::slice::from_ref(x))
        };
        let w2 = p2.w.clone();
        let y = match mode {
            0 => inner(&x).unwrap().matmul(&w2).unwrap().tanh().unwrap(),
            1 => {
                let w2 = w2.clone();
                checkpoint(
                    as_block(move |x: &Var| inner(x)?.matmul(&w2)?.tanh()),
                    std::slice::from_ref(&x),
                )
                .unwrap()
            }
            _ => {
                let w2 = w2.clone();
                checkpoint(
                    as_block(move |x: &Var| inner_ck(x)?.matmul(&w2)?.tanh()),
                    std::slice::from_ref(&x),
                )
                .unwrap()
            }
        };
        y.sum_all().unwrap().backward().unwrap();
        [&x, &p1.w, &p1.b, &p2.w]
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.grad()
                    .map(|g| vals(&g))
                    .unwrap_or_else(|| panic!("mode {mode}: no gradient for variable {i}"))
            })
            .collect()
    };
    let plain = run(0);
    let single = run(1);
    let nested = run(2);
    for i in 0..plain.len() {
        assert_bitwise(
            &single[i],
            &plain[i],
            &format!("single checkpoint, gradient {i}"),
        );
        assert_bitwise(
            &nested[i],
            &plain[i],
            &format!("nested checkpoint, gradient {i}"),
        );
    }
}

#[test]
fn parameters_used_inside_and_outside_a_block() {
    let xt = rand(60, &[2, 3], -1.0, 1.0);
    let run = |ckpt: bool| -> (Vec<f64>, usize) {
        let p = params(61, 3);
        let fired = Arc::new(Mutex::new(0usize));
        let f2 = fired.clone();
        p.w.register_grad_ready_hook(Arc::new(move |_| {
            *f2.lock().unwrap() += 1;
            Ok(())
        }));
        let x = Var::leaf(xt.clone());
        let f = block(&p);
        let h = if ckpt {
            checkpoint(as_block(f), std::slice::from_ref(&x)).unwrap()
        } else {
            f(&x).unwrap()
        };
        // W used again outside the block.
        h.matmul(&p.w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let n = *fired.lock().unwrap();
        (grad_of(&p.w), n)
    };
    let (g1, n1) = run(false);
    let (g2, n2) = run(true);
    assert_bitwise(&g2, &g1, "grad W used inside and outside");
    assert_eq!((n1, n2), (1, 1), "the hook fires once per backward");
}

#[test]
fn constant_inputs_and_no_grad() {
    let p = params(70, 3);
    let x = Var::constant(rand(71, &[2, 3], -1.0, 1.0));
    let y = checkpoint(as_block(block(&p)), std::slice::from_ref(&x)).unwrap();
    assert!(y.requires_grad(), "parameters require grad");
    y.sum_all().unwrap().backward().unwrap();
    assert!(p.w.grad().is_some() && p.b.grad().is_some());
    assert!(x.grad().is_none());
    // Under no_grad the result is a constant and nothing is recorded.
    let y = no_grad(|| checkpoint(as_block(block(&p)), std::slice::from_ref(&x))).unwrap();
    assert!(!y.requires_grad());
    // Several inputs, one of which does not require grad.
    let a = Var::leaf(rand(72, &[2, 3], -1.0, 1.0));
    let c = Var::constant(rand(73, &[2, 3], -1.0, 1.0));
    let blk: BlockFn = Arc::new(|v: &[Var]| v[0].mul(&v[1])?.exp());
    checkpoint(blk, &[a.clone(), c.clone()])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (av, cv) = (vals(a.tensor()), vals(c.tensor()));
    let want: Vec<f64> = av.iter().zip(&cv).map(|(a, c)| c * (a * c).exp()).collect();
    assert_close(
        &grad_of(&a),
        &want,
        1e-15,
        0.0,
        "grad of the input that requires grad",
    );
    assert!(c.grad().is_none());
}

#[test]
fn checkpointing_saves_activation_memory() {
    // Four layers of tanh(x @ W + b) on a [64, 64] f32 activation: without checkpointing the
    // graph keeps each layer's intermediates alive; with it only the block input is kept.
    let d = 64;
    let ps: Vec<Params> = (0..4)
        .map(|i| {
            let p = params(80 + 2 * i, d);
            Params {
                w: Var::leaf(p.w.tensor().to_dtype(DType::F32).unwrap()),
                b: Var::leaf(p.b.tensor().to_dtype(DType::F32).unwrap()),
            }
        })
        .collect();
    let xt = rand(90, &[d, d], -1.0, 1.0).to_dtype(DType::F32).unwrap();
    let measure = |ckpt: bool| -> (usize, Vec<f64>) {
        for p in &ps {
            p.w.zero_grad();
            p.b.zero_grad();
        }
        let tr = MemoryTracker::new();
        let (bytes, out) = alloc::with_tracker(tr.clone(), || {
            let x = Var::leaf(xt.clone());
            let blocks: Vec<_> = ps.iter().map(block).collect();
            let y = if ckpt {
                let blocks = blocks.clone();
                checkpoint(
                    Arc::new(move |v: &[Var]| {
                        let mut h = v[0].clone();
                        for b in &blocks {
                            h = b(&h)?;
                        }
                        Ok(h)
                    }),
                    std::slice::from_ref(&x),
                )
                .unwrap()
            } else {
                let mut h = x.clone();
                for b in &blocks {
                    h = b(&h).unwrap();
                }
                h
            };
            let bytes = tr.stats().current;
            let loss = y.sum_all().unwrap();
            loss.backward().unwrap();
            (bytes, grad_of(&ps[0].w))
        });
        (bytes, out)
    };
    let (plain, g1) = measure(false);
    let (ckpt, g2) = measure(true);
    let act = d * d * 4;
    // Plain keeps x@W, +b and tanh per layer (>= 3 activations each, minus the output); the
    // checkpointed run holds the output alone.
    assert!(plain >= 10 * act, "plain run holds {plain} bytes");
    assert!(ckpt <= 2 * act, "checkpointed run holds {ckpt} bytes");
    assert_bitwise(&g2, &g1, "gradients of the first layer");
}
