//! Split backward (input pass, then weight pass): the same gradients as one full backward, bit
//! for bit, for a small model with an embedding, a layer norm, linear layers, a weight used
//! three times, a table tied between the embedding and the head, and a checkpointed block; the
//! input pass alone touches no parameter; gradient-ready hooks fire in the pass that completes
//! the gradient.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use meshgrad_autograd::{checkpoint, BlockFn, Var};
use meshgrad_tensor::{DType, Device, GeluKind, Result, Tensor};

const D: usize = 8;
const V: usize = 5;

struct Params {
    table: Var,
    ln_g: Var,
    ln_b: Var,
    w1: Var,
    b1: Var,
    scale: Var,
    w2: Var,
    b2: Var,
}

fn f32t(seed: u64, dims: &[usize], lo: f64, hi: f64) -> Tensor {
    rand(seed, dims, lo, hi).to_dtype(DType::F32).unwrap()
}

fn params(seed: u64) -> Params {
    Params {
        table: Var::leaf(f32t(seed, &[V, D], -1.0, 1.0)),
        ln_g: Var::leaf(f32t(seed + 1, &[D], 0.5, 1.5)),
        ln_b: Var::leaf(f32t(seed + 2, &[D], -0.1, 0.1)),
        w1: Var::leaf(f32t(seed + 3, &[D, D], -0.4, 0.4)),
        b1: Var::leaf(f32t(seed + 4, &[D], -0.1, 0.1)),
        scale: Var::leaf(f32t(seed + 5, &[D], 0.5, 1.5)),
        w2: Var::leaf(f32t(seed + 6, &[D, D], -0.4, 0.4)),
        b2: Var::leaf(f32t(seed + 7, &[D], -0.1, 0.1)),
    }
}

impl Params {
    fn all(&self) -> Vec<(&'static str, &Var)> {
        vec![
            ("table", &self.table),
            ("ln_g", &self.ln_g),
            ("ln_b", &self.ln_b),
            ("w1", &self.w1),
            ("b1", &self.b1),
            ("scale", &self.scale),
            ("w2", &self.w2),
            ("b2", &self.b2),
        ]
    }
}

fn ids() -> Tensor {
    Tensor::from_vec(vec![1i64, 4, 1, 0, 2, 4], (2, 3), Device::Cpu).unwrap()
}

fn targets() -> Tensor {
    Tensor::from_vec(vec![3i64, 0, 1, 4, 2, 2], (2, 3), Device::Cpu).unwrap()
}

