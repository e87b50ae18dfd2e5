//! `gather` and `index_select` and their backward passes against float64 references written
//! here (own index arithmetic), with random shapes, non-contiguous inputs, indices and
//! gradients, repeated indices, integer payloads, error cases, and thread-count independence.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

/// Index values (as i64) in a tensor of `dims`, laid out transposed when `transposed` (so the
/// index tensor itself is non-contiguous).
fn index_tensor(device: Device, v: &[i64], dims: &[usize], transposed: bool) -> Tensor {
    if !transposed || dims.len() < 2 {
        return Tensor::from_vec(v.to_vec(), dims, device).unwrap();
    }
    // Store the transpose of the last two dims physically, then view it back.
    let r = dims.len();
    let mut pd = dims.to_vec();
    pd.swap(r - 2, r - 1);
    let mut buf = vec![0i64; v.len()];
    for (i, &x) in v.iter().enumerate() {
        let mut idx = unravel(i, dims);
        idx.swap(r - 2, r - 1);
        buf[ravel(&idx, &pd)] = x;
    }
    let t = Tensor::from_vec(buf, pd, device).unwrap();
    let t = t.transpose(-1, -2).unwrap();
    assert!(!t.is_contiguous() || dims[r - 1] == 1 || dims[r - 2] == 1);
    t
}

/// `out[p] = x[p with dim replaced by index[p]]`.
fn ref_gather(x: &[f64], xd: &[usize], d: usize, index: &[i64], id: &[usize]) -> Vec<f64> {
    (0..index.len())
        .map(|p| {
            let mut c = unravel(p, id);
            c[d] = index[p] as usize;
            x[ravel(&c, xd)]
        })
        .collect()
}

fn ref_scatter_add(g: &[f64], xd: &[usize], d: usize, index: &[i64], id: &[usize]) -> Vec<f64> {
    let mut dx = vec![0.0; numel(xd)];
    for p in 0..index.len() {
        let mut c = unravel(p, id);
        c[d] = index[p] as usize;
        dx[ravel(&c, xd)] += g[p];
    }
    dx
}

