//! Backward engine behaviour: accumulation, shared variables, grad mode, detach, roots with
//! supplied gradients, `grad()`, gradient-ready and pre-backward hooks (timing, order, errors),
//! custom functions and determinism.

use crate::common;

use std::sync::{Arc, Mutex};

use common::*;
use meshgrad_autograd::{
    apply, backward, enable_grad, grad, is_grad_enabled, no_grad, Function, GradReadyHook, Var,
};
use meshgrad_tensor::{AttentionMask, DType, Device, Result, Tensor};

#[test]
fn gradients_accumulate_across_backward_calls_until_zero_grad() {
    let x = Var::leaf(t64(&[1.0, -2.0, 3.0], &[3]));
    let loss = || x.sqr().unwrap().sum_all().unwrap();
    loss().backward().unwrap();
    assert_eq!(grad_of(&x), vec![2.0, -4.0, 6.0]);
    loss().backward().unwrap();
    assert_eq!(
        grad_of(&x),
        vec![4.0, -8.0, 12.0],
        "the second backward adds"
    );
    // The same graph can be run backward again (nothing is freed).
    let l = loss();
    l.backward().unwrap();
    l.backward().unwrap();
    assert_eq!(grad_of(&x), vec![8.0, -16.0, 24.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    loss().backward().unwrap();
    assert_eq!(grad_of(&x), vec![2.0, -4.0, 6.0]);
    // set_grad replaces.
    x.set_grad(Some(t64(&[0.5; 3], &[3])));
    loss().backward().unwrap();
    assert_eq!(grad_of(&x), vec![2.5, -3.5, 6.5]);
}

#[test]
fn a_variable_used_several_times_gets_the_summed_gradient() {
    let x = Var::leaf(t64(&[1.5, -0.5], &[2]));
    x.mul(&x).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), vec![3.0, -1.0]);
    x.zero_grad();
    // x + x*3 + exp(x) through a diamond.
    let y = x.mul_scalar(2.0).unwrap();
    let z = y
        .add(&y.mul_scalar(3.0).unwrap())
        .unwrap()
        .add(&x.exp().unwrap())
        .unwrap();
    z.sum_all().unwrap().backward().unwrap();
    let xv = [1.5f64, -0.5];
    assert_close(
        &grad_of(&x),
        &[8.0 + xv[0].exp(), 8.0 + xv[1].exp()],
        1e-15,
        0.0,
        "diamond",
    );
}

#[test]
fn no_grad_records_nothing_and_enable_grad_records_inside_it() {
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    assert!(is_grad_enabled());
    let y = no_grad(|| {
        assert!(!is_grad_enabled());
        let y = x.mul(&x).unwrap();
        assert!(!y.requires_grad() && y.is_leaf() && y.op_name().is_none());
        let z = enable_grad(|| {
            assert!(is_grad_enabled());
            x.mul(&x).unwrap()
        });
        assert!(!is_grad_enabled(), "restored after enable_grad");
        assert!(z.requires_grad() && !z.is_leaf());
        assert_eq!(z.op_name(), Some("mul"));
        z
    });
    assert!(is_grad_enabled(), "restored after no_grad");
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), vec![2.0, 4.0]);
    // Restored even if the closure panics.
    let r = std::panic::catch_unwind(|| no_grad(|| panic!("boom")));
    assert!(r.is_err());
    assert!(is_grad_enabled());
    // Ops on constants never record.
    let c = Var::constant(t64(&[1.0], &[1]));
    assert!(!c.exp().unwrap().requires_grad());
}

#[test]
fn detach_stops_the_gradient() {
    let x = Var::leaf(t64(&[2.0, 3.0], &[2]));
    let d = x.detach();
    assert!(!d.requires_grad() && d.is_leaf());
    assert!(
        d.tensor().same_storage(x.tensor()),
        "detach shares the value"
    );
    x.mul(&d).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), vec![2.0, 3.0], "only the non-detached path");
    // A detached intermediate cuts everything before it.
    let w = Var::leaf(t64(&[1.0], &[1]));
    let h = w.mul_scalar(5.0).unwrap().detach();
    let out = h.mul(&w).unwrap();
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&w), vec![5.0]);
}

