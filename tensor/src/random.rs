//! Random tensors from the counter-based generator (Philox4x32-10, see
//! [`meshgrad_kernels::rng`]): element `i` (row-major) of a draw with offset `o` takes the value
//! keyed by `(seed, o + i)`. Nothing depends on how a tensor is split: a shard drawn with its
//! global offset equals the same slice of the whole tensor, which is what keeps initial weights
//! and dropout masks independent of the parallel layout.
//!
//! The short forms [`Tensor::randn`], [`Tensor::rand`] and [`Tensor::randint`] cover the common
//! cases (offset 0, f32 or i64, CPU); [`Random`] gives full control.
//!
//! ```
//! use meshgrad_tensor::{DType, Random, Tensor};
//! let x = Tensor::randn((2, 3), 42)?; // standard normal, f32, CPU
//! assert_eq!((x.dims(), x.dtype()), (&[2, 3][..], DType::F32));
//!
//! // The second row on its own, drawn with its global offset, equals row 1 of the whole draw.
//! let row = Random::new(42).offset(3).normal(3, 0.0, 1.0)?;
//! assert_eq!(row.to_vec::<f32>()?, x.narrow(0, 1, 1)?.to_vec::<f32>()?);
//!
//! let ids = Tensor::randint(8, 0, 100, 7)?; // i64 in [0, 100)
//! assert!(ids.to_vec::<i64>()?.iter().all(|v| (0..100).contains(v)));
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

use meshgrad_kernels::rng;

use crate::{DType, Device, Result, Shape, Tensor};

/// A builder for counter-based random tensors: seed, offset into the stream, dtype and device,
/// then one of [`Random::normal`], [`Random::uniform`] or [`Random::randint`].
///
/// Defaults: offset 0, CPU, f32 for [`Random::normal`] and [`Random::uniform`], i64 for
/// [`Random::randint`]. The same `(seed, offset, parameters, dtype)` always gives the same bits.
///
/// ```
/// use meshgrad_tensor::{DType, Device, Random};
/// let w = Random::new(7)
///     .offset(1024)
///     .dtype(DType::BF16)
///     .device(Device::Cpu)
///     .normal((4, 8), 0.0, 0.02)?;
/// assert_eq!(w.dtype(), DType::BF16);
/// let u = Random::new(7).dtype(DType::F64).uniform(5, -1.0, 1.0)?;
/// assert!(u.to_vec::<f64>()?.iter().all(|v| (-1.0..1.0).contains(v)));
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Random {
    seed: u64,
    offset: u64,
    dtype: Option<DType>,
    device: Device,
}

impl Random {
    /// A draw from stream `seed`, at offset 0, on the CPU, in the default dtype.
    pub fn new(seed: u64) -> Random {
        Random {
            seed,
            offset: 0,
            dtype: None,
            device: Device::Cpu,
        }
    }

    /// Starts at counter `offset`: element `i` takes the value of counter `offset + i`, so a
    /// shard drawn with its global offset equals that slice of the whole draw.
    pub fn offset(self, offset: u64) -> Random {
        Random { offset, ..self }
    }

    /// The dtype of the result (default f32 for normal and uniform draws, i64 for randint).
    pub fn dtype(self, dtype: DType) -> Random {
        Random {
            dtype: Some(dtype),
            ..self
        }
    }

    /// The device of the result (default CPU).
    pub fn device(self, device: Device) -> Random {
        Random { device, ..self }
    }

    fn float_dtype(&self, op: &'static str) -> Result<DType> {
        let dtype = self.dtype.unwrap_or(DType::F32);
        if !dtype.is_float() {
            return Err(crate::Error::UnsupportedDType { op, dtype });
        }
        Ok(dtype)
    }

