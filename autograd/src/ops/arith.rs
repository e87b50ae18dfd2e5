//! Elementwise arithmetic and activations.

use meshgrad_tensor::{GeluKind, Result, Shape, Tensor};

use crate::Var;

fn unbroadcast(g: Tensor, shape: &Shape) -> Result<Tensor> {
    g.sum_to_shape(shape)
}

impl Var {
    /// `self + rhs` (broadcasting).
    pub fn add(&self, rhs: &Var) -> Result<Var> {
        let v = self.tensor().add(rhs.tensor())?;
        let (sa, sb) = (self.tensor().shape().clone(), rhs.tensor().shape().clone());
        Ok(Var::from_op(
            "add",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let ga = if wanted[0] {
                    Some(unbroadcast(g.clone(), &sa)?)
                } else {
                    None
                };
                let gb = if wanted[1] {
                    Some(unbroadcast(g.clone(), &sb)?)
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// `self - rhs` (broadcasting).
    pub fn sub(&self, rhs: &Var) -> Result<Var> {
        let v = self.tensor().sub(rhs.tensor())?;
        let (sa, sb) = (self.tensor().shape().clone(), rhs.tensor().shape().clone());
        Ok(Var::from_op(
            "sub",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let ga = if wanted[0] {
                    Some(unbroadcast(g.clone(), &sa)?)
                } else {
                    None
                };
                let gb = if wanted[1] {
                    Some(unbroadcast(g.neg()?, &sb)?)
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// `self * rhs` (broadcasting).
    pub fn mul(&self, rhs: &Var) -> Result<Var> {
        let v = self.tensor().mul(rhs.tensor())?;
        let (a, b) = (self.tensor().clone(), rhs.tensor().clone());
        Ok(Var::from_op(
            "mul",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let (ra, rb) = (wanted[0], wanted[1]);
                let ga = if ra {
                    Some(unbroadcast(g.mul(&b)?, a.shape())?)
                } else {
                    None
                };
                let gb = if rb {
                    Some(unbroadcast(g.mul(&a)?, b.shape())?)
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// `self / rhs` (broadcasting).
    pub fn div(&self, rhs: &Var) -> Result<Var> {
        let v = self.tensor().div(rhs.tensor())?;
        let (a, b) = (self.tensor().clone(), rhs.tensor().clone());
        let out = v.clone();
        Ok(Var::from_op(
            "div",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let (ra, rb) = (wanted[0], wanted[1]);
                let ga = if ra {
                    Some(unbroadcast(g.div(&b)?, a.shape())?)
                } else {
                    None
                };
                // d(a/b)/db = -(a/b)/b
                let gb = if rb {
                    Some(unbroadcast(g.mul(&out)?.div(&b)?.neg()?, b.shape())?)
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// Elementwise maximum; the gradient goes to `self` where `self >= rhs`, else to `rhs`.
    pub fn maximum(&self, rhs: &Var) -> Result<Var> {
        self.select_by(rhs, true)
    }

    /// Elementwise minimum; the gradient goes to `self` where `self <= rhs`, else to `rhs`.
    pub fn minimum(&self, rhs: &Var) -> Result<Var> {
        self.select_by(rhs, false)
    }

    fn select_by(&self, rhs: &Var, max: bool) -> Result<Var> {
        let (a, b) = (self.tensor().clone(), rhs.tensor().clone());
        let mask = if max { a.ge(&b)? } else { a.le(&b)? };
        let v = mask.where_cond(&a, &b)?;
        Ok(Var::from_op(
            if max { "maximum" } else { "minimum" },
            v,
            &[self, rhs],
            Box::new(move |g, _| {
                let z = Tensor::zeros((), g.dtype(), g.device())?;
                let ga = unbroadcast(mask.where_cond(g, &z)?, a.shape())?;
                let gb = unbroadcast(mask.where_cond(&z, g)?, b.shape())?;
                Ok(vec![Some(ga), Some(gb)])
            }),
        ))
    }

    /// Picks `on_true` where `cond` (a u8 mask tensor, not differentiated) is non-zero.
    pub fn where_cond(cond: &Tensor, on_true: &Var, on_false: &Var) -> Result<Var> {
        let v = cond.where_cond(on_true.tensor(), on_false.tensor())?;
        let (st, sf) = (
            on_true.tensor().shape().clone(),
            on_false.tensor().shape().clone(),
        );
        let cond = cond.clone();
        Ok(Var::from_op(
            "where_cond",
            v,
            &[on_true, on_false],
            Box::new(move |g, _| {
                let z = Tensor::zeros((), g.dtype(), g.device())?;
                Ok(vec![
                    Some(unbroadcast(cond.where_cond(g, &z)?, &st)?),
                    Some(unbroadcast(cond.where_cond(&z, g)?, &sf)?),
                ])
            }),
        ))
    }

    /// `-x`
    pub fn neg(&self) -> Result<Var> {
        let v = self.tensor().neg()?;
        Ok(Var::from_op(
            "neg",
            v,
            &[self],
            Box::new(|g, _| Ok(vec![Some(g.neg()?)])),
        ))
    }

    /// `e^x`
    pub fn exp(&self) -> Result<Var> {
        let v = self.tensor().exp()?;
        let y = v.clone();
        Ok(Var::from_op(
            "exp",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&y)?)])),
        ))
    }

    /// `ln x`
    pub fn log(&self) -> Result<Var> {
        let v = self.tensor().log()?;
        let x = self.tensor().clone();
        Ok(Var::from_op(
            "log",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.div(&x)?)])),
        ))
    }

    /// `sqrt x`
    pub fn sqrt(&self) -> Result<Var> {
        let v = self.tensor().sqrt()?;
        let y = v.clone();
        Ok(Var::from_op(
            "sqrt",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.div(&y)?.mul_scalar(0.5)?)])),
        ))
    }

    /// `tanh x`
    pub fn tanh(&self) -> Result<Var> {
        let v = self.tensor().tanh()?;
        let y = v.clone();
        Ok(Var::from_op(
            "tanh",
            v,
            &[self],
            Box::new(move |g, _| {
                let d = y.sqr()?.neg()?.add_scalar(1.0)?;
                Ok(vec![Some(g.mul(&d)?)])
            }),
        ))
    }

    /// `1/(1+e^-x)`
    pub fn sigmoid(&self) -> Result<Var> {
        let v = self.tensor().sigmoid()?;
        let y = v.clone();
        Ok(Var::from_op(
            "sigmoid",
            v,
            &[self],
            Box::new(move |g, _| {
                let d = y.mul(&y.neg()?.add_scalar(1.0)?)?;
                Ok(vec![Some(g.mul(&d)?)])
            }),
        ))
    }

    /// `max(x, 0)` (gradient 0 at 0).
    pub fn relu(&self) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.relu()?;
        Ok(Var::from_op(
            "relu",
            v,
            &[self],
            Box::new(move |g, _| {
                let z = Tensor::zeros((), x.dtype(), x.device())?;
                let mask = x.gt(&z)?;
                Ok(vec![Some(mask.where_cond(g, &z)?)])
            }),
        ))
    }

    /// GELU of the given kind (fused backward).
    pub fn gelu(&self, kind: GeluKind) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.gelu(kind)?;
        Ok(Var::from_op(
            "gelu",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(x.gelu_backward(g, kind)?)])),
        ))
    }

    /// `x^p` for a constant real `p`.
    pub fn powf(&self, p: f64) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.powf(p)?;
        Ok(Var::from_op(
            "powf",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&x.powf(p - 1.0)?)?.mul_scalar(p)?)])),
        ))
    }

    /// `x²`
    pub fn sqr(&self) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.sqr()?;
        Ok(Var::from_op(
            "sqr",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&x)?.mul_scalar(2.0)?)])),
        ))
    }

    /// `x + c`
    pub fn add_scalar(&self, c: f64) -> Result<Var> {
        let v = self.tensor().add_scalar(c)?;
        Ok(Var::from_op(
            "add_scalar",
            v,
            &[self],
            Box::new(|g, _| Ok(vec![Some(g.clone())])),
        ))
    }

    /// `x * c`
    pub fn mul_scalar(&self, c: f64) -> Result<Var> {
        let v = self.tensor().mul_scalar(c)?;
        Ok(Var::from_op(
            "mul_scalar",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul_scalar(c)?)])),
        ))
    }

    /// Converts to another float dtype; the gradient is converted back.
    pub fn to_dtype(&self, dtype: meshgrad_tensor::DType) -> Result<Var> {
        let from = self.tensor().dtype();
        if from == dtype {
            return Ok(self.clone());
        }
        let v = self.tensor().to_dtype(dtype)?;
        Ok(Var::from_op(
            "to_dtype",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.to_dtype(from)?)])),
        ))
    }
}
