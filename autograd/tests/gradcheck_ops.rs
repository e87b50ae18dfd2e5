//! Every differentiable `Var` op against central finite differences (`gradcheck`, f64), with
//! broadcasting operands and non-contiguous inputs (views taken inside the checked function).

use crate::common;

use common::*;
use meshgrad_autograd::{gradcheck, DropoutSpec, GradcheckOptions, Var};
use meshgrad_tensor::{AttentionMask, DType, Device, GeluKind, Result, Tensor};

type BinOp = fn(&Var, &Var) -> Result<Var>;

fn binary_ops() -> Vec<(&'static str, BinOp)> {
    vec![
        ("add", Var::add),
        ("sub", Var::sub),
        ("mul", Var::mul),
        ("div", Var::div),
        ("maximum", Var::maximum),
        ("minimum", Var::minimum),
    ]
}

#[test]
fn binary_ops_with_broadcasting_and_views() {
    for (name, op) in binary_ops() {
        // b values in [0.5, 1.5] keep div away from 0; a in [-2, -0.6] ∪ [1.6, 3] would be
        // overkill: instead require a gap between every a and b value (kinks of max/min).
        let sep = |a: &Tensor, b: &Tensor| min_gap(&vals(a), &vals(b)) > 1e-3;
        let pick = |seed: u64, ad: &[usize], bd: &[usize]| -> (Tensor, Tensor) {
            let b = rand(seed + 1, bd, 0.5, 1.5);
            let a = rand_where(seed, ad, -1.0, 2.0, |v| sep(&t64(v, &[v.len()]), &b));
            (a, b)
        };
        // [2,1,3] with [4,1].
        let (a, b) = pick(10, &[2, 1, 3], &[4, 1]);
        gc(
            &format!("{name} [2,1,3] x [4,1]"),
            |v| op(&v[0], &v[1]),
            &[a, b],
        );
        // A transposed lhs with a row-vector rhs: [4,3]ᵀ = [3,4] with [4].
        let (a, b) = pick(20, &[4, 3], &[4]);
        gc(
            &format!("{name} transposed [3,4] x [4]"),
            |v| op(&v[0].transpose(0, 1)?, &v[1]),
            &[a, b],
        );
        // Scalar with a matrix, both orders.
        let (a, b) = pick(30, &[], &[2, 3]);
        gc(
            &format!("{name} scalar x [2,3]"),
            |v| op(&v[0], &v[1]),
            &[a.clone(), b.clone()],
        );
        gc(
            &format!("{name} [2,3] x scalar"),
            |v| op(&v[1], &v[0]),
            &[a, b],
        );
        // [5] with a narrowed [2,5] (non-contiguous rows).
        let (a, b) = pick(40, &[5], &[2, 7]);
        gc(
            &format!("{name} [5] x narrowed [2,5]"),
            |v| op(&v[0], &v[1].narrow(1, 1, 5)?),
            &[a, b],
        );
        // Both operands expanded views.
        let (a, b) = pick(50, &[3, 1], &[1, 4]);
        gc(
            &format!("{name} expanded [2,3,4] x [2,3,4]"),
            |v| op(&v[0].expand([2, 3, 4])?, &v[1].expand([2, 3, 4])?),
            &[a, b],
        );
        // The same variable on both sides.
        let a = rand(60, &[2, 3], 0.5, 1.5);
        if name != "maximum" && name != "minimum" {
            gc(
                &format!("{name} x with itself"),
                |v| op(&v[0], &v[0].transpose(0, 1)?.transpose(0, 1)?),
                &[a],
            );
        }
    }
}

#[test]
fn where_cond_with_broadcasting() {
    let cond = Tensor::from_vec(vec![1u8, 0, 1, 0, 0, 1], (2, 1, 3), Device::Cpu).unwrap();
    let a = rand(1, &[4, 1], -1.0, 1.0);
    let b = rand(2, &[3, 4, 2], -1.0, 1.0); // used as a [2, 4, 3] view
    gc(
        "where_cond",
        |v| Var::where_cond(&cond, &v[0], &v[1].permute(&[2, 1, 0])?),
        &[a, b],
    );
    // A condition computed from the data (not differentiated).
    let x = rand(3, &[3, 4], -1.0, 1.0);
    let mask = x
        .gt(&Tensor::zeros((), DType::F64, Device::Cpu).unwrap())
        .unwrap();
    gc(
        "where_cond relu-like",
        |v| Var::where_cond(&mask, &v[0], &v[0].mul_scalar(0.1)?),
        &[x],
    );
}

type Un = Box<dyn Fn(&Var) -> Result<Var>>;

