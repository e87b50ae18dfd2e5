//! Softmax and log-softmax over the last dimension of a contiguous `[rows, cols]` buffer.

use crate::Float;

/// `y[r] = softmax(x[r])`, max-subtracted for stability.
pub fn softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    let _ = (x, rows, cols, y);
    todo!("softmax_forward")
}

/// `y[r] = log_softmax(x[r]) = x[r] - logsumexp(x[r])`.
pub fn log_softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    let _ = (x, rows, cols, y);
    todo!("log_softmax_forward")
}

/// Given `y = softmax(x)` and `dy`: `dx = y * (dy - sum(dy * y))` row-wise.
pub fn softmax_backward<T: Float>(y: &[T], dy: &[T], rows: usize, cols: usize, dx: &mut [T]) {
    let _ = (y, dy, rows, cols, dx);
    todo!("softmax_backward")
}

/// Given `y = log_softmax(x)` and `dy`: `dx = dy - exp(y) * sum(dy)` row-wise.
pub fn log_softmax_backward<T: Float>(y: &[T], dy: &[T], rows: usize, cols: usize, dx: &mut [T]) {
    let _ = (y, dy, rows, cols, dx);
    todo!("log_softmax_backward")
}
