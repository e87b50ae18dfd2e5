//! Dynamic loss scaling for f16 training.

use meshgrad_tensor::Result;

/// Dynamic loss scale for f16 training (the rule of PyTorch's `GradScaler` and of Micikevicius
/// et al., "Mixed Precision Training").
///
/// The loss is multiplied by [`LossScaler::scale`] `S` before the backward pass, so small
/// gradients do not flush to zero in f16; the optimizer divides the gradients by `S` in f32
/// (`AdamW::step_scaled(lr, clip_coef / S)`). When any gradient is infinite or NaN the step is
/// skipped, [`LossScaler::update`] halves `S` (never below [`LossScaler::MIN_SCALE`]); after
/// `growth_interval` consecutive good steps it doubles `S` (never above
/// [`LossScaler::MAX_SCALE`]). Powers of two keep the scaling and unscaling exact.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_interval: u64,
    good_steps: u64,
}

impl LossScaler {
    /// The usual initial scale, 2^16.
    pub const DEFAULT_INIT: f64 = 65536.0;
    /// The usual growth interval: 2000 consecutive good steps double the scale.
    pub const DEFAULT_GROWTH_INTERVAL: u64 = 2000;
    /// The smallest scale halving reaches.
    pub const MIN_SCALE: f64 = 1.0 / 65536.0;
    /// The largest scale doubling reaches (2^64, far above f16's range).
    pub const MAX_SCALE: f64 = 18446744073709551616.0;

    /// A scaler starting at `init` (finite, > 0) that doubles after `growth_interval` (>= 1)
    /// consecutive good steps.
    pub fn new(init: f64, growth_interval: u64) -> Result<Self> {
        if !init.is_finite() || init <= 0.0 {
            meshgrad_tensor::bail!("loss scale: initial scale {init} must be finite and > 0");
        }
        if growth_interval == 0 {
            meshgrad_tensor::bail!("loss scale: growth interval must be at least 1");
        }
        Ok(LossScaler {
            scale: init,
            growth_interval,
            good_steps: 0,
        })
    }

    /// A scaler continuing from a saved state (a resumed run): scale `scale` (finite, within
    /// [`LossScaler::MIN_SCALE`]..=[`LossScaler::MAX_SCALE`]) after `good_steps` (below
    /// `growth_interval`) consecutive good steps.
    pub fn restore(scale: f64, growth_interval: u64, good_steps: u64) -> Result<Self> {
        let mut s = LossScaler::new(scale, growth_interval)?;
        if !(Self::MIN_SCALE..=Self::MAX_SCALE).contains(&scale) {
            meshgrad_tensor::bail!(
                "loss scale: saved scale {scale} is outside {}..={}",
                Self::MIN_SCALE,
                Self::MAX_SCALE
            );
        }
        if good_steps >= growth_interval {
            meshgrad_tensor::bail!(
                "loss scale: {good_steps} saved good steps reach the growth interval \
                 {growth_interval}"
            );
        }
        s.good_steps = good_steps;
        Ok(s)
    }

    /// The current scale `S`.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Consecutive good steps that double the scale.
    pub fn growth_interval(&self) -> u64 {
        self.growth_interval
    }

    /// Consecutive good steps since the last change of the scale.
    pub fn good_steps(&self) -> u64 {
        self.good_steps
    }

    /// Records a step: `finite` says whether every gradient was finite (the step was taken).
    /// A non-finite step halves the scale and restarts the count; the `growth_interval`-th
    /// consecutive good step doubles it. Returns the new scale.
    pub fn update(&mut self, finite: bool) -> f64 {
        if finite {
            self.good_steps += 1;
            if self.good_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(Self::MAX_SCALE);
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale * 0.5).max(Self::MIN_SCALE);
            self.good_steps = 0;
        }
        self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_scaler_continues_where_it_was() {
        let mut a = LossScaler::new(1024.0, 3).unwrap();
        a.update(true);
        let mut b = LossScaler::restore(a.scale(), 3, a.good_steps()).unwrap();
        for finite in [true, true, false, true] {
            assert_eq!(a.update(finite), b.update(finite));
            assert_eq!(a, b);
        }
        assert!(LossScaler::restore(1024.0, 3, 3).is_err());
        assert!(LossScaler::restore(f64::NAN, 3, 0).is_err());
        assert!(LossScaler::restore(1e-30, 3, 0).is_err());
    }

    #[test]
    fn halves_on_overflow_and_doubles_after_the_interval() {
        let mut s = LossScaler::new(8.0, 3).unwrap();
        assert_eq!(s.update(false), 4.0);
        assert_eq!(s.update(true), 4.0);
        assert_eq!(s.update(true), 4.0);
        assert_eq!(s.good_steps(), 2);
        assert_eq!(s.update(true), 8.0);
        assert_eq!(s.good_steps(), 0);
        // An overflow restarts the count.
        s.update(true);
        s.update(false);
        assert_eq!((s.scale(), s.good_steps()), (4.0, 0));
        assert!(LossScaler::new(0.0, 1).is_err());
        assert!(LossScaler::new(f64::INFINITY, 1).is_err());
        assert!(LossScaler::new(1.0, 0).is_err());
        let mut tiny = LossScaler::new(LossScaler::MIN_SCALE, 1).unwrap();
        assert_eq!(tiny.update(false), LossScaler::MIN_SCALE);
    }
}
