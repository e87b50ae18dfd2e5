//! `matmul` and `linear` on every test device against the CPU result of the same inputs: f32
//! (full f32 accumulation, so a tight tolerance), f64, bf16 and f16; contiguous, transposed,
//! offset (misaligned) and broadcast operands, a stride-0 inner dimension (copied before
//! cuBLASLt), odd and unit sizes, the bias epilogue of `linear` and the GELU epilogue of
//! `linear_gelu`. On the CPU the comparison is with itself (the test exists to run the CUDA backend's cuBLASLt path on a GPU).

use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

/// A `[dims]` tensor of standard normal values in `dtype` on `device` (drawn and converted on
/// the CPU, so every device gets the same values).
fn input(dims: &[usize], seed: u64, dtype: DType, device: Device) -> Result<Tensor> {
    Tensor::randn(dims.to_vec(), seed)?
        .to_dtype(dtype)?
        .to_device(device)
}

/// Absolute and relative tolerances of a device result against the CPU's, by dtype.
fn tolerance(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-10, 1e-10),
        DType::F32 => (1e-4, 1e-5),
        // Both accumulate in f32 and round once to 8 (bf16) or 11 (f16) bits: one ulp apart.
        DType::BF16 => (2e-2, 1e-2),
        _ => (4e-3, 2e-3),
    }
}

/// Checks `got` (on any device) against `want` (on the CPU).
fn close(got: &Tensor, want: &Tensor, what: &str) -> Result<()> {
    close_within(got, want, what, 1.0)
}

/// [`close`] with the dtype's tolerances multiplied by `factor`.
fn close_within(got: &Tensor, want: &Tensor, what: &str, factor: f64) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let g = got
        .to_device(Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec::<f64>()?;
    let w = want.to_dtype(DType::F64)?.to_vec::<f64>()?;
    let (atol, rtol) = tolerance(want.dtype());
    let (atol, rtol) = (atol * factor, rtol * factor);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= atol + rtol * b.abs(),
            "{what}: element {i} is {a}, the CPU gives {b}"
        );
    }
    Ok(())
}

type View = fn(&Tensor) -> Result<Tensor>;

fn same(t: &Tensor) -> Result<Tensor> {
    Ok(t.clone())
}
fn transposed(t: &Tensor) -> Result<Tensor> {
    t.transpose(-1, -2)
}
/// Drops the first column: every row starts one element later (a misaligned pointer).
fn offset_by_one(t: &Tensor) -> Result<Tensor> {
    let last = *t.dims().last().unwrap();
    t.narrow(-1, 1, last - 1)
}
/// [`offset_by_one`], then transposed.
fn offset_then_transposed(t: &Tensor) -> Result<Tensor> {
    offset_by_one(t)?.transpose(-1, -2)
}
/// Broadcasts the one column of a `[.., r, 1]` tensor to 7 columns (stride 0: copied).
fn expand_to_7(t: &Tensor) -> Result<Tensor> {
    let mut dims = t.dims().to_vec();
    *dims.last_mut().unwrap() = 7;
    t.expand(dims)
}

/// Stored dims and view of each operand; the view gives the logical operand.
type Case = (&'static [usize], View, &'static [usize], View);

const CASES: &[Case] = &[
    // Plain and batched.
    (&[5, 7], same, &[7, 4], same),
    (&[2, 3, 5, 7], same, &[2, 3, 7, 4], same),
    // Transposed operands (column-major views), one or both.
    (&[7, 5], transposed, &[7, 4], same),
    (&[5, 7], same, &[4, 7], transposed),
    (&[3, 7, 5], transposed, &[3, 4, 7], transposed),
    // A shared rhs (folded into one tall matrix) and a shared lhs (batch stride 0).
    (&[3, 5, 7], same, &[7, 4], same),
    (&[5, 7], same, &[3, 7, 4], same),
    (&[1, 5, 7], same, &[4, 4, 7], transposed),
    // Offsets that break 16-byte alignment.
    (&[5, 8], offset_by_one, &[7, 5], offset_by_one),
    (
        &[2, 5, 8],
        offset_by_one,
        &[2, 4, 8],
        offset_then_transposed,
    ),
    // A broadcast (stride-0) column: copied before cuBLASLt.
    (&[5, 1], expand_to_7, &[7, 4], same),
    // Unit and odd sizes.
    (&[1, 1], same, &[1, 1], same),
    (&[1, 9], same, &[9, 1], same),
    (&[6, 1], same, &[1, 3], same),
    (&[129, 257], same, &[257, 65], same),
    (&[4, 33, 16], same, &[4, 24, 16], transposed),
];

fn matmul_matches_the_cpu(device: Device) -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        for (i, &(ad, av, bd, bv)) in CASES.iter().enumerate() {
            let seed = 100 * i as u64;
            let a = input(ad, seed, dtype, device)?;
            let b = input(bd, seed + 1, dtype, device)?;
            let a_cpu = a.to_device(Device::Cpu)?;
            let b_cpu = b.to_device(Device::Cpu)?;
            let got = av(&a)?.matmul(&bv(&b)?)?;
            assert_eq!(got.device(), device);
            assert_eq!(got.dtype(), dtype);
            let want = av(&a_cpu)?.matmul(&bv(&b_cpu)?)?;
            close(&got, &want, &format!("{dtype:?} case {i}: {ad:?} x {bd:?}"))?;
        }
    }
    Ok(())
}
test_device!(matmul_matches_the_cpu);

