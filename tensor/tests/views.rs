//! Views and copies: permute/transpose/narrow/expand/(un)squeeze share storage and read the right
//! elements; contiguous(), reshape (view when possible, copy otherwise), copy_from into views,
//! in-place updates, constructors and shape errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Shape, Tensor};

fn seq(dims: &[usize], device: Device) -> (Vec<f64>, Tensor) {
    let v: Vec<f64> = (0..numel(dims)).map(|i| i as f64).collect();
    let t = tensor_on(device, &v, dims, DType::F64);
    (v, t)
}

fn permute_transpose_narrow_are_views_with_the_right_values(device: Device) -> Result<()> {
    let mut rng = Rng::new(20);
    for _ in 0..30 {
        let dims = rng.dims(1, 5, 4);
        let rank = dims.len();
        let (v, t) = seq(&dims, device);
        let perm = rng.perm(rank);
        let p = t.permute(&perm).unwrap();
        assert!(p.same_storage(&t));
        let (pv, pd) = ref_permute(&v, &dims, &perm);
        check(
            &p,
            &pd,
            &pv,
            0.0,
            0.0,
            &format!("permute {dims:?} by {perm:?}"),
        );

        let (a, b) = (rng.below(rank), rng.below(rank));
        let named = |d: usize, neg: bool| {
            if neg {
                d as isize - rank as isize
            } else {
                d as isize
            }
        };
        let tr = t
            .transpose(named(a, rng.bool()), named(b, rng.bool()))
            .unwrap();
        let mut sw: Vec<usize> = (0..rank).collect();
        sw.swap(a, b);
        let (tv, td) = ref_permute(&v, &dims, &sw);
        check(
            &tr,
            &td,
            &tv,
            0.0,
            0.0,
            &format!("transpose {dims:?} {a} {b}"),
        );

        let d = rng.below(rank);
        let start = rng.below(dims[d]);
        let len = rng.range(0, dims[d] - start);
        // Narrow a permuted view: views compose.
        let pn = p
            .narrow(
                d as isize,
                start.min(pd[d] - 1),
                len.min(pd[d] - start.min(pd[d] - 1)),
            )
            .unwrap();
        let (s2, l2) = (start.min(pd[d] - 1), len.min(pd[d] - start.min(pd[d] - 1)));
        let (nv, nd) = ref_narrow(&pv, &pd, d, s2, l2);
        assert!(pn.same_storage(&t));
        check(
            &pn,
            &nd,
            &nv,
            0.0,
            0.0,
            &format!("narrow({d}, {s2}, {l2}) of permuted {pd:?}"),
        );
    }
    let (_, t) = seq(&[2, 3], device);
    assert!(t.t().unwrap().t().unwrap().is_contiguous());
    assert!(!t.t().unwrap().is_contiguous());
    assert!(
        t.narrow(0, 1, 1).unwrap().is_contiguous(),
        "a row of a matrix is contiguous at an offset"
    );
    assert!(!t.narrow(1, 1, 1).unwrap().is_contiguous());
    assert!(
        Tensor::zeros(3, DType::F32, device).unwrap().t().is_err(),
        "t() of a vector"
    );
    Ok(())
}
test_device!(permute_transpose_narrow_are_views_with_the_right_values);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn view_errors_name_the_shape() {
    let (_, t) = seq(&[2, 3, 4], Device::Cpu);
    let e = t.narrow(1, 2, 2).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]"), "{e}");
    assert!(t.narrow(3, 0, 1).is_err());
    assert!(t.narrow(-4, 0, 1).is_err());
    let e = t.permute(&[0, 0, 1]).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]"), "{e}");
    assert!(t.permute(&[0, 1]).is_err());
    let e = t.transpose(0, 3).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]"), "{e}");
    let e = t.squeeze(1).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]"), "{e}");
    assert!(t.unsqueeze(4).is_err());
    assert!(t.unsqueeze(-5).is_err());
    let e = t.expand([2, 5, 4]).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]") && e.contains("[2, 5, 4]"), "{e}");
    assert!(t.expand([3, 4]).is_err(), "expand to a lower rank");
    let e = t.reshape([5, 5]).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]") && e.contains("[5, 5]"), "{e}");
    assert!(t.size(3).is_err());
    assert_eq!(t.size(-1).unwrap(), 4);
}