fn gather_and_backward_match_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(41);
    for it in 0..30 {
        let xd = rng.dims(1, 4, 5);
        let r = xd.len();
        let d = rng.below(r);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - r as isize
        };
        // Index dims: up to the input's in every dim but d, anything along d.
        let id: Vec<usize> = (0..r)
            .map(|k| {
                if k == d {
                    rng.range(1, 7)
                } else {
                    rng.range(1, xd[k])
                }
            })
            .collect();
        // Few distinct values so that indices repeat.
        let index: Vec<i64> = (0..numel(&id))
            .map(|_| rng.below(xd[d].min(3)) as i64)
            .collect();
        let x = uniform_vals(8000 + it, numel(&xd), -1.0, 1.0);
        let ti = index_tensor(device, &index, &id, it % 2 == 1);
        let what = format!("gather {xd:?} dim {named} index {id:?}");
        for dtype in [DType::F64, DType::F32, DType::BF16, DType::I64] {
            let src: Vec<f64> = if dtype == DType::I64 {
                (0..x.len()).map(|i| i as f64 - 7.0).collect()
            } else {
                x.clone()
            };
            let tx = strided_on(device, &src, &xd, &Lay::random(&mut rng, r), dtype);
            let out = tx.gather(named, &ti).unwrap();
            assert_eq!(out.dtype(), dtype);
            let exp = ref_gather(&round_to(&src, dtype), &xd, d, &index, &id);
            check(&out, &id, &exp, 0.0, 0.0, &format!("{what} {dtype}"));
        }
        // Backward from a strided gradient.
        let g = uniform_vals(8100 + it, numel(&id), -1.0, 1.0);
        let exp = ref_scatter_add(&g, &xd, d, &index, &id);
        for dtype in [DType::F64, DType::F32] {
            let tg = strided_on(device, &g, &id, &Lay::random(&mut rng, r), dtype);
            let dx = tg.gather_backward(named, &ti, xd.as_slice()).unwrap();
            assert_eq!(dx.dtype(), dtype);
            let (rtol, atol) = if dtype == DType::F64 {
                F64_TOL
            } else {
                F32_TOL
            };
            check(
                &dx,
                &xd,
                &exp,
                rtol,
                atol,
                &format!("{what} backward {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(gather_and_backward_match_reference);

fn gather_rank2_examples_and_u32_u8_indices(device: Device) -> Result<()> {
    // torch.gather's documented example: dim 1 of [[1, 2], [3, 4]] by [[0, 0], [1, 0]].
    let x = tensor_on(device, &[1.0, 2.0, 3.0, 4.0], &[2, 2], DType::F32);
    let i = Tensor::from_vec(vec![0u32, 0, 1, 0], (2, 2), device).unwrap();
    assert_eq!(vals(&x.gather(1, &i).unwrap()), vec![1.0, 1.0, 4.0, 3.0]);
    // dim 0: out[i][j] = x[index[i][j]][j]; a 3-row index over 2 rows.
    let i = Tensor::from_vec(vec![1u8, 0, 0, 0, 1, 1], (3, 2), device).unwrap();
    assert_eq!(
        vals(&x.gather(0, &i).unwrap()),
        vec![3.0, 2.0, 1.0, 2.0, 3.0, 4.0]
    );
    Ok(())
}
test_device!(gather_rank2_examples_and_u32_u8_indices);

fn index_select_and_backward_match_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(42);
    for it in 0..30 {
        let xd = rng.dims(1, 4, 5);
        let r = xd.len();
        let d = rng.below(r);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - r as isize
        };
        let k = rng.range(0, 7);
        let ids: Vec<i64> = (0..k).map(|_| rng.below(xd[d].min(3)) as i64).collect();
        let mut od = xd.clone();
        od[d] = k;
        let x = uniform_vals(8200 + it, numel(&xd), -1.0, 1.0);
        // ids as i64, or as a strided u32 view (every other element of a longer vector).
        let tids = if it % 2 == 0 {
            Tensor::from_vec(ids.clone(), k, device).unwrap()
        } else {
            // Column 1 of a [k, 2] buffer: a stride-2 view at offset 1.
            let buf: Vec<u32> = ids.iter().flat_map(|&v| [99, v as u32]).collect();
            Tensor::from_vec(buf, (k, 2), device)
                .unwrap()
                .narrow(1, 1, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
        };
        assert_eq!(tids.dims(), [k]);
        assert!(it % 2 == 0 || k < 2 || !tids.is_contiguous());
        let exp_fwd: Vec<f64> = (0..numel(&od))
            .map(|p| {
                let mut c = unravel(p, &od);
                c[d] = ids[c[d]] as usize;
                x[ravel(&c, &xd)]
            })
            .collect();
        let what = format!("index_select {xd:?} dim {named} ids {ids:?}");
        for dtype in [DType::F64, DType::F32, DType::F16] {
            let tx = strided_on(device, &x, &xd, &Lay::random(&mut rng, r), dtype);
            let out = tx.index_select(named, &tids).unwrap();
            assert_eq!(out.dtype(), dtype);
            let exp: Vec<f64> = if dtype == DType::F64 {
                exp_fwd.clone()
            } else {
                round_to(&exp_fwd, dtype)
            };
            check(&out, &od, &exp, 0.0, 0.0, &format!("{what} {dtype}"));
        }
        // Backward: index-add of a strided gradient.
        let g = uniform_vals(8300 + it, numel(&od), -1.0, 1.0);
        let mut exp = vec![0.0; numel(&xd)];
        for (p, &gv) in g.iter().enumerate() {
            let mut c = unravel(p, &od);
            c[d] = ids[c[d]] as usize;
            exp[ravel(&c, &xd)] += gv;
        }
        for dtype in [DType::F64, DType::F32] {
            let tg = strided_on(device, &g, &od, &Lay::random(&mut rng, r), dtype);
            let dx = tg
                .index_select_backward(named, &tids, xd.as_slice())
                .unwrap();
            let (rtol, atol) = if dtype == DType::F64 {
                F64_TOL
            } else {
                F32_TOL
            };
            check(
                &dx,
                &xd,
                &exp,
                rtol,
                atol,
                &format!("{what} backward {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(index_select_and_backward_match_reference);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn index_errors_name_the_index_dim_and_size() {
    let x = Tensor::zeros((3, 4), DType::F32, Device::Cpu).unwrap();
    let idx = |v: Vec<i64>, dims: &[usize]| Tensor::from_vec(v, dims, Device::Cpu).unwrap();
    // Out of range and negative, along either dim.
    let e = x
        .gather(1, &idx(vec![0, 4, 1], &[1, 3]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("index 4") && e.contains("dim 1") && e.contains("size 4"),
        "{e}"
    );
    let e = x
        .gather(-2, &idx(vec![0, -1], &[2, 1]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("index -1") && e.contains("dim 0") && e.contains("size 3"),
        "{e}"
    );
    let e = x
        .index_select(0, &idx(vec![2, 3], &[2]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("index 3") && e.contains("dim 0") && e.contains("size 3"),
        "{e}"
    );
    let e = x
        .index_select(1, &idx(vec![-5], &[1]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("-5") && e.contains("size 4"), "{e}");
    let g = Tensor::zeros((1, 3), DType::F32, Device::Cpu).unwrap();
    assert!(g
        .gather_backward(1, &idx(vec![0, 9, 1], &[1, 3]), [3, 4].as_slice())
        .is_err());
    let g = Tensor::zeros((3, 2), DType::F32, Device::Cpu).unwrap();
    assert!(g
        .index_select_backward(1, &idx(vec![0, 4], &[2]), [3, 4].as_slice())
        .is_err());
    // Shape and dtype errors name the shapes or the dtype.
    let e = x.gather(0, &idx(vec![0, 1], &[2])).unwrap_err().to_string();
    assert!(e.contains("[2]") && e.contains("[3, 4]"), "rank: {e}");
    let e = x
        .gather(0, &idx(vec![0; 10], &[2, 5]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[2, 5]") && e.contains("dim 1"),
        "non-dim size: {e}"
    );
    let f = Tensor::zeros((3, 4), DType::F32, Device::Cpu).unwrap();
    let e = x.gather(0, &f).unwrap_err().to_string();
    assert!(
        e.contains("gather") && e.contains("F32"),
        "float index: {e}"
    );
    assert!(x.index_select(0, &f).is_err(), "float ids");
    let e = x
        .index_select(0, &idx(vec![0, 1], &[1, 2]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("1-D") && e.contains("[1, 2]"), "{e}");
    assert!(
        x.gather(2, &idx(vec![0], &[1, 1])).is_err(),
        "dim out of range"
    );
    let g = Tensor::zeros((2, 2), DType::F32, Device::Cpu).unwrap();
    let e = g
        .gather_backward(0, &idx(vec![0, 1, 2], &[1, 3]), [3, 4].as_slice())
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 2]") && e.contains("[1, 3]"), "{e}");
    assert!(g
        .index_select_backward(0, &idx(vec![0, 1, 2], &[3]), [3, 4].as_slice())
        .is_err());
}

// CPU-only: about the CPU kernels' rayon thread count.
#[test]
fn backward_passes_do_not_depend_on_the_thread_count() {
    // Large enough for the parallel paths, with heavy index repetition (f32 sums whose value
    // depends on the order of additions).
    let (rows, cols) = (300, 400);
    let xd = [rows, cols];
    let mut rng = Rng::new(43);
    let gi: Vec<i64> = (0..rows * cols).map(|_| rng.below(4) as i64).collect();
    let g = uniform_vals(8400, rows * cols, -1.0, 1.0);
    let si: Vec<i64> = (0..500).map(|_| rng.below(5) as i64 * 7).collect();
    let sg = uniform_vals(8401, rows * 500, -1.0, 1.0);
    let run = || {
        let tg = tensor(&g, &xd, DType::F32);
        let mut outs = Vec::new();
        for d in [0usize, 1] {
            let ti = Tensor::from_vec(gi.clone(), xd.as_slice(), Device::Cpu).unwrap();
            outs.push(vals(
                &tg.gather_backward(d as isize, &ti, xd.as_slice()).unwrap(),
            ));
        }
        let ts = Tensor::from_vec(si.clone(), 500, Device::Cpu).unwrap();
        let tsg = tensor(&sg, &[rows, 500], DType::F32);
        outs.push(vals(
            &tsg.index_select_backward(1, &ts, xd.as_slice()).unwrap(),
        ));
        let tsg = tensor(&sg, &[500, rows], DType::F32);
        outs.push(vals(
            &tsg.index_select_backward(0, &ts, [cols, rows].as_slice())
                .unwrap(),
        ));
        outs
    };
    let many = run();
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(run);
    for (k, (a, b)) in many.iter().zip(&one).enumerate() {
        assert_eq!(a.len(), b.len());
        for (i, (p, q)) in a.iter().zip(b).enumerate() {
            assert!(
                p.to_bits() == q.to_bits(),
                "case {k} element {i}: {p} vs {q}"
            );
        }
    }
}