fn unary_ops() -> Vec<(&'static str, Un, f64, f64)> {
    vec![
        ("neg", Box::new(|x| x.neg()), -2.0, 2.0),
        ("exp", Box::new(|x| x.exp()), -2.0, 2.0),
        ("log", Box::new(|x| x.log()), 0.5, 2.0),
        ("sqrt", Box::new(|x| x.sqrt()), 0.5, 2.0),
        ("tanh", Box::new(|x| x.tanh()), -2.0, 2.0),
        ("sigmoid", Box::new(|x| x.sigmoid()), -3.0, 3.0),
        ("relu", Box::new(|x| x.relu()), -2.0, 2.0),
        ("gelu tanh", Box::new(|x| x.gelu(GeluKind::Tanh)), -3.0, 3.0),
        ("gelu erf", Box::new(|x| x.gelu(GeluKind::Erf)), -3.0, 3.0),
        ("powf(2.5)", Box::new(|x| x.powf(2.5)), 0.5, 2.0),
        ("powf(-1.5)", Box::new(|x| x.powf(-1.5)), 0.5, 2.0),
        ("powf(3)", Box::new(|x| x.powf(3.0)), -2.0, 2.0),
        ("powf(2)", Box::new(|x| x.powf(2.0)), -2.0, 2.0),
        ("powf(1)", Box::new(|x| x.powf(1.0)), -2.0, 2.0),
        ("sqr", Box::new(|x| x.sqr()), -2.0, 2.0),
        ("add_scalar", Box::new(|x| x.add_scalar(0.75)), -2.0, 2.0),
        ("mul_scalar", Box::new(|x| x.mul_scalar(-1.25)), -2.0, 2.0),
        ("sin", Box::new(|x| x.sin()), -3.0, 3.0),
        ("cos", Box::new(|x| x.cos()), -3.0, 3.0),
        ("silu", Box::new(|x| x.silu()), -4.0, 4.0),
    ]
}

#[test]
fn unary_ops_on_strided_views() {
    for (k, (name, op, lo, hi)) in unary_ops().into_iter().enumerate() {
        // Away from relu's kink at 0.
        let x = rand_where(100 + k as u64, &[3, 4], lo, hi, |v| {
            v.iter().all(|a| a.abs() > 1e-3)
        });
        gc(name, |v| op(&v[0]), std::slice::from_ref(&x));
        // Transposed and narrowed: [4, 3] -> rows 1..4.
        gc(
            &format!("{name} on a strided view"),
            |v| op(&v[0].transpose(0, 1)?.narrow(0, 1, 3)?),
            &[x],
        );
    }
}

#[test]
fn to_dtype_converts_the_gradient_back() {
    // Through f32: finite differences need a larger step at f32 precision.
    let opts = GradcheckOptions {
        eps: 1e-3,
        atol: 1e-4,
        rtol: 1e-3,
        ..Default::default()
    };
    let x = rand(7, &[3, 4], -1.0, 1.0);
    gc_with(
        "to_dtype f32 and back",
        |v| {
            v[0].transpose(0, 1)?
                .to_dtype(DType::F32)?
                .tanh()?
                .mul_scalar(2.0)?
                .to_dtype(DType::F64)
        },
        &[x],
        opts,
    );
    // The gradient of a half-precision branch arrives in the leaf's dtype.
    for dt in [DType::BF16, DType::F16, DType::F32] {
        let leaf = Var::leaf(rand(8, &[5], -1.0, 1.0));
        let y = leaf
            .to_dtype(dt)
            .unwrap()
            .mul_scalar(3.0)
            .unwrap()
            .sum_all()
            .unwrap();
        assert_eq!(y.tensor().dtype(), dt);
        y.backward().unwrap();
        let g = leaf.grad().unwrap();
        assert_eq!(g.dtype(), DType::F64, "{dt}");
        assert_eq!(vals(&g), vec![3.0; 5], "{dt}");
    }
    // Same dtype: the variable itself.
    let leaf = Var::leaf(rand(9, &[2], 0.0, 1.0));
    assert_eq!(leaf.to_dtype(DType::F64).unwrap().id(), leaf.id());
}

#[test]
fn sum_and_mean_over_dims() {
    let x = rand(11, &[2, 3, 4], -1.0, 1.0);
    let cases: Vec<(Vec<isize>, bool)> = vec![
        (vec![0], false),
        (vec![1], true),
        (vec![-1], false),
        (vec![0, 2], true),
        (vec![-1, 0], false),
        (vec![0, 1, 2], false),
    ];
    for (dims, keepdim) in cases {
        gc(
            &format!("sum {dims:?} keepdim={keepdim}"),
            |v| v[0].sum(&dims, keepdim),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("mean {dims:?} keepdim={keepdim} of a permuted view"),
            |v| v[0].permute(&[2, 0, 1])?.mean(&dims, keepdim),
            std::slice::from_ref(&x),
        );
    }
    gc(
        "sum_all",
        |v| v[0].transpose(0, 2)?.sum_all(),
        std::slice::from_ref(&x),
    );
    gc(
        "mean_all",
        |v| v[0].narrow(2, 1, 2)?.mean_all(),
        std::slice::from_ref(&x),
    );
    let s = rand(12, &[], -1.0, 1.0);
    gc(
        "sum_all of a scalar",
        |v| v[0].sum_all()?.mul_scalar(2.0),
        &[s],
    );
}

#[test]
fn mean_with_a_repeated_dim_matches_the_tensor_op() {
    let x = rand(13, &[2, 3], -1.0, 1.0);
    let want = vals(&x.mean(&[1, -1], false).unwrap());
    let v = Var::leaf(x);
    let got = vals(v.mean(&[1, -1], false).unwrap().tensor());
    assert_close(
        &got,
        &want,
        1e-15,
        0.0,
        "Var::mean over [1, -1] (the same dim twice)",
    );
}