fn expand_unsqueeze_squeeze(device: Device) -> Result<()> {
    let (v, t) = seq(&[3, 1], device);
    let e = t.expand([2, 3, 4]).unwrap();
    assert!(e.same_storage(&t));
    assert_eq!(e.layout().strides()[0], 0);
    let exp: Vec<f64> = (0..24).map(|i| v[unravel(i, &[2, 3, 4])[1]]).collect();
    check(&e, &[2, 3, 4], &exp, 0.0, 0.0, "expand");
    check(
        &e.contiguous().unwrap(),
        &[2, 3, 4],
        &exp,
        0.0,
        0.0,
        "contiguous of expand",
    );
    // Unsqueeze at every position, negative too, then squeeze back.
    let (v, t) = seq(&[2, 3], device);
    for (d, want) in [
        (0isize, vec![1, 2, 3]),
        (1, vec![2, 1, 3]),
        (2, vec![2, 3, 1]),
        (-1, vec![2, 3, 1]),
        (-3, vec![1, 2, 3]),
    ] {
        let u = t.unsqueeze(d).unwrap();
        check(&u, &want, &v, 0.0, 0.0, &format!("unsqueeze({d})"));
        assert!(u.is_contiguous());
        let s = u.squeeze(d).unwrap();
        check(&s, &[2, 3], &v, 0.0, 0.0, &format!("squeeze({d})"));
    }
    // Unsqueeze of a non-contiguous view keeps reading the right elements.
    let tt = t.t().unwrap().unsqueeze(1).unwrap();
    let (tv, _) = ref_permute(&v, &[2, 3], &[1, 0]);
    check(&tt, &[3, 1, 2], &tv, 0.0, 0.0, "unsqueeze of transpose");
    check(
        &tt.contiguous().unwrap(),
        &[3, 1, 2],
        &tv,
        0.0,
        0.0,
        "contiguous of unsqueezed transpose",
    );
    Ok(())
}
test_device!(expand_unsqueeze_squeeze);

fn contiguous_copies_only_when_needed(device: Device) -> Result<()> {
    let mut rng = Rng::new(21);
    for _ in 0..20 {
        let dims = rng.dims(0, 4, 5);
        let x = uniform_vals(rng.next_u64(), numel(&dims), -1.0, 1.0);
        let lay = Lay::random(&mut rng, dims.len());
        let t = strided_on(device, &x, &dims, &lay, DType::F32);
        let c = t.contiguous().unwrap();
        assert!(c.is_contiguous());
        assert_eq!(c.same_storage(&t), t.is_contiguous(), "{lay:?}");
        check(
            &c,
            &dims,
            &round_to(&x, DType::F32),
            0.0,
            0.0,
            &format!("contiguous {dims:?} {lay:?}"),
        );
        // deep_clone never shares.
        let d = t.deep_clone().unwrap();
        assert!(!d.same_storage(&t));
        check(&d, &dims, &round_to(&x, DType::F32), 0.0, 0.0, "deep_clone");
    }
    Ok(())
}
test_device!(contiguous_copies_only_when_needed);

fn reshape_is_a_view_when_possible_else_a_copy(device: Device) -> Result<()> {
    let (v, t) = seq(&[2, 3, 4], device);
    // Contiguous: always a view.
    let r = t.reshape([6, 4]).unwrap();
    assert!(r.same_storage(&t));
    check(&r, &[6, 4], &v, 0.0, 0.0, "reshape contiguous");
    let r = t.reshape(24).unwrap();
    assert!(r.same_storage(&t));
    let r = t.reshape([4, 1, 6]).unwrap();
    assert!(r.same_storage(&t));
    check(&r, &[4, 1, 6], &v, 0.0, 0.0, "reshape with a unit dim");
    // Transposed: flattening needs a copy, in the logical (row-major) order.
    let tr = t.transpose(0, 2).unwrap();
    let (tv, _) = ref_permute(&v, &[2, 3, 4], &[2, 1, 0]);
    let f = tr.reshape(24).unwrap();
    assert!(!f.same_storage(&t));
    check(&f, &[24], &tv, 0.0, 0.0, "reshape of transpose");
    // Splitting the leading dim of a column-narrowed matrix stays a view.
    let (v8, m) = seq(&[4, 8], device);
    let n = m.narrow(1, 2, 4).unwrap();
    let s = n.reshape([2, 2, 4]).unwrap();
    assert!(s.same_storage(&m));
    let (nv, _) = ref_narrow(&v8, &[4, 8], 1, 2, 4);
    check(&s, &[2, 2, 4], &nv, 0.0, 0.0, "reshape of narrowed rows");
    // Merging non-adjacent dims of that view copies.
    let f = n.reshape(16).unwrap();
    assert!(!f.same_storage(&m));
    check(&f, &[16], &nv, 0.0, 0.0, "flatten of narrowed");
    // Random strided tensors reshaped to random factorisations keep the logical order.
    let mut rng = Rng::new(22);
    for _ in 0..30 {
        let dims = rng.dims(1, 4, 4);
        let x = uniform_vals(rng.next_u64(), numel(&dims), -1.0, 1.0);
        let lay = Lay::random(&mut rng, dims.len());
        let t = strided_on(device, &x, &dims, &lay, DType::F64);
        // Factor the element count into a random shape.
        let mut rest = numel(&dims);
        let mut nd = Vec::new();
        while rest > 1 {
            let divs: Vec<usize> = (2..=rest).filter(|d| rest.is_multiple_of(*d)).collect();
            let d = divs[rng.below(divs.len())];
            nd.push(d);
            rest /= d;
            if rng.below(4) == 0 {
                nd.push(1);
            }
        }
        let r = t.reshape(nd.clone()).unwrap();
        check(
            &r,
            &nd,
            &x,
            0.0,
            0.0,
            &format!("reshape {dims:?} {lay:?} to {nd:?}"),
        );
    }
    Ok(())
}
test_device!(reshape_is_a_view_when_possible_else_a_copy);

