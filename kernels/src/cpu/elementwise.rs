//! Elementwise kernels: unary maps, broadcasting binary ops, comparisons, `where`.

use rayon::prelude::*;

use super::fastmath;
use super::strided::{map_strided, par_chunk_len, PAR_THRESHOLD};
use super::vecops::simd;
use crate::ops::{BinaryOp, CmpOp, UnaryOp};
use crate::Float;

/// sqrt(2 / pi)
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh GELU.
const GELU_CUBIC: f64 = 0.044_715;
/// 1 / sqrt(2)
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
/// 1 / sqrt(2 pi)
const FRAC_1_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// `out[i] = f(x[i])`, in parallel chunks when large.
#[inline]
fn map1<T: Float>(x: &[T], out: &mut [T], f: impl Fn(T) -> T + Sync) {
    assert_eq!(
        x.len(),
        out.len(),
        "unary: input has {} elements, output {}",
        x.len(),
        out.len()
    );
    let serial = |x: &[T], out: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for (o, &v) in out.iter_mut().zip(x) {
                    *o = f(v);
                }
            },
        )
    };
    if x.len() < PAR_THRESHOLD {
        serial(x, out);
    } else {
        let cl = par_chunk_len(x.len(), 64);
        out.par_chunks_mut(cl)
            .zip(x.par_chunks(cl))
            .for_each(|(o, x)| serial(x, o));
    }
}

/// `acc[i] += x[i]` in place (the same sums, bit for bit, as [`binary`] with [`BinaryOp::Add`]
/// into a fresh buffer); both contiguous and of equal length.
pub fn add_assign<T: Float>(acc: &mut [T], x: &[T]) {
    assert_eq!(
        acc.len(),
        x.len(),
        "add_assign: accumulator has {} elements, input {}",
        acc.len(),
        x.len()
    );
    let serial = |acc: &mut [T], x: &[T]| {
        simd(
            #[inline(always)]
            || {
                for (a, &v) in acc.iter_mut().zip(x) {
                    *a += v;
                }
            },
        )
    };
    if x.len() < PAR_THRESHOLD {
        serial(acc, x);
    } else {
        let cl = par_chunk_len(x.len(), 64);
        acc.par_chunks_mut(cl)
            .zip(x.par_chunks(cl))
            .for_each(|(a, x)| serial(a, x));
    }
}

/// `out[i] = op(x[i])`; `x` and `out` are contiguous and of equal length.
///
/// `Relu` and `Clamp` pass NaN through; `PowScalar(2.0)` is computed as `x * x` and
/// `PowScalar(1.0)` as a copy, other exponents with `powf`. For f32, `Exp`, `Tanh`, `Sigmoid`,
/// `Silu` and `GeluTanh` use the crate's vectorisable exp/tanh (within a few ulp of the exact
/// functions); `GeluTanh` is evaluated as the identical
/// `x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))`. `Sin` and `Cos` use the standard library's.
pub fn unary<T: Float>(op: UnaryOp, x: &[T], out: &mut [T]) {
    match op {
        UnaryOp::Neg => map1(x, out, |v| -v),
        UnaryOp::Exp => map1(x, out, fastmath::exp),
        UnaryOp::Log => map1(x, out, |v| v.ln()),
        UnaryOp::Sqrt => map1(x, out, |v| v.sqrt()),
        UnaryOp::Tanh => map1(x, out, fastmath::tanh),
        UnaryOp::Relu => map1(x, out, |v| if v < T::ZERO { T::ZERO } else { v }),
        UnaryOp::GeluTanh => {
            // 0.5 x (1 + tanh u) == x * sigmoid(2u): one exp, no cancellation for negative x.
            let c2 = T::from_f64(-2.0 * SQRT_2_OVER_PI);
            let a = T::from_f64(GELU_CUBIC);
            map1(x, out, move |v| {
                v / (T::ONE + fastmath::exp(c2 * (v + a * v * v * v)))
            })
        }
        UnaryOp::GeluErf => {
            let r = T::from_f64(FRAC_1_SQRT_2);
            let half = T::from_f64(0.5);
            map1(x, out, move |v| half * v * (T::ONE + (v * r).erf()))
        }
        UnaryOp::Abs => map1(x, out, |v| v.abs()),
        UnaryOp::Recip => map1(x, out, |v| T::ONE / v),
        UnaryOp::Square => map1(x, out, |v| v * v),
        UnaryOp::Sigmoid => map1(x, out, |v| T::ONE / (T::ONE + fastmath::exp(-v))),
        UnaryOp::PowScalar(p) => {
            if p == 2.0 {
                map1(x, out, |v| v * v)
            } else if p == 1.0 {
                map1(x, out, |v| v)
            } else {
                let p = T::from_f64(p);
                map1(x, out, move |v| v.powf(p))
            }
        }
        UnaryOp::AddScalar(c) => {
            let c = T::from_f64(c);
            map1(x, out, move |v| v + c)
        }
        UnaryOp::MulScalar(c) => {
            let c = T::from_f64(c);
            map1(x, out, move |v| v * c)
        }
        UnaryOp::Sin => map1(x, out, |v| v.sin()),
        UnaryOp::Cos => map1(x, out, |v| v.cos()),
        UnaryOp::Silu => map1(x, out, |v| v / (T::ONE + fastmath::exp(-v))),
        UnaryOp::Clamp(lo, hi) => {
            let (lo, hi) = (T::from_f64(lo), T::from_f64(hi));
            map1(x, out, move |v| {
                if v < lo {
                    lo
                } else if v > hi {
                    hi
                } else {
                    v
                }
            })
        }
    }
}