#[test]
fn max_over_a_dim() {
    let x = rand_where(14, &[3, 4, 2], -1.0, 1.0, |v| min_self_gap(v) > 1e-3);
    for (dim, keepdim) in [(0isize, false), (1, true), (-1, false), (-2, true)] {
        gc(
            &format!("max dim {dim} keepdim={keepdim}"),
            |v| v[0].max(dim, keepdim),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("max dim {dim} keepdim={keepdim} of a permuted view"),
            |v| v[0].permute(&[1, 2, 0])?.max(dim, keepdim),
            std::slice::from_ref(&x),
        );
    }
    // Ties: the gradient goes to the first maximal element only.
    let t = Var::leaf(t64(&[1.0, 3.0, 3.0, 0.0, 2.0, 2.0], &[2, 3]));
    t.max(1, false)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&t), vec![0.0, 1.0, 0.0, 0.0, 1.0, 0.0]);
}

#[test]
fn view_ops() {
    let x = rand(15, &[2, 3, 4], -1.0, 1.0);
    let xs = std::slice::from_ref(&x);
    gc("reshape (view)", |v| v[0].reshape([6, 4])?.sqr(), xs);
    gc(
        "reshape of a transposed view (copy)",
        |v| v[0].transpose(0, 2)?.reshape([4, 6])?.sqr(),
        xs,
    );
    gc("permute", |v| v[0].permute(&[2, 0, 1])?.sqr(), xs);
    gc(
        "transpose (negative dims)",
        |v| v[0].transpose(-1, -3)?.sqr(),
        xs,
    );
    gc("narrow", |v| v[0].narrow(1, 1, 2)?.sqr(), xs);
    gc(
        "narrow of a permuted view",
        |v| v[0].permute(&[1, 2, 0])?.narrow(-1, 1, 1)?.sqr(),
        xs,
    );
    gc("unsqueeze", |v| v[0].unsqueeze(1)?.sqr(), xs);
    gc(
        "unsqueeze (negative)",
        |v| v[0].unsqueeze(-1)?.mul(&v[0].unsqueeze(-1)?),
        xs,
    );
    gc("squeeze", |v| v[0].narrow(1, 2, 1)?.squeeze(1)?.sqr(), xs);
    gc(
        "contiguous",
        |v| v[0].transpose(0, 1)?.contiguous()?.sqr(),
        xs,
    );
    let y = rand(16, &[3, 1], -1.0, 1.0);
    gc(
        "expand",
        |v| v[0].expand([2, 3, 4])?.mul(&v[1]),
        &[y, x.clone()],
    );
    let z = rand(17, &[4], -1.0, 1.0);
    gc(
        "expand of a vector with new leading dims",
        |v| v[0].expand([2, 3, 4])?.sqr(),
        &[z],
    );
}

#[test]
fn split_chunk_cat_stack() {
    let x = rand(18, &[3, 5], -1.0, 1.0);
    gc(
        "split",
        |v| {
            let p = v[0].split(&[1, 3, 1], 1)?;
            p[0].sqr()?
                .sum_all()?
                .add(&p[1].mul_scalar(3.0)?.exp()?.sum_all()?)?
                .add(&p[2].tanh()?.sum_all()?)
        },
        std::slice::from_ref(&x),
    );
    gc(
        "chunk of a transposed view",
        |v| {
            let p = v[0].transpose(0, 1)?.narrow(0, 1, 4)?.chunk(2, 0)?;
            p[0].mul(&p[1])
        },
        std::slice::from_ref(&x),
    );
    let a = rand(19, &[2, 3], -1.0, 1.0);
    let b = rand(20, &[4, 2], -1.0, 1.0); // used transposed as [2, 4]
    let c = rand(21, &[2, 1], -1.0, 1.0);
    gc(
        "cat dim 1",
        |v| Var::cat(&[&v[0], &v[1].t_(), &v[2]], 1)?.sqr(),
        &[a.clone(), b.clone(), c.clone()],
    );
    gc(
        "cat dim -1 reordered",
        |v| Var::cat(&[&v[2], &v[0], &v[1].t_()], -1)?.tanh(),
        &[a.clone(), b, c],
    );
    let d = rand(22, &[3, 2], -1.0, 1.0);
    gc(
        "stack dim 0",
        |v| Var::stack(&[&v[0], &v[1].transpose(0, 1)?], 0)?.sqr(),
        &[a.clone(), d.clone()],
    );
    gc(
        "stack dim -1",
        |v| Var::stack(&[&v[0], &v[1].transpose(0, 1)?, &v[0]], -1)?.sqr(),
        &[a, d],
    );
}

/// `transpose(0, 1)` that unwraps, for use inside slices of references.
trait T_ {
    fn t_(&self) -> Var;
}
impl T_ for Var {
    fn t_(&self) -> Var {
        self.transpose(0, 1).unwrap()
    }
}