fn copy_from_into_views(device: Device) -> Result<()> {
    // Into a narrowed view: only those elements change.
    let base = Tensor::zeros((4, 6), DType::F64, device).unwrap();
    let src: Vec<f64> = (1..=12).map(|i| i as f64).collect();
    base.narrow(1, 2, 3)
        .unwrap()
        .copy_from(&tensor_on(device, &src, &[4, 3], DType::F64))
        .unwrap();
    let exp: Vec<f64> = (0..24)
        .map(|i| {
            let (r, c) = (i / 6, i % 6);
            if (2..5).contains(&c) {
                src[r * 3 + c - 2]
            } else {
                0.0
            }
        })
        .collect();
    check(&base, &[4, 6], &exp, 0.0, 0.0, "copy_from into narrow");
    // From a transposed source into a transposed destination.
    let dst = Tensor::zeros((3, 4), DType::F32, device).unwrap();
    let s = tensor_on(device, &src, &[3, 4], DType::F32);
    dst.t().unwrap().copy_from(&s.t().unwrap()).unwrap();
    check(&dst, &[3, 4], &src, 0.0, 0.0, "transposed into transposed");
    // From an expanded source.
    let row = tensor_on(device, &[1.0, 2.0, 3.0, 4.0], &[4], DType::F32);
    dst.copy_from(&row.expand([3, 4]).unwrap()).unwrap();
    check(
        &dst,
        &[3, 4],
        &[1.0, 2.0, 3.0, 4.0].repeat(3),
        0.0,
        0.0,
        "copy of expand",
    );
    // Overlapping source and destination in one storage (shift rows down by one).
    let (v, m) = seq(&[4, 3], device);
    m.narrow(0, 1, 3)
        .unwrap()
        .copy_from(&m.narrow(0, 0, 3).unwrap())
        .unwrap();
    let mut exp = v[..3].to_vec();
    exp.extend_from_slice(&v[..9]);
    check(&m, &[4, 3], &exp, 0.0, 0.0, "overlapping copy_from");
    // Views created before the copy see the new values.
    let (_, m) = seq(&[2, 2], device);
    let view = m.t().unwrap();
    m.copy_from(&tensor_on(
        device,
        &[9.0, 8.0, 7.0, 6.0],
        &[2, 2],
        DType::F64,
    ))
    .unwrap();
    check(
        &view,
        &[2, 2],
        &[9.0, 7.0, 8.0, 6.0],
        0.0,
        0.0,
        "older view sees the copy",
    );
    // Errors.
    let e = base
        .copy_from(&tensor_on(device, &src, &[4, 3], DType::F64))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[4, 6]") && e.contains("[4, 3]"), "{e}");
    assert!(base
        .copy_from(&Tensor::zeros((4, 6), DType::F32, device).unwrap())
        .is_err());
    Ok(())
}
test_device!(copy_from_into_views);

