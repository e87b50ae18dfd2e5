//! Counter-based random numbers (Philox4x32-10): every value is a pure function of
//! `(seed, global element index)`, so it never depends on how a tensor is sharded or on the order
//! in which elements are generated.

use crate::Float;

/// The Philox4x32 block function with 10 rounds (Salmon et al., SC'11).
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let _ = (counter, key);
    todo!("philox4x32_10")
}

/// The uniform value in `[0, 1)` of element `index` in stream `seed` (24 random mantissa bits).
pub fn uniform(seed: u64, index: u64) -> f32 {
    let _ = (seed, index);
    todo!("uniform")
}

/// `out[i] = low + (high - low) * u(seed, start + i)`.
pub fn fill_uniform<T: Float>(seed: u64, start: u64, low: f64, high: f64, out: &mut [T]) {
    let _ = (seed, start, low, high, out);
    todo!("fill_uniform")
}

/// `out[i] = mean + std * n(seed, start + i)`, with `n` a standard normal from Box-Muller over
/// the Philox block of counter `start + i`.
pub fn fill_normal<T: Float>(seed: u64, start: u64, mean: f64, std: f64, out: &mut [T]) {
    let _ = (seed, start, mean, std, out);
    todo!("fill_normal")
}