#[test]
fn backward_needs_a_scalar_or_a_supplied_gradient() {
    let x = Var::leaf(t64(&[1.0, 2.0, 3.0, 4.0], &[2, 2]));
    let y = x.mul_scalar(3.0).unwrap();
    let e = y.backward().unwrap_err().to_string();
    assert!(e.contains("[2, 2]") && e.contains("backward_with"), "{e}");
    assert!(x.grad().is_none());
    y.backward_with(t64(&[1.0, 0.0, -1.0, 2.0], &[2, 2]))
        .unwrap();
    assert_eq!(grad_of(&x), vec![3.0, 0.0, -3.0, 6.0]);
    // A gradient of the wrong shape is refused.
    let e = y
        .backward_with(t64(&[1.0; 4], &[4]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 2]") && e.contains("[4]"), "{e}");
    // A root that does not require grad is refused.
    assert!(Var::constant(t64(&[1.0], &[1])).backward().is_err());
    // A one-element non-scalar is fine.
    let z = x.sum(&[0, 1], true).unwrap();
    assert_eq!(z.tensor().dims(), &[1, 1]);
    x.zero_grad();
    z.backward().unwrap();
    assert_eq!(grad_of(&x), vec![1.0; 4]);
}

#[test]
fn backward_from_several_roots() {
    // Pipeline-style: two outputs, each with its own supplied gradient.
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    let a = x.mul_scalar(2.0).unwrap();
    let b = x.sqr().unwrap();
    backward(&[(a, t64(&[1.0, 1.0], &[2])), (b, t64(&[0.5, -1.0], &[2]))]).unwrap();
    assert_eq!(grad_of(&x), vec![2.0 + 1.0, 2.0 - 4.0]);
    // Roots where one depends on the other.
    let x = Var::leaf(t64(&[3.0], &[1]));
    let h = x.mul_scalar(2.0).unwrap();
    let o = h.mul_scalar(5.0).unwrap();
    backward(&[(o, t64(&[1.0], &[1])), (h, t64(&[1.0], &[1]))]).unwrap();
    assert_eq!(grad_of(&x), vec![12.0]);
}

#[test]
fn grad_returns_gradients_without_touching_dot_grad() {
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    let w = Var::leaf(t64(&[3.0, -1.0], &[2]));
    let unused = Var::leaf(t64(&[0.0], &[1]));
    let h = x.mul(&w).unwrap();
    let y = h.sum_all().unwrap();
    let one = Tensor::ones((), DType::F64, Device::Cpu).unwrap();
    let gs = grad(
        &[(y.clone(), one.clone())],
        &[x.clone(), w.clone(), unused.clone(), h.clone()],
    )
    .unwrap();
    assert_eq!(vals(gs[0].as_ref().unwrap()), vec![3.0, -1.0]);
    assert_eq!(vals(gs[1].as_ref().unwrap()), vec![1.0, 2.0]);
    assert!(gs[2].is_none(), "not in the graph");
    assert_eq!(
        vals(gs[3].as_ref().unwrap()),
        vec![1.0, 1.0],
        "an intermediate"
    );
    assert!(x.grad().is_none() && w.grad().is_none());
    // No hooks fire either.
    let fired = Arc::new(Mutex::new(0));
    let f = fired.clone();
    x.register_grad_ready_hook(Arc::new(move |_| {
        *f.lock().unwrap() += 1;
        Ok(())
    }));
    grad(&[(y.clone(), one)], std::slice::from_ref(&x)).unwrap();
    assert_eq!(*fired.lock().unwrap(), 0);
    y.backward().unwrap();
    assert_eq!(*fired.lock().unwrap(), 1);
}

type Log = Arc<Mutex<Vec<String>>>;

fn log_hook(log: &Log, name: &str) -> GradReadyHook {
    let (log, name) = (log.clone(), name.to_string());
    Arc::new(move |_| {
        log.lock().unwrap().push(name.clone());
        Ok(())
    })
}

#[test]
fn grad_ready_hook_fires_once_with_the_complete_gradient() {
    // w is used by three ops; its hook must see the full sum, once.
    let x = Var::leaf(rand(1, &[2, 3], -1.0, 1.0));
    let w = Var::leaf(rand(2, &[3, 3], -1.0, 1.0));
    let seen: Arc<Mutex<Vec<Vec<f64>>>> = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    w.register_grad_ready_hook(Arc::new(move |v| {
        s.lock()
            .unwrap()
            .push(vals(&v.grad().expect("grad set before the hook")));
        Ok(())
    }));
    let loss = || -> Result<Var> {
        let h = x.matmul(&w)?.tanh()?;
        let h = h.matmul(&w)?;
        h.add(&w.sum(&[0], false)?)?.sqr()?.sum_all()
    };
    loss().unwrap().backward().unwrap();
    let first = grad_of(&w);
    {
        let s = seen.lock().unwrap();
        assert_eq!(s.len(), 1, "fired exactly once");
        assert_eq!(s[0], first, "the hook saw the final gradient");
    }
    // The second pass fires again, seeing the accumulated gradient.
    loss().unwrap().backward().unwrap();
    let s = seen.lock().unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(s[1], grad_of(&w));
    // Hooks can be cleared.
    drop(s);
    w.clear_grad_ready_hooks();
    loss().unwrap().backward().unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2);
}

