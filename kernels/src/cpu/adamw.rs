//! Optimizer updates over flat buffers.

use crate::Float;

/// Hyper-parameters of one AdamW step (`step` counts from 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// 1-based step number (for bias correction).
    pub step: u64,
}

/// AdamW as in Loshchilov & Hutter / PyTorch: `p -= lr*wd*p`; `m = b1 m + (1-b1) g`;
/// `v = b2 v + (1-b2) g²`; `p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
pub fn adamw_step<T: Float>(hp: &AdamWStep, param: &mut [T], grad: &[T], m: &mut [T], v: &mut [T]) {
    let _ = (hp, param, grad, m, v);
    todo!("adamw_step")
}

/// SGD with momentum as in PyTorch (dampening 0, not Nesterov): `g += wd * p`;
/// `buf = g` on the first step, else `buf = momentum * buf + g`; `p -= lr * buf`.
pub fn sgd_step<T: Float>(
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
    param: &mut [T],
    grad: &[T],
    buf: &mut [T],
) {
    let _ = (lr, momentum, weight_decay, first_step, param, grad, buf);
    todo!("sgd_step")
}
