//! Softmax and log-softmax along a dim, with their backward rules.

use meshgrad_tensor::Result;

use crate::Var;

impl Var {
    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Var> {
        let v = self.tensor().softmax(dim)?;
        let y = v.clone();
        Ok(Var::from_op(
            "softmax",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(y.softmax_backward(g, dim, false)?)])),
        ))
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Var> {
        let v = self.tensor().log_softmax(dim)?;
        let y = v.clone();
        Ok(Var::from_op(
            "log_softmax",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(y.softmax_backward(g, dim, true)?)])),
        ))
    }
}