/// Builds a 3-layer chain whose parameters are created in one order and used in another:
/// `p_b` first, then `p_c`, then `p_a`. Logs gradient-ready hooks of the parameters and
/// pre-backward hooks of the layer outputs.
fn chain_with_logging(log: &Log) -> Var {
    let p_a = Var::leaf(rand(10, &[3, 3], -1.0, 1.0));
    let p_b = Var::leaf(rand(11, &[3, 3], -1.0, 1.0));
    let p_c = Var::leaf(rand(12, &[3, 3], -1.0, 1.0));
    for (p, n) in [(&p_a, "ready a"), (&p_b, "ready b"), (&p_c, "ready c")] {
        p.register_grad_ready_hook(log_hook(log, n));
    }
    let x = Var::constant(rand(13, &[2, 3], -1.0, 1.0));
    let h1 = x.matmul(&p_b).unwrap().tanh().unwrap();
    h1.register_pre_backward_hook(log_hook(log, "pre layer 1"))
        .unwrap();
    let h2 = h1.matmul(&p_c).unwrap().tanh().unwrap();
    h2.register_pre_backward_hook(log_hook(log, "pre layer 2"))
        .unwrap();
    let h3 = h2.matmul(&p_a).unwrap().tanh().unwrap();
    h3.register_pre_backward_hook(log_hook(log, "pre layer 3"))
        .unwrap();
    h3.sum_all().unwrap()
}

#[test]
fn hooks_fire_as_soon_as_ready_in_reverse_order_of_use() {
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    chain_with_logging(&log).backward().unwrap();
    let got = log.lock().unwrap().clone();
    // Layer 3 (using p_a) runs backward first; p_a's gradient is then complete and its hook must
    // fire before the earlier layers' backward (this is what lets DDP overlap communication).
    let want = vec![
        "pre layer 3",
        "ready a",
        "pre layer 2",
        "ready c",
        "pre layer 1",
        "ready b",
    ];
    assert_eq!(got, want);
    // Deterministic: the same order on a second run.
    let log2: Log = Arc::new(Mutex::new(Vec::new()));
    chain_with_logging(&log2).backward().unwrap();
    assert_eq!(*log2.lock().unwrap(), got);
}