    /// Normal values with the given mean and standard deviation: `mean + std * n(seed, offset + i)`
    /// computed in f64 and rounded to the dtype.
    pub fn normal(&self, shape: impl Into<Shape>, mean: f64, std: f64) -> Result<Tensor> {
        let shape = shape.into();
        let dtype = self.float_dtype("normal")?;
        if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
            crate::bail!(
                "normal: mean {mean} and std {std} must be finite with std >= 0 (shape {shape})"
            );
        }
        let n = shape.elem_count();
        let t = if dtype == DType::F32 {
            // f64 -> f32 rounding in the fill is the same as filling f64 and casting.
            let mut v = vec![0f32; n];
            rng::fill_normal(self.seed, self.offset, mean, std, &mut v);
            Tensor::from_vec(v, shape, Device::Cpu)?
        } else {
            let mut v = vec![0f64; n];
            rng::fill_normal(self.seed, self.offset, mean, std, &mut v);
            Tensor::from_vec(v, shape, Device::Cpu)?.to_dtype(dtype)?
        };
        t.to_device(self.device)
    }

    /// Uniform values in `[low, high)`: `low + (high - low) * u(seed, offset + i)` computed in f64
    /// and rounded to the dtype (so after rounding a value can equal `high`).
    pub fn uniform(&self, shape: impl Into<Shape>, low: f64, high: f64) -> Result<Tensor> {
        let shape = shape.into();
        let dtype = self.float_dtype("uniform")?;
        if !(low.is_finite() && high.is_finite() && low <= high) {
            crate::bail!(
                "uniform: bounds [{low}, {high}) must be finite with low <= high (shape {shape})"
            );
        }
        let n = shape.elem_count();
        let t = if dtype == DType::F32 {
            let mut v = vec![0f32; n];
            rng::fill_uniform(self.seed, self.offset, low, high, &mut v);
            Tensor::from_vec(v, shape, Device::Cpu)?
        } else {
            let mut v = vec![0f64; n];
            rng::fill_uniform(self.seed, self.offset, low, high, &mut v);
            Tensor::from_vec(v, shape, Device::Cpu)?.to_dtype(dtype)?
        };
        t.to_device(self.device)
    }

    /// Integers uniform in `[low, high)` (see [`meshgrad_kernels::rng::below`]), i64 unless a
    /// dtype was set; every value of the range must be exact in that dtype (for example
    /// `0 <= low` and `high <= 256` for u8, `|v| <= 2^24` for f32).
    pub fn randint(&self, shape: impl Into<Shape>, low: i64, high: i64) -> Result<Tensor> {
        let shape = shape.into();
        let dtype = self.dtype.unwrap_or(DType::I64);
        if high <= low {
            crate::bail!("randint: empty range [{low}, {high}) (shape {shape})");
        }
        // The closed range of integers the dtype holds exactly.
        let (min, max): (i128, i128) = match dtype {
            DType::I64 => (i64::MIN.into(), i64::MAX.into()),
            DType::U32 => (0, u32::MAX.into()),
            DType::U8 => (0, u8::MAX.into()),
            DType::F64 => (-(1 << 53), 1 << 53),
            DType::F32 => (-(1 << 24), 1 << 24),
            DType::F16 => (-(1 << 11), 1 << 11),
            DType::BF16 => (-(1 << 8), 1 << 8),
        };
        if i128::from(low) < min || i128::from(high) - 1 > max {
            crate::bail!(
                "randint: range [{low}, {high}) does not fit {dtype} exactly (integers {min}..={max}; shape {shape})"
            );
        }
        let mut v = vec![0i64; shape.elem_count()];
        rng::fill_randint(self.seed, self.offset, low, high, &mut v);
        Tensor::from_vec(v, shape, Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(self.device)
    }
}

impl Tensor {
    /// Standard normal f32 values on the CPU from stream `seed` (offset 0); see [`Random`] for
    /// the mean and std, offset, dtype and device.
    ///
    /// ```
    /// let x = meshgrad_tensor::Tensor::randn((2, 3), 0)?;
    /// assert_eq!(x.elem_count(), 6);
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn randn(shape: impl Into<Shape>, seed: u64) -> Result<Tensor> {
        Random::new(seed).normal(shape, 0.0, 1.0)
    }

    /// Uniform f32 values in `[0, 1)` on the CPU from stream `seed` (offset 0); see [`Random`]
    /// for other bounds, the offset, dtype and device.
    ///
    /// ```
    /// let u = meshgrad_tensor::Tensor::rand(4, 0)?;
    /// assert!(u.to_vec::<f32>()?.iter().all(|v| (0.0..1.0).contains(v)));
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn rand(shape: impl Into<Shape>, seed: u64) -> Result<Tensor> {
        Random::new(seed).uniform(shape, 0.0, 1.0)
    }

    /// i64 values uniform in `[low, high)` on the CPU from stream `seed` (offset 0); see
    /// [`Random::randint`] for the offset, other dtypes and the device.
    ///
    /// ```
    /// let ids = meshgrad_tensor::Tensor::randint((2, 5), 0, 10, 3)?;
    /// assert!(ids.to_vec::<i64>()?.iter().all(|v| (0..10).contains(v)));
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn randint(shape: impl Into<Shape>, low: i64, high: i64, seed: u64) -> Result<Tensor> {
        Random::new(seed).randint(shape, low, high)
    }
}
