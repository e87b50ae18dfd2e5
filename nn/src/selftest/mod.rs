//! The kernel self-check behind `meshgrad selftest`: is a device's arithmetic right? Every op the
//! models use ([`CASES`]), forward and backward, runs on the device under test in each dtype it
//! computes in and, from the same (rounded) inputs, on the CPU in f64 ([`check`], [`run`]); then a
//! small GPT trains on the device beside the CPU, loss for loss ([`loss_curve`]).
//!
//! Each check gives one [`CheckResult`], reported as one line,
//! `selftest: <case> <dtype> max_err=<e> tol=<t> ok|FAIL` ([`CheckResult::line`]), where
//! `max_err` is the largest absolute difference over every output and input gradient of the
//! case divided by the largest magnitude of the reference (scale-relative, so values near zero
//! do not blow it up, see [`scaled_difference`]). Every check runs even after one fails.
//!
//! On the CPU this is a precision test of the CPU kernels (f32 and bf16 against f64, and bf16
//! training against f32 training); on a GPU it is the test of the CUDA kernels against the CPU.
//! A CUDA device that is not there (no driver, or a build without the `cuda` feature) cannot be
//! tested: [`skip_reason`] says why.
//!
//! ```
//! use meshgrad_nn::selftest;
//! use meshgrad_tensor::Device;
//!
//! // The softmax checks (f32 and bf16) of the CPU kernels against f64.
//! let results = selftest::run(Device::Cpu, Some("softmax"), |r| println!("{}", r.line()));
//! assert_eq!(results.len(), 2);
//! assert!(results.iter().all(|r| r.ok()));
//! ```

mod cases;
mod loss_curve;

use meshgrad_tensor::{DType, Device, Tensor};

pub use cases::CASES;
pub use loss_curve::{loss_curve, losses, BF16_TRAINING_TOLERANCE, LOSS_CURVE_TOLERANCE};

/// Where a case runs: the device and dtype it computes in, and the dtype its float inputs are
/// rounded to (the dtype under test; the f64 reference reads the same rounded values).
#[derive(Clone, Copy, Debug)]
pub struct Env {
    /// The device the case runs on.
    pub device: Device,
    /// The dtype the case computes in.
    pub dtype: DType,
    /// The dtype float inputs are rounded to before they are cast to `dtype`.
    pub round: DType,
}

impl Env {
    /// A float tensor of standard normal values (seeded), rounded to `round`, in `dtype` on
    /// `device`.
    pub fn randn(&self, dims: &[usize], seed: u64) -> meshgrad_tensor::Result<Tensor> {
        self.scaled(dims, seed, 0.0, 1.0)
    }

    /// `mean + std * randn`, as [`Env::randn`].
    pub fn scaled(
        &self,
        dims: &[usize],
        seed: u64,
        mean: f64,
        std: f64,
    ) -> meshgrad_tensor::Result<Tensor> {
        meshgrad_tensor::Random::new(seed)
            .dtype(DType::F64)
            .normal(dims.to_vec(), mean, std)?
            .to_dtype(self.round)?
            .to_dtype(self.dtype)?
            .to_device(self.device)
    }

    /// A CPU tensor moved to `device` unchanged (integer ids, masks).
    pub fn exact(&self, t: Tensor) -> meshgrad_tensor::Result<Tensor> {
        t.to_device(self.device)
    }
}

/// The named outputs and input gradients of one run of a case.
pub type CaseOutputs = meshgrad_tensor::Result<Vec<(&'static str, Tensor)>>;

/// One check: a name, the dtypes it runs in, a tolerance per dtype, and the computation (its
/// outputs and input gradients, named).
pub struct Case {
    /// Name printed in the report.
    pub name: &'static str,
    /// Multiplies the dtype's base tolerance (for ops that sum many terms).
    pub tol_factor: f64,
    /// Whether the case runs in half dtypes (bf16).
    pub half: bool,
    /// The computation.
    pub run: fn(&Env) -> CaseOutputs,
}

/// The base tolerance of `dtype` (scale-relative error against f64).
pub fn base_tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2, // bf16: 8 significant bits
    }
}

/// The outcome of one check.
#[derive(Clone, Debug)]
pub struct CheckResult {
    /// Case and dtype, e.g. `softmax f32`.
    pub name: String,
    /// The scale-relative error (NaN when the case failed to run).
    pub max_err: f64,
    /// The tolerance.
    pub tol: f64,
    /// Why it failed to run, if it did.
    pub error: Option<String>,
}

