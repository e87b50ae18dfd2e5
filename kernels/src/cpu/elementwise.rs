//! Elementwise kernels: unary maps, broadcasting binary ops, comparisons, `where`.

use crate::Float;

/// A unary elementwise function.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// -x
    Neg,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// sqrt x
    Sqrt,
    /// tanh x
    Tanh,
    /// max(x, 0)
    Relu,
    /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    GeluTanh,
    /// GELU, exact: 0.5 x (1 + erf(x / sqrt 2))
    GeluErf,
    /// |x|
    Abs,
    /// 1 / x
    Recip,
    /// x^2
    Square,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// x^p
    PowScalar(f64),
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
}

/// `out[i] = op(x[i])`; `x` and `out` are contiguous and of equal length.
pub fn unary<T: Float>(op: UnaryOp, x: &[T], out: &mut [T]) {
    let _ = (op, x, out);
    todo!("unary")
}

/// The derivative of a GELU applied to an upstream gradient: `dx[i] = dy[i] * gelu'(x[i])`,
/// for the tanh form (`tanh_form = true`) or the exact erf form.
pub fn gelu_backward<T: Float>(tanh_form: bool, x: &[T], dy: &[T], dx: &mut [T]) {
    let _ = (tanh_form, x, dy, dx);
    todo!("gelu_backward")
}

/// A binary elementwise function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a * b
    Mul,
    /// a / b
    Div,
    /// max(a, b)
    Maximum,
    /// min(a, b)
    Minimum,
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

/// `out = op(lhs, rhs)` over `shape` (row-major, `out` contiguous); each input is a strided view
/// with one stride per dimension of `shape` (0 where it broadcasts). Fast paths for contiguous
/// inputs and scalar broadcasts are expected; parallel over rayon when the output is large.
pub fn binary<T: Float>(op: BinaryOp, shape: &[usize], lhs: View<'_, T>, rhs: View<'_, T>, out: &mut [T]) {
    let _ = (op, shape, lhs, rhs, out);
    todo!("binary")
}

/// A comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    /// a == b
    Eq,
    /// a != b
    Ne,
    /// a < b
    Lt,
    /// a <= b
    Le,
    /// a > b
    Gt,
    /// a >= b
    Ge,
}

/// `out[i] = cmp(lhs, rhs) as u8` (1 or 0) over `shape`, with views as in [`binary`].
pub fn compare<T: Float>(op: CmpOp, shape: &[usize], lhs: View<'_, T>, rhs: View<'_, T>, out: &mut [u8]) {
    let _ = (op, shape, lhs, rhs, out);
    todo!("compare")
}

/// `out[i] = if cond != 0 { on_true } else { on_false }` over `shape`, with views as in [`binary`].
pub fn where_cond<T: Copy + Send + Sync>(
    shape: &[usize],
    cond: View<'_, u8>,
    on_true: View<'_, T>,
    on_false: View<'_, T>,
    out: &mut [T],
) {
    let _ = (shape, cond, on_true, on_false, out);
    todo!("where_cond")
}