#[test]
fn matmul_shapes_and_views() {
    let cases: Vec<(&str, Vec<usize>, Vec<usize>)> = vec![
        ("2-D", vec![3, 4], vec![4, 2]),
        ("batched", vec![2, 3, 4], vec![2, 4, 2]),
        ("broadcast lhs batch", vec![1, 3, 4], vec![2, 4, 2]),
        ("broadcast rhs batch", vec![2, 3, 4], vec![1, 4, 2]),
        ("3-D @ 2-D", vec![2, 3, 4], vec![4, 2]),
        ("2-D @ 3-D", vec![3, 4], vec![2, 4, 2]),
        ("4-D @ 2-D", vec![2, 2, 3, 4], vec![4, 3]),
        ("4-D @ 3-D", vec![2, 1, 3, 4], vec![2, 4, 2]),
    ];
    for (k, (name, ad, bd)) in cases.into_iter().enumerate() {
        let a = rand(30 + k as u64, &ad, -1.0, 1.0);
        let b = rand(40 + k as u64, &bd, -1.0, 1.0);
        gc(name, |v| v[0].matmul(&v[1]), &[a.clone(), b.clone()]);
        // Both operands as transposed views of leaves stored the other way round.
        let at = a.transpose(-1, -2).unwrap().contiguous().unwrap();
        let bt = b.transpose(-1, -2).unwrap().contiguous().unwrap();
        gc(
            &format!("{name}, transposed operands"),
            |v| v[0].transpose(-1, -2)?.matmul(&v[1].transpose(-1, -2)?),
            &[at, bt],
        );
    }
    // A narrowed lhs (strided rows) with a shared rhs.
    let a = rand(50, &[2, 5, 4], -1.0, 1.0);
    let b = rand(51, &[4, 3], -1.0, 1.0);
    gc(
        "narrowed 3-D @ 2-D",
        |v| v[0].narrow(1, 1, 3)?.matmul(&v[1]),
        &[a, b],
    );
    // A chain.
    let x = rand(52, &[2, 3], -1.0, 1.0);
    let w1 = rand(53, &[3, 4], -1.0, 1.0);
    let w2 = rand(54, &[4, 2], -1.0, 1.0);
    gc(
        "x @ w1 @ w2 with tanh",
        |v| v[0].matmul(&v[1])?.tanh()?.matmul(&v[2]),
        &[x, w1, w2],
    );
}

#[test]
fn softmax_and_log_softmax_any_dim() {
    let x = rand(60, &[2, 3, 4], -2.0, 2.0);
    for dim in [-1isize, 0, 1] {
        gc(
            &format!("softmax dim {dim}"),
            |v| v[0].softmax(dim),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("log_softmax dim {dim}"),
            |v| v[0].log_softmax(dim),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("softmax dim {dim} of a permuted view"),
            |v| v[0].permute(&[1, 2, 0])?.softmax(dim),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("log_softmax dim {dim} of a permuted view"),
            |v| v[0].permute(&[2, 0, 1])?.log_softmax(dim),
            std::slice::from_ref(&x),
        );
    }
}

#[test]
fn layer_norm_affine_variants() {
    let x = rand(70, &[5, 3], -2.0, 2.0); // used as a transposed [3, 5]
    let w = rand(71, &[5], 0.5, 1.5);
    let b = rand(72, &[5], -0.5, 0.5);
    gc(
        "layer_norm weight+bias",
        |v| v[0].t_().layer_norm(Some(&v[1]), Some(&v[2]), 1e-5),
        &[x.clone(), w.clone(), b],
    );
    gc(
        "layer_norm weight only",
        |v| v[0].t_().layer_norm(Some(&v[1]), None, 1e-5),
        &[x.clone(), w.clone()],
    );
    gc(
        "layer_norm no affine",
        |v| v[0].t_().layer_norm(None, None, 1e-5),
        std::slice::from_ref(&x),
    );
    let x3 = rand(73, &[2, 2, 5], -2.0, 2.0);
    gc(
        "layer_norm 3-D",
        |v| v[0].layer_norm(Some(&v[1]), None, 1e-5),
        &[x3, w.clone()],
    );
    // A bias without a weight is refused.
    let (xv, bv) = (Var::leaf(x), Var::leaf(w));
    assert!(xv.layer_norm(None, Some(&bv), 1e-5).is_err());
}

#[test]
fn attention_causal_and_not() {
    // [B, T, H, D] leaves used as the usual [B, H, T, D] transposed views.
    for causal in [false, true] {
        let q = rand(80, &[1, 3, 2, 4], -1.0, 1.0);
        let k = rand(81, &[1, 3, 2, 4], -1.0, 1.0);
        let v = rand(82, &[1, 3, 2, 4], -1.0, 1.0);
        gc(
            &format!("attention causal={causal}"),
            |x| {
                Var::attention(
                    &x[0].transpose(1, 2)?,
                    &x[1].transpose(1, 2)?,
                    &x[2].transpose(1, 2)?,
                    &causal_mask(causal),
                    0.5,
                )
            },
            &[q, k, v],
        );
    }
    // seq_q < seq_k (causal aligned bottom-right) and the non-causal version.
    for causal in [true, false] {
        let q = rand(83, &[2, 2, 3], -1.0, 1.0);
        let k = rand(84, &[2, 4, 3], -1.0, 1.0);
        let v = rand(85, &[2, 4, 3], -1.0, 1.0);
        gc(
            &format!("attention seq_q < seq_k causal={causal}"),
            |x| Var::attention(&x[0], &x[1], &x[2], &causal_mask(causal), 0.8),
            &[q, k, v],
        );
    }
}

