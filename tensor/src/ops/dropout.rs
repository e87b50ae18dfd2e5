//! Dropout masks.

use crate::{DType, Result, Shape, Tensor};

impl Tensor {
    /// A dropout mask of `shape`: `1/(1-p)` where the counter-based uniform `(seed, start + i)`
    /// is at least `p`, else 0. Element `i` (row-major) of a shard built with its global `start`
    /// matches the same element of the whole tensor.
    pub fn dropout_mask(
        seed: u64,
        start: u64,
        p: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: crate::Device,
    ) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            crate::bail!("dropout: probability {p} must be in [0, 1)");
        }
        // Drawn and built on `device` (every backend runs the same counter-based stream).
        let u = crate::Random::new(seed)
            .offset(start)
            .device(device)
            .uniform(shape, 0.0, 1.0)?;
        let keep = u.ge(&Tensor::scalar(p, DType::F32, device)?)?;
        let scale = Tensor::scalar(1.0 / (1.0 - p), dtype, device)?;
        let zero = Tensor::scalar(0.0, dtype, device)?;
        keep.where_cond(&scale, &zero)
    }
}