#[test]
fn pre_backward_hooks_run_before_the_node_and_can_abort() {
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    struct Logged(Log);
    impl Function for Logged {
        fn name(&self) -> &'static str {
            "logged"
        }
        fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
            Ok(x[0].clone())
        }
        fn backward(&self, _x: &[Tensor], _o: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            self.0.lock().unwrap().push("backward".into());
            Ok(vec![Some(g.clone())])
        }
    }
    let x = Var::leaf(t64(&[1.0], &[1]));
    let y = apply(Arc::new(Logged(log.clone())), &[&x]).unwrap();
    y.register_pre_backward_hook(log_hook(&log, "pre 1"))
        .unwrap();
    y.register_pre_backward_hook(log_hook(&log, "pre 2"))
        .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(*log.lock().unwrap(), vec!["pre 1", "pre 2", "backward"]);
    // Pre-backward hooks need a node.
    assert!(x
        .register_pre_backward_hook(log_hook(&log, "leaf"))
        .is_err());
    // An error from a hook aborts backward with that error; nothing reaches the leaf.
    let x = Var::leaf(t64(&[1.0], &[1]));
    let y = x.exp().unwrap();
    y.register_pre_backward_hook(Arc::new(|_| {
        Err(meshgrad_tensor::Error::msg("gather failed on rank 3"))
    }))
    .unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("gather failed on rank 3"), "{e}");
    assert!(x.grad().is_none());
    // An error from a gradient-ready hook is returned too.
    let z = Var::leaf(t64(&[1.0], &[1]));
    z.register_grad_ready_hook(Arc::new(|_| {
        Err(meshgrad_tensor::Error::msg("all-reduce timed out"))
    }));
    let e = z
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(e.contains("all-reduce timed out"), "{e}");
}

struct Double;
impl Function for Double {
    fn name(&self) -> &'static str {
        "double"
    }
    fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
        x[0].mul_scalar(2.0)
    }
    fn backward(&self, _x: &[Tensor], _out: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.mul_scalar(2.0)?)])
    }
}

/// Identity forward whose backward multiplies by 10 (like a communication op whose backward is
/// not the derivative of its local forward).
struct Amplify;
impl Function for Amplify {
    fn name(&self) -> &'static str {
        "amplify"
    }
    fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
        Ok(x[0].clone())
    }
    fn backward(&self, _x: &[Tensor], _out: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.mul_scalar(10.0)?)])
    }
}

#[test]
fn custom_functions_use_their_backward() {
    let x = Var::leaf(t64(&[1.0, -3.0], &[2]));
    let y = apply(Arc::new(Double), &[&x]).unwrap();
    assert_eq!(y.op_name(), Some("double"));
    assert_eq!(vals(y.tensor()), vec![2.0, -6.0]);
    y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&x), vec![8.0, -24.0]); // d/dx (2x)² = 8x
    let x = Var::leaf(t64(&[1.0, -3.0], &[2]));
    let y = apply(Arc::new(Amplify), &[&x]).unwrap();
    assert_eq!(vals(y.tensor()), vals(x.tensor()));
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        grad_of(&x),
        vec![10.0, 10.0],
        "the engine used the custom backward"
    );
    // On constants, apply records nothing.
    let c = apply(Arc::new(Double), &[&Var::constant(t64(&[1.0], &[1]))]).unwrap();
    assert!(!c.requires_grad());
}

#[test]
fn malformed_custom_backward_is_an_error() {
    struct TooMany;
    impl Function for TooMany {
        fn name(&self) -> &'static str {
            "too_many"
        }
        fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
            Ok(x[0].clone())
        }
        fn backward(&self, _x: &[Tensor], _o: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(g.clone()), Some(g.clone())])
        }
    }
    struct BadShape;
    impl Function for BadShape {
        fn name(&self) -> &'static str {
            "bad_shape"
        }
        fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
            Ok(x[0].clone())
        }
        fn backward(&self, _x: &[Tensor], _o: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(g.reshape(g.elem_count())?)])
        }
    }
    let x = Var::leaf(t64(&[1.0, 2.0], &[1, 2]));
    let e = apply(Arc::new(TooMany), &[&x])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(e.contains("too_many"), "{e}");
    let e = apply(Arc::new(BadShape), &[&x])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("bad_shape") && e.contains("[1, 2]") && e.contains("[2]"),
        "{e}"
    );
}