#[test]
fn cross_entropy_with_and_without_ignore_index() {
    let logits = rand(90, &[5, 4], -2.0, 2.0); // used transposed: [4 rows, 5 classes]
    let targets = Tensor::from_vec(vec![1i64, -100, 4, 0], 4, Device::Cpu).unwrap();
    gc(
        "cross_entropy ignore_index",
        |v| v[0].t_().cross_entropy(&targets, Some(-100)),
        std::slice::from_ref(&logits),
    );
    let targets = Tensor::from_vec(vec![1u32, 3, 4, 0], 4, Device::Cpu).unwrap();
    gc(
        "cross_entropy u32 targets",
        |v| v[0].t_().cross_entropy(&targets, None),
        std::slice::from_ref(&logits),
    );
    // The loss is the mean over the rows that are not ignored.
    let t = Tensor::from_vec(vec![1i64, -100, 4, 0], 4, Device::Cpu).unwrap();
    let l = Var::leaf(logits.t().unwrap().contiguous().unwrap());
    let loss = l.cross_entropy(&t, Some(-100)).unwrap();
    let x = vals(l.tensor());
    let row = |r: usize, c: usize| {
        let s = &x[r * 5..r * 5 + 5];
        s.iter().map(|v| v.exp()).sum::<f64>().ln() - s[c]
    };
    let want = (row(0, 1) + row(2, 4) + row(3, 0)) / 3.0;
    assert_close(
        &[loss.tensor().item().unwrap()],
        &[want],
        1e-12,
        0.0,
        "mean over non-ignored rows",
    );
    // Every row ignored: loss 0, gradient 0.
    let all = Tensor::from_vec(vec![-100i64; 4], 4, Device::Cpu).unwrap();
    let loss = l.cross_entropy(&all, Some(-100)).unwrap();
    assert_eq!(loss.tensor().item().unwrap(), 0.0);
    loss.backward().unwrap();
    assert!(grad_of(&l).iter().all(|&g| g == 0.0));
}

#[test]
fn embedding_gradient_with_repeated_ids() {
    let table = rand(95, &[5, 3], -1.0, 1.0);
    let ids = Tensor::from_vec(vec![4i64, 1, 4, 0, 4, 2], (2, 3), Device::Cpu).unwrap();
    gc(
        "embedding",
        |v| Var::embedding(&v[0], &ids)?.sqr(),
        std::slice::from_ref(&table),
    );
    // A non-contiguous table: a transposed [3, 5] leaf.
    let tt = table.t().unwrap().contiguous().unwrap();
    gc(
        "embedding of a transposed table",
        |v| Var::embedding(&v[0].t_(), &ids)?.tanh(),
        &[tt],
    );
    // Row 4 is used three times: its gradient is the sum of the three upstream rows.
    let w = Var::leaf(table);
    let g = rand(96, &[2, 3, 3], -1.0, 1.0);
    Var::embedding(&w, &ids)
        .unwrap()
        .backward_with(g.clone())
        .unwrap();
    let (gv, gw) = (vals(&g), grad_of(&w));
    for c in 0..3 {
        assert_close(
            &[gw[4 * 3 + c]],
            &[gv[c] + gv[2 * 3 + c] + gv[4 * 3 + c]],
            1e-15,
            0.0,
            "row 4",
        );
        assert_eq!(gw[3 * 3 + c], 0.0, "unused row 3");
    }
}

#[test]
fn dropout_gradient_is_the_mask() {
    let spec = DropoutSpec {
        p: 0.4,
        seed: 77,
        start: 10,
    };
    let x = rand(97, &[4, 5], -1.0, 1.0);
    gc(
        "dropout",
        |v| v[0].dropout(spec)?.sqr(),
        std::slice::from_ref(&x),
    );
    let xv = Var::leaf(x.clone());
    xv.dropout(spec)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let mask = Tensor::dropout_mask(77, 10, 0.4, (4, 5), DType::F64, Device::Cpu).unwrap();
    assert_eq!(grad_of(&xv), vals(&mask));
    assert!(vals(&mask).contains(&0.0), "some elements dropped");
    // The output is x * mask.
    let y = Var::leaf(x.clone()).dropout(spec).unwrap();
    assert_eq!(vals(y.tensor()), vals(&x.mul(&mask).unwrap()));
    // p = 0 is the identity.
    let v = Var::leaf(x);
    assert_eq!(
        v.dropout(DropoutSpec {
            p: 0.0,
            seed: 1,
            start: 0
        })
        .unwrap()
        .id(),
        v.id()
    );
}

#[test]
fn small_networks() {
    // A two-layer MLP with layer norm, GELU and a cross-entropy loss.
    let x = rand(200, &[4, 3], -1.0, 1.0);
    let w1 = rand(201, &[3, 5], -1.0, 1.0);
    let b1 = rand(202, &[5], -0.1, 0.1);
    let g = rand(203, &[5], 0.5, 1.5);
    let w2 = rand(204, &[5, 3], -1.0, 1.0);
    let targets = Tensor::from_vec(vec![0i64, 2, 1, 2], 4, Device::Cpu).unwrap();
    gc(
        "mlp",
        |v| {
            let h = v[0]
                .matmul(&v[1])?
                .add(&v[2])?
                .layer_norm(Some(&v[3]), None, 1e-5)?
                .gelu(GeluKind::Tanh)?;
            h.matmul(&v[4])?.cross_entropy(&targets, None)
        },
        &[x, w1, b1, g, w2],
    );
    // A single attention head with projections from one input used three times.
    let x = rand(210, &[1, 4, 3], -1.0, 1.0);
    let wq = rand(211, &[3, 2], -1.0, 1.0);
    let wk = rand(212, &[3, 2], -1.0, 1.0);
    gc(
        "self-attention",
        |v| {
            let (q, k) = (v[0].matmul(&v[1])?, v[0].matmul(&v[2])?);
            let val = v[0].narrow(2, 0, 2)?;
            Var::attention(&q, &k, &val, &AttentionMask::causal(), 0.7)?.softmax(-1)
        },
        &[x, wq, wk],
    );
}

