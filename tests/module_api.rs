//! The model-writing API: `#[derive(Module)]`, `ParamBuilder`, `Sequential`, freezing, optimizer
//! builders and dropout randomness that advances by itself.

use crate::common;

use std::sync::Arc;

use meshgrad::nn::module::path_selects;
use meshgrad::prelude::*;

#[derive(Module)]
struct Leafy {
    w: Var,
    maybe: Option<Var>,
    none: Option<Var>,
    list: Vec<Var>,
    n: usize,
    #[module(skip)]
    _skipped: Option<Linear>,
    #[module(rename = "renamed")]
    r#loop: Linear,
}

#[derive(Module)]
struct Tree {
    first: Leafy,
    blocks: Vec<Arc<Linear>>,
    boxed: Box<LayerNorm>,
    drop: Dropout,
    scale: f64,
}

fn tree(seed: u64) -> Result<Tree> {
    ParamBuilder::new(seed).build(|p| {
        Ok(Tree {
            first: Leafy {
                w: p.param((2, 3), Init::Normal(1.0))?,
                maybe: Some(p.param(3, Init::Ones)?),
                none: None,
                list: vec![p.param(1, Init::Zeros)?, p.param(2, Init::Uniform(0.5))?],
                n: 7,
                _skipped: None,
                r#loop: Linear::new(p, 3, 2)?,
            },
            blocks: (0..2)
                .map(|_| Linear::new(p, 2, 2).map(Arc::new))
                .collect::<Result<_>>()?,
            boxed: Box::new(LayerNorm::new(p, 2, false, 1e-5)?),
            drop: Dropout::new(0.1)?,
            scale: 1.0,
        })
    })
}

#[test]
fn derive_names_every_parameter_once_from_field_names() {
    let t = tree(1).unwrap();
    let names: Vec<String> = t.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "first.w",
            "first.maybe",
            "first.list.0",
            "first.list.1",
            "first.renamed.weight",
            "first.renamed.bias",
            "blocks.0.weight",
            "blocks.0.bias",
            "blocks.1.weight",
            "blocks.1.bias",
            "boxed.weight",
        ]
    );
    assert_eq!(t.module_type(), "Tree");
    assert_eq!(
        t.module_paths(),
        [
            "",
            "first",
            "first.renamed",
            "blocks.0",
            "blocks.1",
            "boxed",
            "drop"
        ]
    );
    assert_eq!(t.first.n + t.scale as usize, 8);
}

#[test]
fn init_is_keyed_by_name_not_by_creation_order() {
    // The same parameter names built in a different order get the same values.
    #[derive(Module)]
    struct Ab {
        a: Var,
        b: Var,
    }
    let ab = ParamBuilder::new(5)
        .build(|p| {
            let a = p.param(4, Init::Normal(1.0))?;
            let b = p.param(4, Init::Normal(1.0))?;
            Ok(Ab { a, b })
        })
        .unwrap();
    let ba = ParamBuilder::new(5)
        .build(|p| {
            let b = p.param(4, Init::Normal(1.0))?;
            let a = p.param(4, Init::Normal(1.0))?;
            Ok(Ab { a, b })
        })
        .unwrap();
    let v = |x: &Var| x.tensor().to_vec::<f32>().unwrap();
    assert_eq!(v(&ab.a), v(&ba.a));
    assert_eq!(v(&ab.b), v(&ba.b));
    assert_ne!(v(&ab.a), v(&ab.b));
    // Ones / zeros / uniform bounds.
    let t = tree(3).unwrap();
    assert_eq!(v(t.first.maybe.as_ref().unwrap()), vec![1.0; 3]);
    assert_eq!(v(&t.first.list[0]), vec![0.0]);
    assert!(v(&t.first.list[1]).iter().all(|x| x.abs() <= 0.5));
    // A different seed gives different values.
    assert_ne!(v(&tree(4).unwrap().first.w), v(&t.first.w));
}