/// The derivative of a GELU applied to an upstream gradient: `dx[i] = dy[i] * gelu'(x[i])`,
/// for the tanh form (`tanh_form = true`) or the exact erf form.
///
/// Tanh form: with `u = sqrt(2/pi) (x + 0.044715 x^3)` and `t = tanh u`,
/// `gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)`, evaluated
/// through `s = sigmoid(2u)` (`0.5 (1 + t) = s`, `1 - t^2 = 4 s (1 - s)`).
/// Erf form: `gelu'(x) = 0.5 (1 + erf(x / sqrt 2)) + x e^(-x^2/2) / sqrt(2 pi)`.
pub fn gelu_backward<T: Float>(tanh_form: bool, x: &[T], dy: &[T], dx: &mut [T]) {
    assert!(
        x.len() == dy.len() && x.len() == dx.len(),
        "gelu_backward: x has {} elements, dy {}, dx {}",
        x.len(),
        dy.len(),
        dx.len()
    );
    let half = T::from_f64(0.5);
    let run = |x: &[T], dy: &[T], dx: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                if tanh_form {
                    let c2 = T::from_f64(-2.0 * SQRT_2_OVER_PI);
                    let two_c = T::from_f64(2.0 * SQRT_2_OVER_PI);
                    let a = T::from_f64(GELU_CUBIC);
                    let a3 = T::from_f64(3.0 * GELU_CUBIC);
                    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                        let v2 = v * v;
                        let s = T::ONE / (T::ONE + fastmath::exp(c2 * (v + a * v2 * v)));
                        let deriv = s + two_c * v * s * (T::ONE - s) * (T::ONE + a3 * v2);
                        *d = g * deriv;
                    }
                } else {
                    let r = T::from_f64(FRAC_1_SQRT_2);
                    let k = T::from_f64(FRAC_1_SQRT_2PI);
                    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                        let cdf = half * (T::ONE + (v * r).erf());
                        let pdf = k * (-half * v * v).exp();
                        *d = g * (cdf + v * pdf);
                    }
                }
            },
        )
    };
    if x.len() < PAR_THRESHOLD {
        run(x, dy, dx);
    } else {
        let cl = par_chunk_len(x.len(), 64);
        dx.par_chunks_mut(cl)
            .zip(x.par_chunks(cl).zip(dy.par_chunks(cl)))
            .for_each(|(dx, (x, dy))| run(x, dy, dx));
    }
}

/// A strided input view: `(data, offset, strides)`; strides in elements, 0 to broadcast.
#[derive(Clone, Copy, Debug)]
pub struct View<'a, T> {
    /// The flat buffer.
    pub data: &'a [T],
    /// Element offset of the view's first element.
    pub offset: usize,
    /// One stride per dimension of the output shape.
    pub strides: &'a [usize],
}