impl CheckResult {
    /// The result of a check named `name` with tolerance `tol` whose run gave `outcome`: its
    /// largest error, or why it failed to run.
    pub fn of(name: String, tol: f64, outcome: meshgrad_tensor::Result<f64>) -> CheckResult {
        let (max_err, error) = match outcome {
            Ok(e) => (e, None),
            Err(e) => (f64::NAN, Some(e.to_string())),
        };
        CheckResult {
            name,
            max_err,
            tol,
            error,
        }
    }

    /// Whether the check passed.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.max_err <= self.tol
    }

    /// The report line.
    pub fn line(&self) -> String {
        match &self.error {
            Some(e) => format!("selftest: {} FAIL: {e}", self.name),
            None => format!(
                "selftest: {} max_err={:.3e} tol={:.1e} {}",
                self.name,
                self.max_err,
                self.tol,
                if self.ok() { "ok" } else { "FAIL" }
            ),
        }
    }
}

/// The scale-relative difference of two equally shaped tensors: `max |a - b| / max |b|`
/// (`b` the reference; absolute when `b` is all zeros). NaN anywhere gives infinity.
pub fn scaled_difference(a: &Tensor, b: &Tensor) -> meshgrad_tensor::Result<f64> {
    if a.dims() != b.dims() {
        return Err(meshgrad_tensor::Error::Msg(format!(
            "shape {:?} differs from the reference's {:?}",
            a.dims(),
            b.dims()
        )));
    }
    let a = a
        .to_device(Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec::<f64>()?;
    let b = b
        .to_device(Device::Cpu)?
        .to_dtype(DType::F64)?
        .to_vec::<f64>()?;
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
    let mut worst = 0f64;
    for (x, y) in a.iter().zip(&b) {
        let d = (x - y).abs();
        if !d.is_finite() && !(x == y) {
            return Ok(f64::INFINITY);
        }
        if d.is_finite() {
            worst = worst.max(d);
        }
    }
    Ok(if scale > 0.0 { worst / scale } else { worst })
}

/// Runs `case` on `device` in `dtype` and compares it with the CPU f64 reference.
pub fn check(case: &Case, device: Device, dtype: DType) -> CheckResult {
    let name = format!("{} {}", case.name, dtype.as_str());
    let tol = base_tolerance(dtype) * case.tol_factor;
    let outcome = (|| -> meshgrad_tensor::Result<f64> {
        let under_test = (case.run)(&Env {
            device,
            dtype,
            round: dtype,
        })?;
        let reference = (case.run)(&Env {
            device: Device::Cpu,
            dtype: DType::F64,
            round: dtype,
        })?;
        let mut worst = 0f64;
        for ((label, got), (_, want)) in under_test.iter().zip(&reference) {
            let e = scaled_difference(got, want)
                .map_err(|e| meshgrad_tensor::Error::Msg(format!("{label}: {e}")))?;
            worst = worst.max(e);
        }
        Ok(worst)
    })();
    CheckResult::of(name, tol, outcome)
}

/// Why `device` cannot be tested here, if it cannot.
pub fn skip_reason(device: Device) -> Option<String> {
    match device {
        Device::Cpu => None,
        Device::Cuda(_) => device.check_available().err().map(|e| e.to_string()),
    }
}

/// The dtypes checked on `device`: f32 and bf16 (f64 is the reference itself).
pub fn dtypes(_device: Device) -> Vec<DType> {
    vec![DType::F32, DType::BF16]
}

/// Runs every case of [`CASES`] whose name contains `filter` (all without one) on `device` in
/// each of its [`dtypes`] (a case that does not run in half precision only in f32), handing each
/// result to `each` as soon as it is known (to print its line); returns them all, in order
/// (empty when no case matches the filter).
pub fn run(
    device: Device,
    filter: Option<&str>,
    mut each: impl FnMut(&CheckResult),
) -> Vec<CheckResult> {
    let mut results = Vec::new();
    for case in CASES {
        if filter.is_some_and(|f| !case.name.contains(f)) {
            continue;
        }
        for dtype in dtypes(device) {
            if matches!(dtype, DType::BF16 | DType::F16) && !case.half {
                continue;
            }
            let r = check(case, device, dtype);
            each(&r);
            results.push(r);
        }
    }
    results
}