#[test]
fn gradcheck_catches_a_wrong_rule() {
    // A custom op whose backward is off by a factor must be reported, naming the element.
    struct Wrong;
    impl meshgrad_autograd::Function for Wrong {
        fn name(&self) -> &'static str {
            "wrong"
        }
        fn forward(&self, x: &[Tensor]) -> Result<Tensor> {
            x[0].sqr()
        }
        fn backward(&self, x: &[Tensor], _out: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
            Ok(vec![Some(g.mul(&x[0])?.mul_scalar(2.1)?)])
        }
    }
    let f = std::sync::Arc::new(Wrong);
    let e = gradcheck(
        |v| meshgrad_autograd::apply(f.clone(), &[&v[0]]),
        &[rand(1, &[3], 0.5, 1.0)],
        GradcheckOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("element") && e.contains("analytic"), "{e}");
}

#[test]
fn linear_with_and_without_bias() {
    let x = rand(300, &[2, 3, 4], -1.0, 1.0);
    let w = rand(301, &[5, 4], -1.0, 1.0);
    let b = rand(302, &[5], -1.0, 1.0);
    gc(
        "linear with bias",
        |v| Var::linear(&v[0], &v[1], Some(&v[2])),
        &[x.clone(), w.clone(), b.clone()],
    );
    gc(
        "linear without bias",
        |v| Var::linear(&v[0], &v[1], None),
        &[x.clone(), w.clone()],
    );
    // Non-contiguous input (transposed) and weight (a transposed [in, out] leaf).
    let xt = rand(303, &[4, 3], -1.0, 1.0);
    let wt = rand(304, &[4, 5], -1.0, 1.0);
    gc(
        "linear of strided views",
        |v| Var::linear(&v[0].t_(), &v[1].t_(), Some(&v[2])),
        &[xt, wt, b.clone()],
    );
    // A vector input.
    let x1 = rand(305, &[4], -1.0, 1.0);
    gc(
        "linear of a vector",
        |v| Var::linear(&v[0], &v[1], Some(&v[2]))?.tanh(),
        &[x1, w.clone(), b.clone()],
    );
    // Equals matmul with the transposed weight plus bias.
    let (xv, wv, bv) = (Var::leaf(x), Var::leaf(w), Var::leaf(b));
    let fused = Var::linear(&xv, &wv, Some(&bv)).unwrap();
    let plain = xv.matmul(&wv.t_()).unwrap().add(&bv).unwrap();
    assert_close(
        &vals(fused.tensor()),
        &vals(plain.tensor()),
        1e-14,
        1e-14,
        "linear vs matmul + bias",
    );
}

#[test]
fn attention_from_fused_qkv() {
    for causal in [true, false] {
        let qkv = rand(310, &[2, 3, 12], -1.0, 1.0); // 2 heads of 2
        gc(
            &format!("attention_qkv causal={causal}"),
            |v| Var::attention_qkv(&v[0], 2, &causal_mask(causal), 0.6),
            std::slice::from_ref(&qkv),
        );
        // A strided qkv: a transposed [B, 3C, T] leaf.
        let qt = qkv.transpose(1, 2).unwrap().contiguous().unwrap();
        gc(
            &format!("attention_qkv of a transposed view causal={causal}"),
            |v| Var::attention_qkv(&v[0].transpose(1, 2)?, 1, &causal_mask(causal), 0.6),
            &[qt],
        );
    }
}

#[test]
fn clamp_gradient_passes_inside_the_bounds() {
    type Clamp = (&'static str, Option<f64>, Option<f64>);
    let cases: [Clamp; 3] = [
        ("clamp(-0.5, 0.7)", Some(-0.5), Some(0.7)),
        ("clamp(min -0.3)", Some(-0.3), None),
        ("clamp(max 0.4)", None, Some(0.4)),
    ];
    for (k, (name, lo, hi)) in cases.into_iter().enumerate() {
        // Away from the kinks at the bounds.
        let bounds: Vec<f64> = lo.into_iter().chain(hi).collect();
        let x = rand_where(400 + k as u64, &[3, 4], -2.0, 2.0, |v| {
            min_gap(v, &bounds) > 1e-3
        });
        gc(
            name,
            |v| v[0].clamp(lo, hi)?.sqr(),
            std::slice::from_ref(&x),
        );
        gc(
            &format!("{name} on a strided view"),
            |v| v[0].transpose(0, 1)?.narrow(0, 1, 3)?.clamp(lo, hi),
            &[x],
        );
    }
    // At a bound the gradient passes (PyTorch's convention); outside it is 0.
    let x = Var::leaf(t64(&[-1.0, -1.5, 0.2, 1.0, 1.25], &[5]));
    x.clamp(Some(-1.0), Some(1.0))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grad_of(&x), vec![1.0, 0.0, 1.0, 1.0, 0.0]);
    assert!(x.clamp(None, None).is_err());
    assert!(x.clamp(Some(1.0), Some(0.0)).is_err());
}