/// `x` plays a later pipeline stage's input activation `[2, 3, D]`: an embedding of the ids is
/// added to it, then a layer norm, linear layers (`w1` four times, `b1` three times, once fused
/// with GELU), an elementwise scale, a block of `w2` (checkpointed or not) and the head tied to
/// the embedding table.
fn loss(p: &Params, x: &Var, checkpointed: bool) -> Result<Var> {
    let e = Var::embedding(&p.table, &ids())?;
    let h = x.add(&e)?.layer_norm(Some(&p.ln_g), Some(&p.ln_b), 1e-5)?;
    let h = Var::linear(&h, &p.w1, Some(&p.b1))?.gelu(GeluKind::Tanh)?;
    let h = Var::linear(&h, &p.w1, None)?.tanh()?;
    let h = Var::linear_gelu(&h, &p.w1, Some(&p.b1), GeluKind::Erf)?;
    let h = Var::linear(&h, &p.w1, Some(&p.b1))?.mul(&p.scale)?;
    let (w2, b2) = (p.w2.clone(), p.b2.clone());
    let block = move |v: &[Var]| Var::linear(&v[0], &w2, Some(&b2))?.tanh()?.add(&v[0]);
    let h = if checkpointed {
        let f: BlockFn = Arc::new(block);
        checkpoint(f, std::slice::from_ref(&h))?
    } else {
        block(std::slice::from_ref(&h))?
    };
    h.matmul(&p.table.transpose(0, 1)?)?
        .cross_entropy(&targets(), None)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn grad_bits(v: &Var, what: &str) -> Vec<u32> {
    bits(&v.grad().unwrap_or_else(|| panic!("{what}: no gradient")))
}

/// Full backward on one copy, split backward on another with the same values: every gradient
/// the same bits.
fn check_split_matches_full(checkpointed: bool) {
    let xt = f32t(100, &[2, 3, D], -1.0, 1.0);
    let (pa, pb) = (params(1), params(1));
    let (xa, xb) = (Var::leaf(xt.clone()), Var::leaf(xt));

    loss(&pa, &xa, checkpointed).unwrap().backward().unwrap();

    let lb = loss(&pb, &xb, checkpointed).unwrap();
    let weights = lb.backward_input(None, std::slice::from_ref(&xb)).unwrap();
    assert_eq!(grad_bits(&xb, "x"), grad_bits(&xa, "x"), "input gradient");
    for (name, p) in pb.all() {
        assert!(
            p.grad().is_none(),
            "{name} got a gradient in the input pass"
        );
    }
    weights.run().unwrap();
    assert_eq!(grad_bits(&xb, "x"), grad_bits(&xa, "x"), "input gradient");
    for ((name, a), (_, b)) in pa.all().into_iter().zip(pb.all()) {
        assert_eq!(grad_bits(b, name), grad_bits(a, name), "gradient of {name}");
    }
}

#[test]
fn input_then_weight_pass_equals_the_full_backward_bitwise() {
    check_split_matches_full(false);
}

#[test]
fn a_checkpointed_block_splits_too() {
    check_split_matches_full(true);
}

#[test]
fn gradients_accumulate_across_microbatches_as_with_full_backwards() {
    // Two microbatches on the same parameters, as a pipeline stage runs them: full, full
    // against input, input, weight, weight (the zero-bubble order).
    let (pa, pb) = (params(7), params(7));
    let xs: Vec<Tensor> = (0..2)
        .map(|i| f32t(200 + i, &[2, 3, D], -1.0, 1.0))
        .collect();
    for x in &xs {
        let x = Var::leaf(x.clone());
        loss(&pa, &x, false).unwrap().backward().unwrap();
    }
    let mut deferred = Vec::new();
    for x in &xs {
        let x = Var::leaf(x.clone());
        let l = loss(&pb, &x, false).unwrap();
        deferred.push(l.backward_input(None, &[x]).unwrap());
    }
    for d in deferred {
        d.run().unwrap();
    }
    for ((name, a), (_, b)) in pa.all().into_iter().zip(pb.all()) {
        assert_eq!(grad_bits(b, name), grad_bits(a, name), "gradient of {name}");
    }
}

#[test]
fn with_no_inputs_everything_waits_for_the_weight_pass() {
    // The first pipeline stage: nothing to send back, the input pass computes nothing.
    let (pa, pb) = (params(3), params(3));
    let xt = f32t(300, &[2, 3, D], -1.0, 1.0);
    let (xa, xb) = (Var::constant(xt.clone()), Var::constant(xt));
    loss(&pa, &xa, false).unwrap().backward().unwrap();
    let weights = loss(&pb, &xb, false)
        .unwrap()
        .backward_input(None, &[])
        .unwrap();
    assert!(pb.all().iter().all(|(_, p)| p.grad().is_none()));
    weights.run().unwrap();
    for ((name, a), (_, b)) in pa.all().into_iter().zip(pb.all()) {
        assert_eq!(grad_bits(b, name), grad_bits(a, name), "gradient of {name}");
    }
}

#[test]
fn grad_ready_hooks_fire_in_the_pass_that_completes_the_gradient() {
    let p = params(5);
    let x = Var::leaf(f32t(400, &[2, 3, D], -1.0, 1.0));
    let fired = Arc::new(AtomicUsize::new(0));
    for (_, v) in p.all() {
        let f = fired.clone();
        v.register_grad_ready_hook(Arc::new(move |_| {
            f.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }));
    }
    let x_fired = Arc::new(AtomicUsize::new(0));
    let f = x_fired.clone();
    x.register_grad_ready_hook(Arc::new(move |_| {
        f.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }));
    let weights = loss(&p, &x, false)
        .unwrap()
        .backward_input(None, std::slice::from_ref(&x))
        .unwrap();
    assert_eq!(x_fired.load(Ordering::SeqCst), 1);
    assert_eq!(fired.load(Ordering::SeqCst), 0);
    weights.run().unwrap();
    assert_eq!(x_fired.load(Ordering::SeqCst), 1);
    assert_eq!(fired.load(Ordering::SeqCst), p.all().len());
}

#[test]
fn bad_inputs_and_gradients_are_one_line_errors() {
    let p = params(9);
    let x = Var::leaf(f32t(500, &[2, 3, D], -1.0, 1.0));
    let l = loss(&p, &x, false).unwrap();
    let not_leaf = x.tanh().unwrap();
    let e = l.backward_input(None, &[not_leaf]).unwrap_err().to_string();
    assert!(
        e.contains("input 0 is the result of op tanh, not a leaf"),
        "{e}"
    );
    let c = Var::constant(x.tensor().clone());
    let e = l.backward_input(None, &[c]).unwrap_err().to_string();
    assert_eq!(e, "backward_input: input 0 does not require grad");
    let h = x.tanh().unwrap();
    let e = h
        .backward_input(None, std::slice::from_ref(&x))
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("backward_input: needs a one-element output"),
        "{e}"
    );
    assert!(!e.contains('\n'));
}