#[test]
fn an_input_that_receives_no_gradient() {
    // A function that returns no gradient for its input: the branch below it gets nothing, the
    // other branch still flows, and the leaf's hook fires once.
    struct Stop;
    impl Function for Stop {
        fn name(&self) -> &'static str {
            "stop"
        }
        fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
            Ok(x[0].clone())
        }
        fn backward(&self, _x: &[Tensor], _o: &Tensor, _g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![None])
        }
    }
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    let count = Arc::new(Mutex::new(0));
    let c = count.clone();
    x.register_grad_ready_hook(Arc::new(move |_| {
        *c.lock().unwrap() += 1;
        Ok(())
    }));
    let blocked = apply(
        Arc::new(Stop),
        &[&x.exp().unwrap().mul_scalar(3.0).unwrap()],
    )
    .unwrap();
    let open = x.mul_scalar(2.0).unwrap();
    blocked
        .add(&open)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&x), vec![2.0, 2.0]);
    assert_eq!(*count.lock().unwrap(), 1);
    // Only the blocked path: no gradient at all, no hook.
    let y = Var::leaf(t64(&[1.0], &[1]));
    apply(Arc::new(Stop), &[&y.exp().unwrap()])
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert!(y.grad().is_none());
}

#[test]
fn constant_operands_get_no_gradient() {
    let w = Var::leaf(t64(&[2.0], &[1]));
    let c = Var::constant(t64(&[5.0], &[1]));
    w.mul(&c)
        .unwrap()
        .div(&c)
        .unwrap()
        .sub(&c)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&w), vec![1.0]);
    assert!(c.grad().is_none());
}

fn determinism_loss(seed: u64) -> (Vec<Var>, Var) {
    let x = Var::leaf(
        rand(seed, &[2, 4, 8], -1.0, 1.0)
            .to_dtype(DType::F32)
            .unwrap(),
    );
    let w = Var::leaf(
        rand(seed + 1, &[8, 8], -0.5, 0.5)
            .to_dtype(DType::F32)
            .unwrap(),
    );
    let g = Var::leaf(rand(seed + 2, &[8], 0.5, 1.5).to_dtype(DType::F32).unwrap());
    let table = Var::leaf(
        rand(seed + 3, &[5, 8], -1.0, 1.0)
            .to_dtype(DType::F32)
            .unwrap(),
    );
    let ids = Tensor::from_vec(vec![1i64, 4, 1, 1, 0, 2, 4, 1], (2, 4), Device::Cpu).unwrap();
    let e = Var::embedding(&table, &ids).unwrap();
    let h = x
        .add(&e)
        .unwrap()
        .matmul(&w)
        .unwrap()
        .layer_norm(Some(&g), None, 1e-5)
        .unwrap();
    let q = h.reshape([2, 4, 2, 4]).unwrap().transpose(1, 2).unwrap();
    let a = Var::attention(&q, &q, &q, &AttentionMask::causal(), 0.5)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape([8, 8])
        .unwrap();
    let targets = Tensor::from_vec(vec![0i64, 1, 2, 3, 4, 5, 6, 7], 8, Device::Cpu).unwrap();
    let loss = a
        .matmul(&w)
        .unwrap()
        .softmax(0)
        .unwrap()
        .log()
        .unwrap()
        .cross_entropy(&targets, None)
        .unwrap();
    (vec![x, w, g, table], loss)
}