/// One contiguous output run of a two-input map: `out[i] = f(a[ba + i*sa], b[bb + i*sb])`, with
/// tight loops for unit and zero strides.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn run2<A: Copy, B: Copy, O>(
    out: &mut [O],
    a: &[A],
    ba: usize,
    sa: usize,
    b: &[B],
    bb: usize,
    sb: usize,
    f: &impl Fn(A, B) -> O,
) {
    let n = out.len();
    match (sa, sb) {
        (1, 1) => {
            for ((o, &x), &y) in out.iter_mut().zip(&a[ba..ba + n]).zip(&b[bb..bb + n]) {
                *o = f(x, y);
            }
        }
        (1, 0) => {
            let y = b[bb];
            for (o, &x) in out.iter_mut().zip(&a[ba..ba + n]) {
                *o = f(x, y);
            }
        }
        (0, 1) => {
            let x = a[ba];
            for (o, &y) in out.iter_mut().zip(&b[bb..bb + n]) {
                *o = f(x, y);
            }
        }
        (0, 0) => {
            let (x, y) = (a[ba], b[bb]);
            for o in out.iter_mut() {
                *o = f(x, y);
            }
        }
        _ => {
            for (i, o) in out.iter_mut().enumerate() {
                *o = f(a[ba + i * sa], b[bb + i * sb]);
            }
        }
    }
}

/// `out = f(lhs, rhs)` over `shape` with strided inputs and a contiguous output.
#[inline]
fn map2<A: Copy + Sync, B: Copy + Sync, O: Send>(
    shape: &[usize],
    lhs: View<'_, A>,
    rhs: View<'_, B>,
    out: &mut [O],
    f: impl Fn(A, B) -> O + Sync,
) {
    map_strided(
        shape,
        [lhs.strides, rhs.strides],
        [lhs.offset, rhs.offset],
        out,
        #[inline(always)]
        |run, [ba, bb], [sa, sb]| run2(run, lhs.data, ba, sa, rhs.data, bb, sb, &f),
    );
}

/// `out = op(lhs, rhs)` over `shape` (row-major, `out` contiguous); each input is a strided view
/// with one stride per dimension of `shape` (0 where it broadcasts). Fast paths for contiguous
/// inputs and scalar broadcasts are expected; parallel over rayon when the output is large.
///
/// `Maximum` / `Minimum` use [`Float::max`] / [`Float::min`] (a NaN operand yields the other one).
pub fn binary<T: Float>(
    op: BinaryOp,
    shape: &[usize],
    lhs: View<'_, T>,
    rhs: View<'_, T>,
    out: &mut [T],
) {
    match op {
        BinaryOp::Add => map2(shape, lhs, rhs, out, |a: T, b: T| a + b),
        BinaryOp::Sub => map2(shape, lhs, rhs, out, |a: T, b: T| a - b),
        BinaryOp::Mul => map2(shape, lhs, rhs, out, |a: T, b: T| a * b),
        BinaryOp::Div => map2(shape, lhs, rhs, out, |a: T, b: T| a / b),
        BinaryOp::Maximum => map2(shape, lhs, rhs, out, |a: T, b: T| a.max(b)),
        BinaryOp::Minimum => map2(shape, lhs, rhs, out, |a: T, b: T| a.min(b)),
    }
}

/// `out[i] = cmp(lhs, rhs) as u8` (1 or 0) over `shape`, with views as in [`binary`].
///
/// IEEE semantics: every comparison with a NaN is false except `Ne`, which is true.
pub fn compare<T: Float>(
    op: CmpOp,
    shape: &[usize],
    lhs: View<'_, T>,
    rhs: View<'_, T>,
    out: &mut [u8],
) {
    match op {
        CmpOp::Eq => map2(shape, lhs, rhs, out, |a: T, b: T| (a == b) as u8),
        CmpOp::Ne => map2(shape, lhs, rhs, out, |a: T, b: T| (a != b) as u8),
        CmpOp::Lt => map2(shape, lhs, rhs, out, |a: T, b: T| (a < b) as u8),
        CmpOp::Le => map2(shape, lhs, rhs, out, |a: T, b: T| (a <= b) as u8),
        CmpOp::Gt => map2(shape, lhs, rhs, out, |a: T, b: T| (a > b) as u8),
        CmpOp::Ge => map2(shape, lhs, rhs, out, |a: T, b: T| (a >= b) as u8),
    }
}