#[test]
fn logsumexp_any_dim() {
    let x = rand(410, &[3, 4, 2], -2.0, 2.0);
    for dim in [0isize, 1, -1] {
        for keepdim in [false, true] {
            gc(
                &format!("logsumexp dim {dim} keepdim={keepdim}"),
                |v| v[0].logsumexp(dim, keepdim),
                std::slice::from_ref(&x),
            );
        }
    }
    // A permuted view, large values (where the max shift matters), and a composite use.
    let big = rand(411, &[4, 3], 300.0, 304.0);
    gc(
        "logsumexp of a transposed view",
        |v| v[0].t_().logsumexp(1, false)?.sqr(),
        std::slice::from_ref(&big),
    );
    // The gradient is softmax along the dim times the upstream gradient.
    let xv = Var::leaf(x.clone());
    let g = rand(412, &[3, 2], -1.0, 1.0);
    xv.logsumexp(1, false)
        .unwrap()
        .backward_with(g.clone())
        .unwrap();
    let (xs, gs, got) = (vals(&x), vals(&g), grad_of(&xv));
    for a in 0..3 {
        for c in 0..2 {
            let at = |b: usize| xs[(a * 4 + b) * 2 + c];
            let z: f64 = (0..4).map(|b| at(b).exp()).sum();
            for b in 0..4 {
                let want = at(b).exp() / z * gs[a * 2 + c];
                assert_close(
                    &[got[(a * 4 + b) * 2 + c]],
                    &[want],
                    1e-12,
                    1e-14,
                    "softmax * g",
                );
            }
        }
    }
}

#[test]
fn gather_and_index_select_accumulate_repeated_indices() {
    let x = rand(420, &[3, 4], -1.0, 1.0);
    // dim 0, index [2, 4] with repeats; dim 1, index [3, 5] wider than the input.
    let i0 = Tensor::from_vec(vec![2i64, 0, 2, 1, 2, 2, 0, 1], (2, 4), Device::Cpu).unwrap();
    let i1 = Tensor::from_vec(
        vec![3i64, 3, 0, 1, 3, 2, 2, 2, 0, 0, 1, 3, 1, 0, 3],
        (3, 5),
        Device::Cpu,
    )
    .unwrap();
    gc(
        "gather dim 0",
        |v| v[0].gather(0, &i0)?.sqr(),
        std::slice::from_ref(&x),
    );
    gc(
        "gather dim 1",
        |v| v[0].gather(-1, &i1)?.tanh(),
        std::slice::from_ref(&x),
    );
    // A strided input: the transpose of a [4, 3] leaf.
    let xt = x.t().unwrap().contiguous().unwrap();
    gc(
        "gather of a transposed view",
        |v| v[0].t_().gather(1, &i1)?.sqr(),
        std::slice::from_ref(&xt),
    );
    let ids = Tensor::from_vec(vec![3u32, 1, 3, 3, 0], 5, Device::Cpu).unwrap();
    gc(
        "index_select dim 1",
        |v| v[0].index_select(1, &ids)?.sqr(),
        std::slice::from_ref(&x),
    );
    let rows = Tensor::from_vec(vec![2i64, 2, 0], 3, Device::Cpu).unwrap();
    gc(
        "index_select dim 0 of a transposed view",
        |v| v[0].t_().index_select(0, &rows)?.tanh(),
        std::slice::from_ref(&xt),
    );
    // Exact accumulation: column 3 is read three times, column 2 never.
    let xv = Var::leaf(x.clone());
    let g = rand(421, &[3, 5], -1.0, 1.0);
    xv.index_select(1, &ids)
        .unwrap()
        .backward_with(g.clone())
        .unwrap();
    let (gv, gx) = (vals(&g), grad_of(&xv));
    for r in 0..3 {
        let want = gv[r * 5] + gv[r * 5 + 2] + gv[r * 5 + 3];
        assert_close(&[gx[r * 4 + 3]], &[want], 1e-15, 0.0, "column 3");
        assert_eq!(gx[r * 4 + 2], 0.0, "unused column 2");
    }
    // gather along dim 0: the expected scatter-add, from the index values in a plain loop.
    let xv = Var::leaf(x);
    let g = rand(422, &[2, 4], -1.0, 1.0);
    xv.gather(0, &i0).unwrap().backward_with(g.clone()).unwrap();
    let (gv, gx) = (vals(&g), grad_of(&xv));
    let idx = vals(&i0);
    let mut want = vec![0.0; 12];
    for p in 0..8 {
        want[idx[p] as usize * 4 + p % 4] += gv[p];
    }
    assert_close(&gx, &want, 1e-15, 0.0, "gather scatter-add");
}