#[test]
fn unreachable_parameters_are_an_error() {
    struct NotAModule {
        _w: Var,
    }
    #[derive(Module)]
    struct Holder {
        inner: NotAModule,
        ok: Var,
    }
    let err = ParamBuilder::new(0)
        .build(|p| {
            Ok(Holder {
                inner: NotAModule {
                    _w: p.param((5, 6), Init::Zeros)?,
                },
                ok: p.param(1, Init::Zeros)?,
            })
        })
        .err()
        .expect("a parameter hidden in a non-module field must be reported");
    let msg = err.to_string();
    assert!(
        msg.contains("not reachable") && msg.contains("[5, 6]") && msg.contains("Holder"),
        "{msg}"
    );
}

#[test]
fn sequential_names_layers_by_index_and_chains_them() {
    let seq = ParamBuilder::new(9)
        .build(|p| {
            Ok(Sequential::new()
                .push(Linear::new(p, 3, 5)?)
                .push(Activation::Relu)
                .push(LinearConfig::new(5, 2).bias(false).build(p)?))
        })
        .unwrap();
    let names: Vec<String> = seq.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias", "2.weight"]);
    let x = Var::constant(Tensor::from_vec(vec![0.5f32; 6], (2, 3), Device::Cpu).unwrap());
    let y = seq.forward(&x).unwrap();
    // Reference: the same layers applied by hand.
    let l0 = seq.get(0).unwrap().forward(&x).unwrap().relu().unwrap();
    let r = seq.get(2).unwrap().forward(&l0).unwrap();
    assert_eq!(
        y.tensor().to_vec::<f32>().unwrap(),
        r.tensor().to_vec::<f32>().unwrap()
    );
    // A shape error names the layer.
    let bad = Var::constant(Tensor::zeros((2, 4), DType::F32, Device::Cpu).unwrap());
    let msg = seq.forward(&bad).unwrap_err().to_string();
    assert!(
        msg.contains("sequential layer 0 (Linear)") && msg.contains("linear 0"),
        "{msg}"
    );
}

#[test]
fn frozen_parameters_get_no_gradient_and_are_not_updated() {
    let seq = ParamBuilder::new(2)
        .build(|p| {
            Ok(Sequential::new()
                .push(Linear::new(p, 2, 2)?)
                .push(Linear::new(p, 2, 1)?))
        })
        .unwrap();
    assert_eq!(seq.freeze("0").unwrap(), 2);
    assert!(seq
        .freeze("nope.*")
        .unwrap_err()
        .to_string()
        .contains("children: 0, 1"));
    let before = seq.parameters()[0].tensor().to_vec::<f32>().unwrap();
    let mut opt = AdamW::for_module(&seq).build().unwrap();
    assert_eq!(
        opt.param_groups()
            .iter()
            .map(|g| g.params.len())
            .sum::<usize>(),
        2,
        "only the trainable layer"
    );
    let x = Var::constant(Tensor::ones((3, 2), DType::F32, Device::Cpu).unwrap());
    seq.forward(&x)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let p = seq.parameters();
    assert!(p[0].grad().is_none() && p[1].grad().is_none());
    assert!(p[2].grad().is_some());
    opt.step(0.1).unwrap();
    assert_eq!(p[0].tensor().to_vec::<f32>().unwrap(), before);
    seq.unfreeze("0.weight").unwrap();
    assert!(p[0].requires_grad() && !p[1].requires_grad());
    assert!(path_selects("0", "0.weight"));
}

fn mask_of(d: &Dropout, x: &Var) -> Vec<f32> {
    d.forward(x).unwrap().tensor().to_vec::<f32>().unwrap()
}

