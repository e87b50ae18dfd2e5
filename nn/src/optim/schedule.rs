//! Learning-rate schedules.

use meshgrad_tensor::Result;

/// Linear warm-up, then cosine decay to a floor (the nanoGPT schedule).
///
/// With `W = warmup_steps`, `N = total_steps` and `step` counted from 0:
///
/// ```text
/// step <  W:        lr = max_lr * (step + 1) / W
/// W <= step <= N:   r  = (step - W) / (N - W);  lr = min_lr + 0.5 * (1 + cos(pi * r)) * (max_lr - min_lr)
/// step >  N:        lr = min_lr
/// ```
///
/// So the warm-up reaches `max_lr` at step `W - 1` (and at step `W`, the start of the decay), the
/// decay reaches `min_lr` exactly at step `N`, and the rate stays `min_lr` afterwards. When
/// `W == N` there is no decay phase: `lr = min_lr` from step `W` on. A constant rate is
/// `min_lr == max_lr`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineSchedule {
    /// Peak learning rate (end of warm-up).
    pub max_lr: f64,
    /// Floor reached at `total_steps`.
    pub min_lr: f64,
    /// Warm-up length in steps (0: start at `max_lr`).
    pub warmup_steps: usize,
    /// Step at which the decay reaches `min_lr`.
    pub total_steps: usize,
}

impl CosineSchedule {
    /// A validated schedule: `0 <= min_lr <= max_lr` (finite) and `warmup_steps <= total_steps`.
    pub fn new(max_lr: f64, min_lr: f64, warmup_steps: usize, total_steps: usize) -> Result<Self> {
        let s = CosineSchedule {
            max_lr,
            min_lr,
            warmup_steps,
            total_steps,
        };
        s.validate()?;
        Ok(s)
    }

    /// Checks the fields (see [`CosineSchedule::new`]).
    pub fn validate(&self) -> Result<()> {
        if !self.max_lr.is_finite()
            || !self.min_lr.is_finite()
            || self.min_lr < 0.0
            || self.min_lr > self.max_lr
        {
            meshgrad_tensor::bail!(
                "cosine schedule: need 0 <= min_lr <= max_lr (finite), got min_lr {} and max_lr {}",
                self.min_lr,
                self.max_lr
            );
        }
        if self.warmup_steps > self.total_steps {
            meshgrad_tensor::bail!(
                "cosine schedule: warmup_steps {} exceeds total_steps {}",
                self.warmup_steps,
                self.total_steps
            );
        }
        Ok(())
    }

    /// The learning rate for (0-based) `step`.
    pub fn lr_at(&self, step: usize) -> f64 {
        let (w, n) = (self.warmup_steps, self.total_steps);
        if step < w {
            return self.max_lr * (step + 1) as f64 / w as f64;
        }
        if step >= n {
            // Covers step == n (where the cosine gives exactly min_lr) and the W == N case.
            return self.min_lr;
        }
        let r = (step - w) as f64 / (n - w) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * r).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}