fn fill_and_add_assign_write_through_views(device: Device) -> Result<()> {
    let (_, m) = seq(&[3, 4], device);
    m.narrow(1, 1, 2).unwrap().fill_(-1.0).unwrap();
    check(
        &m,
        &[3, 4],
        &[0., -1., -1., 3., 4., -1., -1., 7., 8., -1., -1., 11.],
        0.0,
        0.0,
        "fill_ of a narrow",
    );
    let (_, m) = seq(&[3, 4], device);
    let col = m.t().unwrap().narrow(0, 0, 1).unwrap(); // [1, 3] view of column 0
    col.add_assign(&tensor_on(device, &[100.0], &[1], DType::F64))
        .unwrap();
    check(
        &m,
        &[3, 4],
        &[100., 1., 2., 3., 104., 5., 6., 7., 108., 9., 10., 11.],
        0.0,
        0.0,
        "add_assign through a view, broadcast rhs",
    );
    // A rhs that would grow the shape is refused.
    assert!(col
        .add_assign(&Tensor::zeros((2, 3), DType::F64, device).unwrap())
        .is_err());
    Ok(())
}
test_device!(fill_and_add_assign_write_through_views);

fn constructors_and_readback(device: Device) -> Result<()> {
    let a = Tensor::arange(-2, 3, DType::I64, device).unwrap();
    assert_eq!(a.to_vec::<i64>().unwrap(), vec![-2, -1, 0, 1, 2]);
    assert_eq!(
        Tensor::arange(3, 3, DType::F32, device)
            .unwrap()
            .elem_count(),
        0
    );
    let f = Tensor::full(2.5, (2, 2), DType::BF16, device).unwrap();
    assert_eq!(vals(&f), vec![2.5; 4]);
    assert_eq!(
        Tensor::ones(3, DType::U8, device)
            .unwrap()
            .to_vec::<u8>()
            .unwrap(),
        vec![1, 1, 1]
    );
    let z = Tensor::zeros((2, 0, 3), DType::F32, device).unwrap();
    assert_eq!(z.elem_count(), 0);
    assert_eq!(z.to_vec::<f32>().unwrap(), Vec::<f32>::new());
    let s = Tensor::scalar(3.0, DType::F64, device).unwrap();
    assert_eq!(s.rank(), 0);
    assert_eq!(s.item().unwrap(), 3.0);
    let e = Tensor::from_vec(vec![1f32, 2., 3.], (2, 2), device)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 2]"), "{e}");
    let e = a.item().unwrap_err().to_string();
    assert!(e.contains("[5]"), "{e}");
    assert!(
        a.to_vec::<f32>().is_err(),
        "to_vec with the wrong element type"
    );
    let l = Tensor::zeros((2, 3), DType::F32, device)
        .unwrap()
        .zeros_like()
        .unwrap();
    assert_eq!((l.dims(), l.dtype()), (&[2usize, 3][..], DType::F32));
    assert_eq!(vals(&l.ones_like().unwrap()), vec![1.0; 6]);
    // to_cpu_storage of a view holds just the view's elements.
    let (v, m) = seq(&[3, 4], device);
    let st = m.narrow(0, 1, 2).unwrap().to_cpu_storage().unwrap();
    assert_eq!(st.len(), 8);
    assert_eq!(st.as_bytes().len(), 64);
    let back = Tensor::from_cpu(st, (2, 4), device).unwrap();
    check(
        &back,
        &[2, 4],
        &v[4..12],
        0.0,
        0.0,
        "to_cpu_storage of a narrow",
    );
    assert_eq!(Shape::from((2, 3)).elem_count(), 6);
    assert_eq!("bf16".parse::<DType>().unwrap(), DType::BF16);
    assert!("f8".parse::<DType>().is_err());
    Ok(())
}
test_device!(constructors_and_readback);

fn sum_to_shape_inverts_broadcasting(device: Device) -> Result<()> {
    let x = uniform_vals(31, 2 * 3 * 4, -1.0, 1.0);
    let t = tensor_on(device, &x, &[2, 3, 4], DType::F64);
    for target in [
        vec![3, 4],
        vec![1, 4],
        vec![3, 1],
        vec![2, 1, 4],
        vec![1, 1, 1],
        vec![],
        vec![2, 3, 4],
    ] {
        let r = t.sum_to_shape(&Shape::from(target.clone())).unwrap();
        let exp: Vec<f64> = {
            let mut out = vec![0.0; numel(&target)];
            for (i, &v) in x.iter().enumerate() {
                let idx = unravel(i, &[2, 3, 4]);
                out[bcast_index(&target, &idx)] += v;
            }
            out
        };
        check(
            &r,
            &target,
            &exp,
            1e-12,
            1e-12,
            &format!("sum_to_shape {target:?}"),
        );
    }
    assert!(t.sum_to_shape(&Shape::from([5])).is_err());
    assert!(t.sum_to_shape(&Shape::from([2, 2, 3, 4])).is_err());
    Ok(())
}
test_device!(sum_to_shape_inverts_broadcasting);
