//! Elementwise ops: broadcasting binary arithmetic, unary maps, comparisons and `where`.

use super::same_kind;
use crate::ops::float_only;
use crate::storage::Storage;
use crate::{DType, Result, Shape, Tensor};
use meshgrad_kernels::ops::{BinaryOp, CmpOp, UnaryOp};

/// Which GELU formula.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GeluKind {
    /// `0.5 x (1 + tanh(sqrt(2/π)(x + 0.044715 x³)))` (GPT-2's).
    #[default]
    Tanh,
    /// `0.5 x (1 + erf(x/√2))` (exact; BERT's).
    Erf,
}

impl Tensor {
    fn binary_op(&self, rhs: &Tensor, op: BinaryOp, name: &'static str) -> Result<Tensor> {
        let _prof = crate::profile::scope(name);
        same_kind(name, self, rhs)?;
        float_only(name, self)?;
        let shape = Shape::broadcast(name, self.shape(), rhs.shape())?;
        let (la, lb) = (
            self.layout().broadcast_as(&shape)?,
            rhs.layout().broadcast_as(&shape)?,
        );
        let (ga, gb) = (self.read_storage(name)?, rhs.read_storage(name)?);
        let s = Storage::binary(op, (&ga, &la), (&gb, &lb))?;
        Ok(Tensor::from_storage(s, shape))
    }

    /// `self + rhs` with broadcasting.
    pub fn add(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Add, "add")
    }

    /// `self - rhs` with broadcasting.
    pub fn sub(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Sub, "sub")
    }

    /// `self * rhs` with broadcasting.
    pub fn mul(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Mul, "mul")
    }

    /// `self / rhs` with broadcasting.
    pub fn div(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Div, "div")
    }

    /// Elementwise maximum with broadcasting.
    pub fn maximum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Maximum, "maximum")
    }

    /// Elementwise minimum with broadcasting.
    pub fn minimum(&self, rhs: &Tensor) -> Result<Tensor> {
        self.binary_op(rhs, BinaryOp::Minimum, "minimum")
    }

    pub(crate) fn unary_op(&self, op: UnaryOp, name: &'static str) -> Result<Tensor> {
        let _prof = crate::profile::scope(name);
        float_only(name, self)?;
        let g = self.read_storage(name)?;
        let s = Storage::unary((&g, self.layout()), op)?;
        Ok(Tensor::from_storage(s, self.shape()))
    }

    /// `-x`
    pub fn neg(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Neg, "neg")
    }
    /// `e^x`
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Exp, "exp")
    }
    /// `ln x`
    pub fn log(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Log, "log")
    }
    /// `sqrt x`
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sqrt, "sqrt")
    }
    /// `tanh x`
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Tanh, "tanh")
    }
    /// `max(x, 0)`
    pub fn relu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Relu, "relu")
    }
    /// GELU of the given kind.
    pub fn gelu(&self, kind: GeluKind) -> Result<Tensor> {
        match kind {
            GeluKind::Tanh => self.unary_op(UnaryOp::GeluTanh, "gelu"),
            GeluKind::Erf => self.unary_op(UnaryOp::GeluErf, "gelu"),
        }
    }
    /// `|x|`
    pub fn abs(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Abs, "abs")
    }
    /// `1/x`
    pub fn recip(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Recip, "recip")
    }
    /// `x²`
    pub fn sqr(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Square, "sqr")
    }
    /// `1/(1+e^-x)`
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sigmoid, "sigmoid")
    }
    /// `x^p`
    pub fn powf(&self, p: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::PowScalar(p), "powf")
    }
    /// `x + c`
    pub fn add_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::AddScalar(c), "add_scalar")
    }
    /// `x * c`
    pub fn mul_scalar(&self, c: f64) -> Result<Tensor> {
        self.unary_op(UnaryOp::MulScalar(c), "mul_scalar")
    }

    fn cmp_op(&self, rhs: &Tensor, op: CmpOp, name: &'static str) -> Result<Tensor> {
        let _prof = crate::profile::scope(name);
        same_kind(name, self, rhs)?;
        let (a, b) = if self.dtype().is_float() {
            (self.clone(), rhs.clone())
        } else {
            (self.to_dtype(DType::F64)?, rhs.to_dtype(DType::F64)?)
        };
        let shape = Shape::broadcast(name, a.shape(), b.shape())?;
        let (la, lb) = (
            a.layout().broadcast_as(&shape)?,
            b.layout().broadcast_as(&shape)?,
        );
        let (ga, gb) = (a.read_storage(name)?, b.read_storage(name)?);
        let s = Storage::compare(op, (&ga, &la), (&gb, &lb))?;
        Ok(Tensor::from_storage(s, shape))
    }

    /// `self == rhs` as a u8 mask (1/0), broadcasting.
    pub fn eq(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Eq, "eq")
    }
    /// `self != rhs` as a u8 mask.
    pub fn ne(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Ne, "ne")
    }
    /// `self < rhs` as a u8 mask.
    pub fn lt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Lt, "lt")
    }
    /// `self <= rhs` as a u8 mask.
    pub fn le(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Le, "le")
    }
    /// `self > rhs` as a u8 mask.
    pub fn gt(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Gt, "gt")
    }
    /// `self >= rhs` as a u8 mask.
    pub fn ge(&self, rhs: &Tensor) -> Result<Tensor> {
        self.cmp_op(rhs, CmpOp::Ge, "ge")
    }

    /// Picks `on_true` where `self` (a u8 mask) is non-zero, else `on_false`; all three broadcast.
    pub fn where_cond(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("where_cond");
        if self.dtype() != DType::U8 {
            return Err(crate::Error::UnsupportedDType {
                op: "where_cond (condition must be u8)",
                dtype: self.dtype(),
            });
        }
        same_kind("where_cond", on_true, on_false)?;
        super::same_device("where_cond", self, on_true)?;
        let shape = Shape::broadcast("where_cond", self.shape(), on_true.shape())?;
        let shape = Shape::broadcast("where_cond", &shape, on_false.shape())?;
        let (lc, lt, lf) = (
            self.layout().broadcast_as(&shape)?,
            on_true.layout().broadcast_as(&shape)?,
            on_false.layout().broadcast_as(&shape)?,
        );
        let (gc, gt, gf) = (
            self.read_storage("where_cond")?,
            on_true.read_storage("where_cond")?,
            on_false.read_storage("where_cond")?,
        );
        let s = Storage::where_cond((&gc, &lc), (&gt, &lt), (&gf, &lf))?;
        Ok(Tensor::from_storage(s, shape))
    }
}