#[test]
fn backward_is_bitwise_repeatable() {
    let (p1, l1) = determinism_loss(300);
    l1.backward().unwrap();
    let (p2, l2) = determinism_loss(300);
    l2.backward().unwrap();
    assert_bitwise(&vals(l1.tensor()), &vals(l2.tensor()), "loss");
    for (i, (a, b)) in p1.iter().zip(&p2).enumerate() {
        assert_bitwise(
            &grad_of(a),
            &grad_of(b),
            &format!("gradient of parameter {i}"),
        );
    }
    // And engine::grad gives the same bits as .grad.
    let (p3, l3) = determinism_loss(300);
    let one = Tensor::ones((), l3.tensor().dtype(), Device::Cpu).unwrap();
    let gs = grad(&[(l3, one)], &p3).unwrap();
    for (i, (g, a)) in gs.iter().zip(&p1).enumerate() {
        assert_bitwise(
            &vals(g.as_ref().unwrap()),
            &grad_of(a),
            &format!("grad() of parameter {i}"),
        );
    }
}

#[test]
fn var_debug_and_identity() {
    let x = Var::leaf(t64(&[1.0], &[1]));
    let y = x.exp().unwrap();
    assert!(y.id() > x.id(), "ids increase with creation");
    let s = format!("{y:?}");
    assert!(s.contains("exp") && s.contains("requires_grad=true"), "{s}");
    assert!(x.is_leaf() && !y.is_leaf());
    assert_eq!(y.op_name(), Some("exp"));
    let c = x.clone();
    assert_eq!(c.id(), x.id(), "clones share the variable");
}

#[test]
fn released_parameters_rematerialised_by_a_pre_backward_hook() {
    // The FSDP pattern: free a weight after forward, gather it back just before the backward of
    // the node that needs it. The graph stays valid throughout.
    let wv = rand(400, &[3, 2], -1.0, 1.0);
    let w = Var::leaf(wv.deep_clone().unwrap());
    let x = Var::leaf(rand(401, &[4, 3], -1.0, 1.0));
    let y = x.matmul(&w).unwrap();
    let loss = y.sqr().unwrap().sum_all().unwrap();
    w.tensor().release_storage();
    // Without the hook, backward fails with a "released" error.
    let e = loss.backward().unwrap_err().to_string();
    assert!(e.contains("released"), "{e}");
    x.zero_grad();
    w.zero_grad();
    let (wt, full) = (w.tensor().clone(), wv.clone());
    let gathers = Arc::new(Mutex::new(0));
    let gc_ = gathers.clone();
    y.register_pre_backward_hook(Arc::new(move |_| {
        *gc_.lock().unwrap() += 1;
        wt.materialize_from(&full)
    }))
    .unwrap();
    loss.backward().unwrap();
    assert_eq!(*gathers.lock().unwrap(), 1);
    // Same gradients as a run that never released anything.
    let (x2, w2) = (Var::leaf(x.tensor().clone()), Var::leaf(wv));
    x2.matmul(&w2)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_bitwise(&grad_of(&x), &grad_of(&x2), "grad x");
    assert_bitwise(&grad_of(&w), &grad_of(&w2), "grad w");
}

#[test]
fn leaves_as_roots_and_kinks() {
    // backward_with on a leaf accumulates the supplied gradient.
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    x.backward_with(t64(&[0.5, -1.0], &[2])).unwrap();
    assert_eq!(grad_of(&x), vec![0.5, -1.0]);
    // relu has gradient 0 at 0; maximum of equal values sends the gradient to the lhs.
    let z = Var::leaf(t64(&[-1.0, 0.0, 2.0], &[3]));
    z.relu().unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&z), vec![0.0, 0.0, 1.0]);
    let (a, b) = (
        Var::leaf(t64(&[1.0, 2.0], &[2])),
        Var::leaf(t64(&[1.0, 3.0], &[2])),
    );
    a.maximum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!((grad_of(&a), grad_of(&b)), (vec![1.0, 0.0], vec![0.0, 1.0]));
    let (a, b) = (
        Var::leaf(t64(&[1.0, 2.0], &[2])),
        Var::leaf(t64(&[1.0, 3.0], &[2])),
    );
    a.minimum(&b)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!((grad_of(&a), grad_of(&b)), (vec![1.0, 1.0], vec![0.0, 0.0]));
}