#[test]
fn dropout_draws_fresh_masks_per_use_and_repeats_them_per_context() {
    #[derive(Module)]
    struct D {
        d: Dropout,
    }
    let m = ParamBuilder::new(1)
        .build(|_| {
            Ok(D {
                d: Dropout::new(0.5)?,
            })
        })
        .unwrap();
    let x = Var::constant(Tensor::ones((4, 64), DType::F32, Device::Cpu).unwrap());
    // Two uses in one forward: different masks; the same context again: the same two masks.
    let (a1, a2) = ForwardCtx::new(3, 0).scope(|| (mask_of(&m.d, &x), mask_of(&m.d, &x)));
    assert_ne!(a1, a2);
    let (b1, b2) = ForwardCtx::new(3, 0).scope(|| (mask_of(&m.d, &x), mask_of(&m.d, &x)));
    assert_eq!((a1.clone(), a2), (b1, b2));
    // Another step: another mask.
    assert_ne!(ForwardCtx::new(4, 0).scope(|| mask_of(&m.d, &x)), a1);
    // Without any context, a loop still advances by itself.
    let (n1, n2) = (mask_of(&m.d, &x), mask_of(&m.d, &x));
    assert_ne!(n1, n2);
    // Rows 2..4 of the batch, as a second rank would see them, get the rows' global masks.
    let half = Var::constant(Tensor::ones((2, 64), DType::F32, Device::Cpu).unwrap());
    let tail = ForwardCtx::new(3, 2).scope(|| mask_of(&m.d, &half));
    assert_eq!(tail, a1[128..].to_vec());
    // Eval mode is the identity.
    m.set_training(false);
    assert_eq!(mask_of(&m.d, &x), vec![1.0; 256]);
}

#[test]
fn checkpoint_recomputes_the_same_masks_for_repeated_dropout() {
    #[derive(Module)]
    struct Twice {
        fc: Linear,
        d: Dropout,
    }
    let m = Arc::new(
        ParamBuilder::new(8)
            .build(|p| {
                Ok(Twice {
                    fc: Linear::new(p, 16, 16)?,
                    d: Dropout::new(0.3)?,
                })
            })
            .unwrap(),
    );
    let run = |m: &Arc<Twice>| -> Vec<Vec<f32>> {
        let x = Var::constant(Tensor::ones((3, 16), DType::F32, Device::Cpu).unwrap());
        let f = |x: &Var, m: &Twice| -> Result<Var> {
            let h = m.d.forward(&m.fc.forward(x)?)?;
            m.d.forward(&h.tanh()?)
        };
        m.zero_grad();
        let plain = ForwardCtx::new(1, 0).scope(|| f(&x, m)).unwrap();
        plain.sum_all().unwrap().backward().unwrap();
        let g1: Vec<Vec<f32>> = m
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec().unwrap())
            .collect();
        m.zero_grad();
        let mc = m.clone();
        let ck = ForwardCtx::new(1, 0)
            .scope(|| {
                checkpoint(
                    Arc::new(move |xs: &[Var]| f(&xs[0], &mc)),
                    std::slice::from_ref(&x),
                )
            })
            .unwrap();
        assert_eq!(
            plain.tensor().to_vec::<f32>().unwrap(),
            ck.tensor().to_vec::<f32>().unwrap()
        );
        ck.sum_all().unwrap().backward().unwrap();
        let g2: Vec<Vec<f32>> = m
            .parameters()
            .iter()
            .map(|p| p.grad().unwrap().to_vec().unwrap())
            .collect();
        assert_eq!(g1, g2, "recomputation must replay both masks");
        g1
    };
    run(&m);
}

#[test]
fn save_then_load_restores_every_parameter() {
    let a = tree(11).unwrap();
    let b = tree(12).unwrap();
    let dir = common::tmpdir("module-api");
    let file = dir.join("tree.safetensors");
    a.save(&file).unwrap();
    b.load(&file).unwrap();
    for ((na, pa), (nb, pb)) in a.named_parameters().iter().zip(b.named_parameters().iter()) {
        assert_eq!(na, nb);
        assert_eq!(
            pa.tensor().to_vec::<f32>().unwrap(),
            pb.tensor().to_vec::<f32>().unwrap()
        );
    }
    // A model of another shape refuses the file and stays unchanged.
    let other = ParamBuilder::new(0)
        .build(|p| Linear::new(p, 3, 2))
        .unwrap();
    let before = other.weight.tensor().to_vec::<f32>().unwrap();
    assert!(other.load(&file).is_err());
    assert_eq!(other.weight.tensor().to_vec::<f32>().unwrap(), before);
    std::fs::remove_dir_all(&dir).ok();
}
