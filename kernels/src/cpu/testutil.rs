//! Helpers for the kernel tests: a tiny deterministic generator and tolerance checks.

/// xorshift64 generator for test inputs (independent of the crate's Philox RNG).
pub(crate) struct Rng(pub u64);

impl Rng {
    /// Next raw 64-bit value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform integer in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64)
    }

    /// A vector of `n` uniforms in `[lo, hi)`.
    pub fn vec(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }
}

/// Rounds every element to f32.
pub(crate) fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Widens every element to f64.
pub(crate) fn to_f64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise (equal infinities pass), naming
/// the first failure.
#[track_caller]
pub(crate) fn assert_close(what: &str, got: &[f64], want: &[f64], rtol: f64, atol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g == w || (g - w).abs() <= atol + rtol * w.abs() || (g.is_nan() && w.is_nan());
        assert!(
            ok,
            "{what}: element {i}: got {g}, want {w} (rtol {rtol}, atol {atol})"
        );
    }
}

/// `Σ a[i] b[i]` in f64.
pub(crate) fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Central difference `(f(x + h e_i) - f(x - h e_i)) / 2h` of `f` at `x` along element `i`.
pub(crate) fn central_diff(x: &[f64], i: usize, h: f64, mut f: impl FnMut(&[f64]) -> f64) -> f64 {
    let (mut xp, mut xm) = (x.to_vec(), x.to_vec());
    xp[i] += h;
    xm[i] -= h;
    (f(&xp) - f(&xm)) / (2.0 * h)
}

/// Asserts a finite difference agrees with the analytic gradient:
/// `|fd - analytic| <= 1e-6 (1 + |fd|)`, the failure reading `{what} {fd} vs {analytic}`.
#[track_caller]
pub(crate) fn assert_fd(what: &str, fd: f64, analytic: f64) {
    assert!(
        (fd - analytic).abs() <= 1e-6 * (1.0 + fd.abs()),
        "{what} {fd} vs {analytic}"
    );
}

/// f32 `(x, dy)` of `n` elements for the summation-order tests: `x` uniform in `[-1, 1)`, `dy`
/// too but for every seventh element, which is 1e4, so that the order of a sum shows in its
/// bits.
pub(crate) fn order_sensitive_inputs(rng: &mut Rng, n: usize) -> (Vec<f32>, Vec<f32>) {
    let x = to_f32(&rng.vec(n, -1.0, 1.0));
    let dy = (0..n)
        .map(|i| {
            if i % 7 == 0 {
                1e4
            } else {
                rng.uniform(-1.0, 1.0) as f32
            }
        })
        .collect();
    (x, dy)
}