fn linear_matches_the_cpu(device: Device) -> Result<()> {
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let x = input(&[2, 3, 33], 1, dtype, device)?;
        let w = input(&[17, 33], 2, dtype, device)?;
        let w_t = input(&[33, 17], 3, dtype, device)?;
        let bias = input(&[18], 4, dtype, device)?;
        let cpu = |t: &Tensor| t.to_device(Device::Cpu);
        // Aligned bias, misaligned bias (offset 1: copied to an aligned buffer), no bias, and a
        // weight stored transposed.
        let aligned = bias.narrow(0, 0, 17)?;
        let shifted = bias.narrow(0, 1, 17)?;
        for (what, w, b) in [
            ("bias", &w, Some(&aligned)),
            ("offset bias", &w, Some(&shifted)),
            ("no bias", &w, None),
        ] {
            let got = x.linear(w, b)?;
            let b_cpu = b.map(cpu).transpose()?;
            let want = cpu(&x)?.linear(&cpu(w)?, b_cpu.as_ref())?;
            close(&got, &want, &format!("{dtype:?} linear, {what}"))?;
        }
        let wt = w_t.t()?;
        let got = x.linear(&wt, Some(&aligned))?;
        let want = cpu(&x)?.linear(&cpu(&wt)?, Some(&cpu(&aligned)?))?;
        close(&got, &want, &format!("{dtype:?} linear, transposed weight"))?;
    }
    Ok(())
}
test_device!(linear_matches_the_cpu);

/// The bits of a float tensor (converted to f64, which is exact from every float dtype).
fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_device(Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec::<f64>()?
        .into_iter()
        .map(f64::to_bits)
        .collect())
}

/// `linear_gelu` against `linear` then `gelu` on the CPU: both outputs (the activation and the
/// pre-activation) within the dtype's tolerance on a device (on CUDA, cuBLASLt's GELU epilogue
/// for the tanh form when the output width is a multiple of 8, the composition otherwise), and
/// bit for bit on the CPU (which composes them). Widths 16 (fused on CUDA) and 17 (composed),
/// with and without a bias, a misaligned bias, a weight stored transposed, both GELU kinds.
fn linear_gelu_matches_linear_then_gelu(device: Device) -> Result<()> {
    use meshgrad_tensor::GeluKind;
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let x = input(&[2, 5, 24], 11, dtype, device)?;
        let bias = input(&[18], 14, dtype, device)?;
        let cpu = |t: &Tensor| t.to_device(Device::Cpu);
        for n in [16, 17] {
            let w = input(&[n, 24], 12, dtype, device)?;
            let wt = input(&[24, n], 13, dtype, device)?.t()?;
            let aligned = bias.narrow(0, 0, n)?;
            let shifted = bias.narrow(0, 1, n)?;
            for kind in [GeluKind::Tanh, GeluKind::Erf] {
                for (what, w, b) in [
                    ("bias", &w, Some(&aligned)),
                    ("offset bias", &w, Some(&shifted)),
                    ("no bias", &w, None),
                    ("transposed weight", &wt, Some(&aligned)),
                ] {
                    let what = format!("{dtype:?} linear_gelu {kind:?} n={n}, {what}");
                    let (y, pre) = x.linear_gelu(w, b, kind)?;
                    assert_eq!((y.device(), y.dtype()), (device, dtype), "{what}");
                    assert_eq!(y.dims(), [2, 5, n], "{what}");
                    let b_cpu = b.map(cpu).transpose()?;
                    let want_pre = cpu(&x)?.linear(&cpu(w)?, b_cpu.as_ref())?;
                    let want = want_pre.gelu(kind)?;
                    if device == Device::Cpu {
                        assert_eq!(bits(&pre)?, bits(&want_pre)?, "{what}: pre-activation");
                        assert_eq!(bits(&y)?, bits(&want)?, "{what}: activation");
                    } else {
                        close(&pre, &want_pre, &format!("{what}: pre-activation"))?;
                        // The fused GELU reads the f32 accumulator, the CPU's the rounded
                        // pre-activation: allow for that rounding too.
                        close_within(&y, &want, &format!("{what}: activation"), 2.0)?;
                    }
                }
            }
        }
    }
    Ok(())
}
test_device!(linear_gelu_matches_linear_then_gelu);

/// After one step's shapes have been seen, repeating them allocates nothing from the driver
/// (output buffers come back from the cache, cuBLASLt plans are cached).
fn repeated_products_allocate_nothing_new(device: Device) -> Result<()> {
    if device == Device::Cpu {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        let x = input(&[64, 96], 1, DType::BF16, device)?;
        let w = input(&[80, 96], 2, DType::BF16, device)?;
        let bias = input(&[80], 3, DType::BF16, device)?;
        let step = || -> Result<()> {
            let y = x.linear(&w, Some(&bias))?;
            let _g = y.t()?.matmul(&x)?;
            Ok(())
        };
        step()?;
        step()?;
        let before = meshgrad_tensor::cuda_memory_stats(device)?.driver_allocations;
        for _ in 0..5 {
            step()?;
        }
        let after = meshgrad_tensor::cuda_memory_stats(device)?.driver_allocations;
        assert_eq!(before, after, "driver allocations after warm-up");
    }
    Ok(())
}
test_device!(repeated_products_allocate_nothing_new);
