//! Arithmetic operators on tensors, each through the named op it stands for; every operator
//! returns `Result<Tensor>` and is also implemented on `Result<Tensor>` so chains need one `?`.
//! The forms and their meaning are listed in the crate documentation.

use std::ops::{Add, Div, Mul, Neg, Sub};

use crate::{Result, Tensor};

/// Implements a binary operator between tensors (owned or borrowed) and with `Result<Tensor>` on
/// either side, through the inherent method of the same name.
macro_rules! tensor_binary {
    ($Trait:ident, $method:ident) => {
        impl $Trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(self, rhs)
            }
        }
        impl $Trait<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(self, &rhs)
            }
        }
        impl $Trait<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(&self, rhs)
            }
        }
        impl $Trait<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl $Trait<&Tensor> for Result<Tensor> {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(&self?, rhs)
            }
        }
        impl $Trait<Tensor> for Result<Tensor> {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(&self?, &rhs)
            }
        }
        impl $Trait<Result<Tensor>> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Result<Tensor>) -> Result<Tensor> {
                Tensor::$method(self, &rhs?)
            }
        }
        impl $Trait<Result<Tensor>> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Result<Tensor>) -> Result<Tensor> {
                Tensor::$method(&self, &rhs?)
            }
        }
    };
}

tensor_binary!(Add, add);
tensor_binary!(Sub, sub);
tensor_binary!(Mul, mul);
tensor_binary!(Div, div);

/// A 0-d tensor holding `c` in `t`'s dtype, on `t`'s device.
fn scalar_like(t: &Tensor, c: f64) -> Result<Tensor> {
    Tensor::scalar(c, t.dtype(), t.device())
}

/// Implements an operator between tensors (owned or borrowed) and `f64` on either side:
/// `$tensor_op(t, c)` for `t op c`, `$scalar_op(c, t)` for `c op t`.
macro_rules! tensor_scalar {
    ($Trait:ident, $method:ident, $tensor_op:expr, $scalar_op:expr) => {
        impl $Trait<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, c: f64) -> Result<Tensor> {
                let f: fn(&Tensor, f64) -> Result<Tensor> = $tensor_op;
                f(self, c)
            }
        }
        impl $Trait<f64> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, c: f64) -> Result<Tensor> {
                $Trait::$method(&self, c)
            }
        }
        impl $Trait<&Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $method(self, t: &Tensor) -> Result<Tensor> {
                let f: fn(f64, &Tensor) -> Result<Tensor> = $scalar_op;
                f(self, t)
            }
        }
        impl $Trait<Tensor> for f64 {
            type Output = Result<Tensor>;
            fn $method(self, t: Tensor) -> Result<Tensor> {
                $Trait::$method(self, &t)
            }
        }
    };
}

tensor_scalar!(Add, add, |t, c| Tensor::add_scalar(t, c), |c, t| {
    Tensor::add_scalar(t, c)
});
tensor_scalar!(Sub, sub, |t, c| Tensor::add_scalar(t, -c), |c, t| {
    Tensor::add_scalar(&Tensor::neg(t)?, c)
});
tensor_scalar!(Mul, mul, |t, c| Tensor::mul_scalar(t, c), |c, t| {
    Tensor::mul_scalar(t, c)
});
tensor_scalar!(
    Div,
    div,
    |t, c| Tensor::div(t, &scalar_like(t, c)?),
    |c, t| Tensor::div(&scalar_like(t, c)?, t)
);

impl Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}

impl Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}
