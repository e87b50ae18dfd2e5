//! Tests of the cuBLASLt path that need a GPU: results against a host product, and the plan
//! cache (a repeated shape builds no new plan; a new pointer alignment or epilogue does). Without a CUDA
//! device they print why and pass, unless `MESHGRAD_REQUIRE_CUDA=1`, in which case they fail.

use meshgrad_kernels::ops::MatrixLayout;

use super::ops::{linear, linear_gelu, matmul};
use super::state::with_blaslt;
use crate::backend::Product;
use crate::cuda_backend::{basic, cuda_device_count, CudaStorage};
use crate::storage::CpuStorage;
use crate::{Device, Layout, Result};

/// Device 0, or `None` (after saying why) when there is none and none is required.
fn device() -> Option<Device> {
    if cuda_device_count() > 0 {
        return Some(Device::Cuda(0));
    }
    if std::env::var("MESHGRAD_REQUIRE_CUDA").as_deref() == Ok("1") {
        panic!("MESHGRAD_REQUIRE_CUDA=1 but no CUDA device is visible");
    }
    eprintln!("skipped: no CUDA device (set MESHGRAD_REQUIRE_CUDA=1 to fail instead)");
    None
}

fn upload(device: Device, v: Vec<f32>) -> Result<CudaStorage> {
    basic::from_host(device, CpuStorage::F32(v))
}

fn download(s: &CudaStorage) -> Result<Vec<f32>> {
    match basic::to_host(s, &Layout::contiguous(s.len()))? {
        CpuStorage::F32(v) => Ok(v),
        other => panic!("expected f32, got {:?}", other.dtype()),
    }
}

fn row_major(offset: usize, rows: usize, cols: usize) -> MatrixLayout {
    MatrixLayout {
        offset,
        batch_stride: rows * cols,
        row_stride: cols,
        col_stride: 1,
    }
}

/// `[m, k] · [k, n]` on the host, each operand read through its layout (batch 1).
fn host_product(
    a: &[f32],
    al: &MatrixLayout,
    b: &[f32],
    bl: &MatrixLayout,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|l| {
                    a[al.offset + i * al.row_stride + l * al.col_stride]
                        * b[bl.offset + l * bl.row_stride + j * bl.col_stride]
                })
                .sum();
        }
    }
    out
}

fn plans(device: Device) -> Result<usize> {
    let Device::Cuda(n) = device else {
        unreachable!("a CUDA device")
    };
    let ctx = crate::cuda_backend::context(n)?;
    with_blaslt(&ctx, |lt| Ok(lt.cached_plans()))
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-4 + 1e-5 * w.abs(),
            "{what}: [{i}] {g} vs {w}"
        );
    }
}

/// One (unbatched) product of `[m, k]` read through `al` and `[k, n]` read through `bl`.
fn one(al: MatrixLayout, bl: MatrixLayout, m: usize, n: usize, k: usize) -> Product {
    Product {
        al,
        bl,
        batch: 1,
        m,
        n,
        k,
    }
}

#[test]
fn products_match_the_host_and_plans_are_cached() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let (m, n, k) = (6, 5, 8); // rows of 32 bytes: one element further is 4-byte aligned
    let a: Vec<f32> = (0..m * k + 1).map(|i| (i % 7) as f32 - 3.0).collect();
    let b: Vec<f32> = (0..k * n + 1).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
    let (ga, gb) = (upload(device, a.clone())?, upload(device, b.clone())?);
    let (al, bl) = (row_major(0, m, k), row_major(0, k, n));
    let want = host_product(&a, &al, &b, &bl, m, n, k);

    let before = plans(device)?;
    let c = matmul(&ga, &gb, &one(al, bl, m, n, k))?;
    assert_close(&download(&c)?, &want, "first call");
    let after_first = plans(device)?;
    assert_eq!(after_first, before + 1, "one plan for a new shape");
    let c = matmul(&ga, &gb, &one(al, bl, m, n, k))?;
    assert_close(&download(&c)?, &want, "second call");
    assert_eq!(
        plans(device)?,
        after_first,
        "the second call reuses the plan"
    );

    // One element further: a 4-byte aligned pointer is another key.
    let al1 = row_major(1, m, k);
    let want1 = host_product(&a, &al1, &b, &bl, m, n, k);
    let c = matmul(&ga, &gb, &one(al1, bl, m, n, k))?;
    assert_close(&download(&c)?, &want1, "offset lhs");
    assert_eq!(
        plans(device)?,
        after_first + 1,
        "a new alignment, a new plan"
    );

    // The bias epilogue: Wᵀ read through the strides of a row-major w [n, k].
    let wl = MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: 1,
        col_stride: k,
    };
    let w: Vec<f32> = b[..n * k].to_vec();
    let bias: Vec<f32> = (0..n).map(|j| j as f32 + 0.25).collect();
    let gw = upload(device, w.clone())?;
    let gbias = upload(device, bias.clone())?;
    let y = linear(
        &ga,
        &gw,
        Some((&gbias, &Layout::contiguous(n))),
        &one(al, wl, m, n, k),
    )?
    .expect("the bias epilogue exists for f32");
    let mut want = host_product(&a, &al, &w, &wl, m, n, k);
    for (i, v) in want.iter_mut().enumerate() {
        *v += bias[i % n];
    }
    assert_close(&download(&y)?, &want, "linear with bias");
    Ok(())
}

/// GELU, tanh approximation, on the host.
fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0 / std::f64::consts::PI).sqrt() as f32;
    0.5 * x * (1.0 + (c * (x + 0.044_715 * x * x * x)).tanh())
}

#[test]
fn the_gelu_epilogue_writes_activation_and_pre_activation() -> Result<()> {
    let Some(device) = device() else {
        return Ok(());
    };
    let (m, n, k) = (6, 16, 7);
    let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.25 - 0.75).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.2 - 0.4).collect();
    let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.1 - 0.8).collect();
    let (gx, gw, gbias) = (
        upload(device, x.clone())?,
        upload(device, w.clone())?,
        upload(device, bias.clone())?,
    );
    let xl = row_major(0, m, k);
    let wl = MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: 1,
        col_stride: k,
    };
    let product = host_product(&x, &xl, &w, &wl, m, n, k);
    let p = one(xl, wl, m, n, k);
    let bias_in = (&gbias, &Layout::contiguous(n));
    for with_bias in [true, false] {
        let b = with_bias.then_some(bias_in);
        let before = plans(device)?;
        let (y, pre) =
            linear_gelu(&gx, &gw, b, &p, true)?.expect("the GELU epilogue exists for f32");
        assert_eq!(plans(device)?, before + 1, "a new epilogue, a new plan");
        let want_pre: Vec<f32> = product
            .iter()
            .enumerate()
            .map(|(i, v)| v + if with_bias { bias[i % n] } else { 0.0 })
            .collect();
        let want: Vec<f32> = want_pre.iter().map(|&v| gelu_tanh(v)).collect();
        assert_close(&download(&pre)?, &want_pre, "pre-activation");
        assert_close(&download(&y)?, &want, "activation");
        let _ = linear_gelu(&gx, &gw, b, &p, true)?;
        assert_eq!(
            plans(device)?,
            before + 1,
            "the second call reuses the plan"
        );
    }
    // The erf form, and a width that is not a multiple of 8: composed by the tensor layer.
    assert!(linear_gelu(&gx, &gw, Some(bias_in), &p, false)?.is_none());
    assert!(linear_gelu(&gx, &gw, None, &one(xl, wl, m, n - 1, k), true)?.is_none());
    Ok(())
}