/// `out[i] = if cond != 0 { on_true } else { on_false }` over `shape`, with views as in [`binary`].
pub fn where_cond<T: Copy + Send + Sync>(
    shape: &[usize],
    cond: View<'_, u8>,
    on_true: View<'_, T>,
    on_false: View<'_, T>,
    out: &mut [T],
) {
    map_strided(
        shape,
        [cond.strides, on_true.strides, on_false.strides],
        [cond.offset, on_true.offset, on_false.offset],
        out,
        #[inline(always)]
        |run, [bc, bt, bf], [sc, st, sf]| {
            let (c, t, f) = (cond.data, on_true.data, on_false.data);
            let n = run.len();
            if sc == 1 && st == 1 && sf == 1 {
                for (((o, &c), &t), &f) in run
                    .iter_mut()
                    .zip(&c[bc..bc + n])
                    .zip(&t[bt..bt + n])
                    .zip(&f[bf..bf + n])
                {
                    *o = if c != 0 { t } else { f };
                }
            } else {
                for (i, o) in run.iter_mut().enumerate() {
                    *o = if c[bc + i * sc] != 0 {
                        t[bt + i * st]
                    } else {
                        f[bf + i * sf]
                    };
                }
            }
        },
    );
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        /// Uniform in [lo, hi).
        fn float(&mut self, lo: f64, hi: f64) -> f64 {
            lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
        }
    }

    fn view_index(i: usize, offset: usize, shape: &[usize], strides: &[usize]) -> usize {
        let mut rem = i;
        let mut idx = offset;
        for d in (0..shape.len()).rev() {
            idx += (rem % shape[d]) * strides[d];
            rem /= shape[d];
        }
        idx
    }

    fn close(got: f64, want: f64, rtol: f64, atol: f64) -> bool {
        if want.is_nan() {
            return got.is_nan();
        }
        if want.is_infinite() {
            return got == want;
        }
        (got - want).abs() <= atol + rtol * want.abs()
    }

    /// Independent f64 reference of each unary op.
    fn unary_ref(op: UnaryOp, x: f64) -> f64 {
        use std::f64::consts::PI;
        match op {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            UnaryOp::GeluTanh => {
                0.5 * x * (1.0 + ((2.0 / PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
            }
            UnaryOp::GeluErf => 0.5 * x * (1.0 + libm::erf(x / 2f64.sqrt())),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Recip => 1.0 / x,
            UnaryOp::Square => x * x,
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::PowScalar(p) => x.powf(p),
            UnaryOp::AddScalar(c) => x + c,
            UnaryOp::MulScalar(c) => x * c,
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            UnaryOp::Clamp(lo, hi) => x.max(lo).min(hi),
        }
    }

    const ALL_UNARY: [UnaryOp; 23] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Tanh,
        UnaryOp::Relu,
        UnaryOp::GeluTanh,
        UnaryOp::GeluErf,
        UnaryOp::Abs,
        UnaryOp::Recip,
        UnaryOp::Square,
        UnaryOp::Sigmoid,
        UnaryOp::PowScalar(2.0),
        UnaryOp::PowScalar(1.0),
        UnaryOp::PowScalar(0.5),
        UnaryOp::PowScalar(-1.5),
        UnaryOp::AddScalar(-0.75),
        UnaryOp::MulScalar(3.25),
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Silu,
        UnaryOp::Clamp(-1.5, 2.25),
        UnaryOp::Clamp(f64::NEG_INFINITY, 0.5),
    ];

    fn positive_only(op: UnaryOp) -> bool {
        matches!(
            op,
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::PowScalar(0.5) | UnaryOp::PowScalar(-1.5)
        )
    }

    #[test]
    fn unary_f32_and_f64_match_reference() {
        let mut rng = Rng(42);
        for op in ALL_UNARY {
            for &n in &[0usize, 1, 7, 33, 1000, 70_001] {
                let xs: Vec<f64> = (0..n)
                    .map(|_| {
                        if positive_only(op) {
                            rng.float(0.01, 5.0)
                        } else {
                            rng.float(-6.0, 6.0)
                        }
                    })
                    .collect();
                let x32: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
                let mut y32 = vec![0f32; n];
                unary(op, &x32, &mut y32);
                let mut y64 = vec![0f64; n];
                unary(op, &xs, &mut y64);
                for i in 0..n {
                    let want32 = unary_ref(op, x32[i] as f64);
                    assert!(
                        close(y32[i] as f64, want32, 2e-6, 1e-6),
                        "{op:?} f32 x={} got {} want {}",
                        x32[i],
                        y32[i],
                        want32
                    );
                    let want64 = unary_ref(op, xs[i]);
                    assert!(
                        close(y64[i], want64, 1e-13, 1e-15),
                        "{op:?} f64 x={} got {} want {}",
                        xs[i],
                        y64[i],
                        want64
                    );
                }
            }
        }
    }

    #[test]
    fn unary_special_values() {
        let x = [f32::NAN, -0.0, 0.0, f32::INFINITY, f32::NEG_INFINITY];
        let mut y = [0f32; 5];
        unary(UnaryOp::Relu, &x, &mut y);
        assert!(y[0].is_nan());
        assert_eq!(&y[1..], &[0.0, 0.0, f32::INFINITY, 0.0]);
        unary(UnaryOp::Sigmoid, &x, &mut y);
        assert_eq!(&y[3..], &[1.0, 0.0]);
        unary(UnaryOp::Exp, &x, &mut y);
        assert_eq!(&y[1..], &[1.0, 1.0, f32::INFINITY, 0.0]);
    }

    fn gelu_deriv_ref(tanh_form: bool, x: f64) -> f64 {
        use std::f64::consts::PI;
        if tanh_form {
            let c = (2.0 / PI).sqrt();
            let u = c * (x + 0.044715 * x * x * x);
            let t = u.tanh();
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
        } else {
            0.5 * (1.0 + libm::erf(x / 2f64.sqrt())) + x * (-0.5 * x * x).exp() / (2.0 * PI).sqrt()
        }
    }

    #[test]
    fn gelu_backward_matches_formula_and_finite_differences() {
        let mut rng = Rng(7);
        for tanh_form in [true, false] {
            let op = if tanh_form {
                UnaryOp::GeluTanh
            } else {
                UnaryOp::GeluErf
            };
            for &n in &[1usize, 5, 64, 40_000] {
                let x: Vec<f64> = (0..n).map(|_| rng.float(-5.0, 5.0)).collect();
                let dy: Vec<f64> = (0..n).map(|_| rng.float(-2.0, 2.0)).collect();
                let mut dx = vec![0.0; n];
                gelu_backward(tanh_form, &x, &dy, &mut dx);
                // Central finite differences of the f64 forward kernel, elementwise.
                let h = 1e-5;
                let xp: Vec<f64> = x.iter().map(|v| v + h).collect();
                let xm: Vec<f64> = x.iter().map(|v| v - h).collect();
                let (mut yp, mut ym) = (vec![0.0; n], vec![0.0; n]);
                unary(op, &xp, &mut yp);
                unary(op, &xm, &mut ym);
                for i in 0..n {
                    let fd = dy[i] * (yp[i] - ym[i]) / (2.0 * h);
                    assert!(
                        close(dx[i], fd, 1e-7, 1e-8),
                        "fd x={} got {} want {}",
                        x[i],
                        dx[i],
                        fd
                    );
                    let want = dy[i] * gelu_deriv_ref(tanh_form, x[i]);
                    assert!(close(dx[i], want, 1e-12, 1e-14));
                }
                // f32 against the f64 formula.
                let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
                let dy32: Vec<f32> = dy.iter().map(|&v| v as f32).collect();
                let mut dx32 = vec![0f32; n];
                gelu_backward(tanh_form, &x32, &dy32, &mut dx32);
                for i in 0..n {
                    let want = dy32[i] as f64 * gelu_deriv_ref(tanh_form, x32[i] as f64);
                    assert!(
                        close(dx32[i] as f64, want, 1e-5, 1e-6),
                        "f32 x={} got {} want {}",
                        x32[i],
                        dx32[i],
                        want
                    );
                }
            }
        }
    }

    /// `(buffer length, offset, strides)` of one test input.
    type Input = (usize, usize, Vec<usize>);

    /// A random broadcasting problem: output shape, and for each of `k` inputs a buffer length,
    /// an offset and strides (possibly transposed, sliced or broadcast).
    fn random_problem(rng: &mut Rng, k: usize, big: bool) -> (Vec<usize>, Vec<Input>) {
        let rank = rng.below(5);
        let shape: Vec<usize> = (0..rank)
            .map(|_| {
                if big {
                    1 + rng.below(48)
                } else {
                    1 + rng.below(5)
                }
            })
            .collect();
        let inputs = (0..k)
            .map(|_| {
                let mode = rng.below(4);
                let mut perm: Vec<usize> = (0..rank).collect();
                if mode == 1 {
                    for i in (1..rank).rev() {
                        let j = rng.below(i + 1);
                        perm.swap(i, j);
                    }
                }
                let pad = if mode == 2 { 2 } else { 0 };
                let mut strides = vec![0; rank];
                let mut s = 1;
                for &d in perm.iter().rev() {
                    strides[d] = s;
                    s *= shape[d] + pad;
                }
                if mode == 3 {
                    // Broadcast some dims, or everything (a scalar).
                    let all = rng.below(3) == 0;
                    for st in strides.iter_mut() {
                        if all || rng.below(2) == 0 {
                            *st = 0;
                        }
                    }
                }
                let offset = rng.below(4);
                (s + offset + 1, offset, strides)
            })
            .collect();
        (shape, inputs)
    }

    fn binary_ref(op: BinaryOp, a: f64, b: f64) -> f64 {
        match op {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            BinaryOp::Maximum => {
                if a > b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Minimum => {
                if a < b {
                    a
                } else {
                    b
                }
            }
        }
    }

    #[test]
    fn binary_and_compare_broadcast_strided() {
        let mut rng = Rng(0xabcdef);
        let ops = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Maximum,
            BinaryOp::Minimum,
        ];
        let cmps = [
            CmpOp::Eq,
            CmpOp::Ne,
            CmpOp::Lt,
            CmpOp::Le,
            CmpOp::Gt,
            CmpOp::Ge,
        ];
        for case in 0..600 {
            let (shape, ins) = random_problem(&mut rng, 2, case % 20 == 0);
            let n: usize = shape.iter().product();
            // Values from a small set so comparisons hit equality too; no zeros (for Div).
            let bufs: Vec<Vec<f64>> = ins
                .iter()
                .map(|(len, _, _)| {
                    (0..*len)
                        .map(|_| (rng.below(7) as f64 - 3.0) * 0.5 + 0.25)
                        .collect()
                })
                .collect();
            let va = View {
                data: &bufs[0][..],
                offset: ins[0].1,
                strides: &ins[0].2[..],
            };
            let vb = View {
                data: &bufs[1][..],
                offset: ins[1].1,
                strides: &ins[1].2[..],
            };
            let a32: Vec<f32> = bufs[0].iter().map(|&v| v as f32).collect();
            let b32: Vec<f32> = bufs[1].iter().map(|&v| v as f32).collect();
            let va32 = View {
                data: &a32[..],
                offset: ins[0].1,
                strides: &ins[0].2[..],
            };
            let vb32 = View {
                data: &b32[..],
                offset: ins[1].1,
                strides: &ins[1].2[..],
            };
            let op = ops[case % ops.len()];
            let mut out = vec![f64::NAN; n];
            binary(op, &shape, va, vb, &mut out);
            let mut out32 = vec![f32::NAN; n];
            binary(op, &shape, va32, vb32, &mut out32);
            let cmp = cmps[case % cmps.len()];
            let mut mask = vec![9u8; n];
            compare(cmp, &shape, va, vb, &mut mask);
            for i in 0..n {
                let a = bufs[0][view_index(i, ins[0].1, &shape, &ins[0].2)];
                let b = bufs[1][view_index(i, ins[1].1, &shape, &ins[1].2)];
                let want = binary_ref(op, a, b);
                assert_eq!(out[i], want, "case {case} {op:?} {shape:?} {ins:?} at {i}");
                assert!(close(out32[i] as f64, want, 1e-6, 0.0));
                let want_c = match cmp {
                    CmpOp::Eq => a == b,
                    CmpOp::Ne => a != b,
                    CmpOp::Lt => a < b,
                    CmpOp::Le => a <= b,
                    CmpOp::Gt => a > b,
                    CmpOp::Ge => a >= b,
                } as u8;
                assert_eq!(mask[i], want_c, "case {case} {cmp:?}");
            }
        }
    }

    #[test]
    fn binary_large_fast_paths() {
        // Contiguous + contiguous, contiguous + scalar, row bias broadcast: parallel sizes.
        let n = 300 * 257;
        let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 0.01).collect();
        let b: Vec<f32> = (0..n).map(|i| (i % 77) as f32 - 30.0).collect();
        let shape = [300usize, 257];
        let cont = [257usize, 1];
        let mut out = vec![0f32; n];
        binary(
            BinaryOp::Mul,
            &shape,
            View {
                data: &a,
                offset: 0,
                strides: &cont,
            },
            View {
                data: &b,
                offset: 0,
                strides: &cont,
            },
            &mut out,
        );
        for i in 0..n {
            assert_eq!(out[i], a[i] * b[i]);
        }
        binary(
            BinaryOp::Sub,
            &shape,
            View {
                data: &a,
                offset: 0,
                strides: &cont,
            },
            View {
                data: &b,
                offset: 5,
                strides: &[0, 0],
            },
            &mut out,
        );
        for i in 0..n {
            assert_eq!(out[i], a[i] - b[5]);
        }
        binary(
            BinaryOp::Add,
            &shape,
            View {
                data: &a,
                offset: 0,
                strides: &cont,
            },
            View {
                data: &b,
                offset: 1,
                strides: &[0, 1],
            },
            &mut out,
        );
        for i in 0..n {
            assert_eq!(out[i], a[i] + b[1 + i % 257]);
        }
        binary(
            BinaryOp::Div,
            &shape,
            View {
                data: &b,
                offset: 2,
                strides: &[1, 0],
            },
            View {
                data: &a,
                offset: 0,
                strides: &[1, 300],
            },
            &mut out,
        );
        for i in 0..n {
            let (r, c) = (i / 257, i % 257);
            assert_eq!(out[i], b[2 + r] / a[r + 300 * c]);
        }
    }

    #[test]
    fn where_cond_broadcast_strided() {
        let mut rng = Rng(99);
        for case in 0..400 {
            let (shape, ins) = random_problem(&mut rng, 3, case % 25 == 0);
            let n: usize = shape.iter().product();
            let c: Vec<u8> = (0..ins[0].0).map(|_| rng.below(3) as u8).collect();
            let t: Vec<i32> = (0..ins[1].0 as i32).collect();
            let f: Vec<i32> = (0..ins[2].0 as i32).map(|v| -v - 1).collect();
            let mut out = vec![0i32; n];
            where_cond(
                &shape,
                View {
                    data: &c,
                    offset: ins[0].1,
                    strides: &ins[0].2,
                },
                View {
                    data: &t,
                    offset: ins[1].1,
                    strides: &ins[1].2,
                },
                View {
                    data: &f,
                    offset: ins[2].1,
                    strides: &ins[2].2,
                },
                &mut out,
            );
            for i in 0..n {
                let cv = c[view_index(i, ins[0].1, &shape, &ins[0].2)];
                let want = if cv != 0 {
                    t[view_index(i, ins[1].1, &shape, &ins[1].2)]
                } else {
                    f[view_index(i, ins[2].1, &shape, &ins[2].2)]
                };
                assert_eq!(out[i], want, "case {case}");
            }
        }
    }
}
