//! Arithmetic operators on variables, recorded in the graph like the named ops they call. Every
//! operator returns `Result<Var>`, and the operators are also implemented on `Result<Var>` on the
//! left (with a `Var` or `&Var` on the right) and on the right (with a `Var` or `&Var` on the
//! left), so expressions chain without a `?` after every step; the first error met is the one
//! returned. The forms and their meaning are listed in the crate documentation.

use std::ops::{Add, Div, Mul, Neg, Sub};

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

/// Implements a binary operator between variables (owned or borrowed) and with `Result<Var>` on
/// either side, through the inherent method of the same name.
macro_rules! var_binary {
    ($Trait:ident, $method:ident) => {
        impl $Trait<&Var> for &Var {
            type Output = Result<Var>;
            fn $method(self, rhs: &Var) -> Result<Var> {
                Var::$method(self, rhs)
            }
        }
        impl $Trait<Var> for &Var {
            type Output = Result<Var>;
            fn $method(self, rhs: Var) -> Result<Var> {
                Var::$method(self, &rhs)
            }
        }
        impl $Trait<&Var> for Var {
            type Output = Result<Var>;
            fn $method(self, rhs: &Var) -> Result<Var> {
                Var::$method(&self, rhs)
            }
        }
        impl $Trait<Var> for Var {
            type Output = Result<Var>;
            fn $method(self, rhs: Var) -> Result<Var> {
                Var::$method(&self, &rhs)
            }
        }
        impl $Trait<&Var> for Result<Var> {
            type Output = Result<Var>;
            fn $method(self, rhs: &Var) -> Result<Var> {
                Var::$method(&self?, rhs)
            }
        }
        impl $Trait<Var> for Result<Var> {
            type Output = Result<Var>;
            fn $method(self, rhs: Var) -> Result<Var> {
                Var::$method(&self?, &rhs)
            }
        }
        impl $Trait<Result<Var>> for &Var {
            type Output = Result<Var>;
            fn $method(self, rhs: Result<Var>) -> Result<Var> {
                Var::$method(self, &rhs?)
            }
        }
        impl $Trait<Result<Var>> for Var {
            type Output = Result<Var>;
            fn $method(self, rhs: Result<Var>) -> Result<Var> {
                Var::$method(&self, &rhs?)
            }
        }
    };
}

var_binary!(Add, add);
var_binary!(Sub, sub);
var_binary!(Mul, mul);
var_binary!(Div, div);

/// A constant 0-d variable holding `c` in `v`'s dtype, on `v`'s device.
fn scalar_like(v: &Var, c: f64) -> Result<Var> {
    let t = v.tensor();
    Ok(Var::constant(Tensor::scalar(c, t.dtype(), t.device())?))
}

/// Implements an operator between variables (owned or borrowed) and `f64` on either side:
/// `$var_op(v, c)` for `v op c`, `$scalar_op(c, v)` for `c op v`.
macro_rules! var_scalar {
    ($Trait:ident, $method:ident, $var_op:expr, $scalar_op:expr) => {
        impl $Trait<f64> for &Var {
            type Output = Result<Var>;
            fn $method(self, c: f64) -> Result<Var> {
                let f: fn(&Var, f64) -> Result<Var> = $var_op;
                f(self, c)
            }
        }
        impl $Trait<f64> for Var {
            type Output = Result<Var>;
            fn $method(self, c: f64) -> Result<Var> {
                $Trait::$method(&self, c)
            }
        }
        impl $Trait<&Var> for f64 {
            type Output = Result<Var>;
            fn $method(self, t: &Var) -> Result<Var> {
                let f: fn(f64, &Var) -> Result<Var> = $scalar_op;
                f(self, t)
            }
        }
        impl $Trait<Var> for f64 {
            type Output = Result<Var>;
            fn $method(self, t: Var) -> Result<Var> {
                $Trait::$method(self, &t)
            }
        }
    };
}

var_scalar!(Add, add, |t, c| Var::add_scalar(t, c), |c, t| {
    Var::add_scalar(t, c)
});
var_scalar!(Sub, sub, |t, c| Var::add_scalar(t, -c), |c, t| {
    Var::add_scalar(&Var::neg(t)?, c)
});
var_scalar!(Mul, mul, |t, c| Var::mul_scalar(t, c), |c, t| {
    Var::mul_scalar(t, c)
});
var_scalar!(Div, div, |t, c| Var::div(t, &scalar_like(t, c)?), |c, t| {
    Var::div(&scalar_like(t, c)?, t)
});

impl Neg for &Var {
    type Output = Result<Var>;
    fn neg(self) -> Result<Var> {
        Var::neg(self)
    }
}

impl Neg for Var {
    type Output = Result<Var>;
    fn neg(self) -> Result<Var> {
        Var::neg(&self)
    }
}