#[test]
fn cross_entropy_over_nd_logits() {
    // Logits [B, T, V] = [2, 3, 4] with targets [2, 3] (one ignored), read through a permuted
    // view of a [4, 3, 2] leaf.
    let logits = rand(430, &[4, 3, 2], -2.0, 2.0);
    let targets = Tensor::from_vec(vec![1i64, -100, 3, 0, 2, 2], (2, 3), Device::Cpu).unwrap();
    gc(
        "cross_entropy [B, T, V] ignore_index",
        |v| {
            v[0].permute(&[2, 1, 0])?
                .cross_entropy(&targets, Some(-100))
        },
        std::slice::from_ref(&logits),
    );
    let t32 = Tensor::from_vec(vec![1u32, 0, 3, 0, 2, 2], (2, 3), Device::Cpu).unwrap();
    gc(
        "cross_entropy [B, T, V] u32 targets",
        |v| v[0].permute(&[2, 1, 0])?.cross_entropy(&t32, None),
        std::slice::from_ref(&logits),
    );
    // The same loss and gradient as the flattened [B*T, V] form that existing callers use.
    let l3 = logits.permute(&[2, 1, 0]).unwrap().contiguous().unwrap();
    let (a, b) = (
        Var::leaf(l3.clone()),
        Var::leaf(l3.reshape((6, 4)).unwrap()),
    );
    let la = a.cross_entropy(&targets, Some(-100)).unwrap();
    let lb = b
        .cross_entropy(&targets.reshape(6).unwrap(), Some(-100))
        .unwrap();
    assert_eq!(vals(la.tensor()), vals(lb.tensor()));
    la.backward().unwrap();
    lb.backward().unwrap();
    assert_eq!(a.grad().unwrap().dims(), [2, 3, 4]);
    assert_eq!(grad_of(&a), grad_of(&b));
    // Mean over the non-ignored positions, against a plain f64 loop.
    let x = vals(&l3);
    let t = [1i64, -100, 3, 0, 2, 2];
    let mut sum = 0.0;
    for (r, &tr) in t.iter().enumerate() {
        if tr != -100 {
            let row = &x[r * 4..r * 4 + 4];
            sum += row.iter().map(|v| v.exp()).sum::<f64>().ln() - row[tr as usize];
        }
    }
    assert_close(
        &[la.tensor().item().unwrap()],
        &[sum / 5.0],
        1e-12,
        0.0,
        "mean over 5 positions",
    );
    // Shape mismatch names both shapes; out-of-range targets are errors.
    let bad = Tensor::from_vec(vec![0i64; 6], (3, 2), Device::Cpu).unwrap();
    let e = a.cross_entropy(&bad, None).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]") && e.contains("[3, 2]"), "{e}");
    let oob = Tensor::from_vec(vec![0i64, 1, 4, 0, 0, 0], (2, 3), Device::Cpu).unwrap();
    assert!(a.cross_entropy(&oob, Some(-100)).is_err());
    // Every position ignored: loss 0, gradient 0.
    let all = Tensor::from_vec(vec![-100i64; 6], (2, 3), Device::Cpu).unwrap();
    let c = Var::leaf(l3);
    let loss = c.cross_entropy(&all, Some(-100)).unwrap();
    assert_eq!(loss.tensor().item().unwrap(), 0.0);
    loss.backward().unwrap();
    assert!(grad_of(&c).iter().all(|&g| g == 0.0));
}

/// The attention mask with only the causal flag set.
fn causal_mask(causal: bool) -> AttentionMask<Var> {
    AttentionMask {
        causal,
        ..AttentionMask::none()
    }
}

#[test]
fn attach_aux_loss_adds_weight_times_aux_to_the_objective() {
    // f(x, a) = attach(x * x, sum(a * a)) projected by gradcheck's weights w: the gradients must
    // be those of sum(w * x * x) + 0.75 * sum(a * a), which finite differences of that explicit
    // objective check.
    let (x, a) = (rand(41, &[2, 3], -1.0, 1.0), rand(42, &[4], -1.0, 1.0));
    let xs = [Var::leaf(x.clone()), Var::leaf(a.clone())];
    let aux = xs[1].sqr().unwrap().sum_all().unwrap();
    let y = xs[0].sqr().unwrap().attach_aux_loss(&aux, 0.75).unwrap();
    assert_eq!(vals(y.tensor()), vals(xs[0].sqr().unwrap().tensor()));
    let w = rand(43, &[2, 3], -1.0, 1.0);
    y.backward_with(w.clone()).unwrap();
    let objective = |x: &[f64], a: &[f64]| -> f64 {
        let wv = vals(&w);
        let main: f64 = x.iter().zip(&wv).map(|(x, w)| x * x * w).sum();
        main + 0.75 * a.iter().map(|a| a * a).sum::<f64>()
    };
    let (xv, av) = (vals(&x), vals(&a));
    let eps = 1e-6;
    let fd = |i: usize, of_x: bool| -> f64 {
        let (mut xp, mut xm, mut ap, mut am) = (xv.clone(), xv.clone(), av.clone(), av.clone());
        if of_x {
            xp[i] += eps;
            xm[i] -= eps;
        } else {
            ap[i] += eps;
            am[i] -= eps;
        }
        (objective(&xp, &ap) - objective(&xm, &am)) / (2.0 * eps)
    };
    let gx: Vec<f64> = (0..6).map(|i| fd(i, true)).collect();
    let ga: Vec<f64> = (0..4).map(|i| fd(i, false)).collect();
    assert_close(&grad_of(&xs[0]), &gx, 1e-7, 1e-6, "x");
    assert_close(&grad_of(&xs[1]), &ga, 1e-7, 1e-6, "aux input");
    // A tensor of several elements is refused.
    let e = xs[0].attach_aux_loss(&xs[1], 1.0).unwrap_err().to_string();
    assert!(e.contains("one element") && e.contains("[4]"), "{e}");
}