#[test]
fn graphs_work_across_threads_and_grad_mode_is_per_thread() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Var>();
    assert_send_sync::<Tensor>();
    let w = Var::leaf(rand(410, &[3, 3], -1.0, 1.0));
    // Forward on one thread, backward on another.
    let w2 = w.clone();
    let loss = std::thread::spawn(move || w2.tanh().unwrap().sum_all().unwrap())
        .join()
        .unwrap();
    std::thread::spawn(move || loss.backward().unwrap())
        .join()
        .unwrap();
    let wv = vals(w.tensor());
    let want: Vec<f64> = wv.iter().map(|v| 1.0 - v.tanh().powi(2)).collect();
    assert_close(
        &grad_of(&w),
        &want,
        1e-15,
        0.0,
        "grad after cross-thread backward",
    );
    // no_grad on this thread does not switch recording off on another.
    no_grad(|| {
        let w3 = w.clone();
        let recorded = std::thread::spawn(move || w3.exp().unwrap().requires_grad())
            .join()
            .unwrap();
        assert!(recorded);
        assert!(!w.exp().unwrap().requires_grad());
    });
}

#[test]
fn gradients_handed_out_are_never_modified_later() {
    // In-place accumulation must only reuse buffers nobody else can see.
    let x = Var::leaf(t64(&[1.0, 2.0], &[2]));
    let supplied = t64(&[1.0, 1.0], &[2]);
    x.backward_with(supplied.clone()).unwrap();
    let first = x.grad().unwrap();
    let first_view = first.narrow(0, 0, 1).unwrap();
    x.mul_scalar(3.0)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    x.backward_with(supplied.clone()).unwrap();
    assert_eq!(
        vals(&supplied),
        vec![1.0, 1.0],
        "the supplied root gradient"
    );
    assert_eq!(vals(&first), vec![1.0, 1.0], "a gradient read before");
    assert_eq!(
        vals(&first_view),
        vec![1.0],
        "a view of a gradient read before"
    );
    assert_eq!(grad_of(&x), vec![5.0, 5.0]);
    // A gradient kept by a hook.
    let kept: Arc<Mutex<Vec<Tensor>>> = Arc::new(Mutex::new(Vec::new()));
    let k = kept.clone();
    let w = Var::leaf(t64(&[1.0, -1.0], &[2]));
    w.register_grad_ready_hook(Arc::new(move |v| {
        k.lock().unwrap().push(v.grad().unwrap());
        Ok(())
    }));
    for _ in 0..3 {
        w.sqr()
            .unwrap()
            .add(&w)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
    }
    {
        let kept = kept.lock().unwrap();
        assert_eq!(vals(&kept[0]), vec![3.0, -1.0]);
        assert_eq!(vals(&kept[1]), vec![6.0, -2.0]);
        assert_eq!(vals(&kept[2]), vec![9.0, -3.0]);
    }
    w.clear_grad_ready_hooks();
    // Gradients from grad() stay as returned.
    let y = w.mul(&w).unwrap().sum_all().unwrap();
    let one = Tensor::ones((), DType::F64, Device::Cpu).unwrap();
    let g = grad(&[(y.clone(), one.clone())], std::slice::from_ref(&w)).unwrap()[0]
        .clone()
        .unwrap();
    let before = vals(&g);
    w.set_grad(Some(g.clone()));
    y.backward().unwrap();
    assert_eq!(
        vals(&g),
        before,
        "a tensor installed with set_grad and still held"
    );
    assert_eq!(
        grad_of(&w),
        before.iter().map(|v| v * 2.0).collect::<Vec<_>>()
    );
}
