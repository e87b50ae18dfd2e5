//! A custom autograd function: the softplus `log(1 + exp(x))` written as one op with its own
//! forward and backward (`autograd::Function`), checked against finite differences with
//! `gradcheck`, then used inside a model.
//!
//! ```text
//! cargo run --release --example custom_op
//! ```

use std::sync::Arc;

use meshgrad::autograd::{apply, gradcheck, Function, GradcheckOptions};
use meshgrad::prelude::*;

/// `softplus(x) = log(1 + exp(x))`, computed stably as `max(x, 0) + log(1 + exp(-|x|))`.
struct Softplus;

impl Function for Softplus {
    fn name(&self) -> &'static str {
        "softplus"
    }

    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor> {
        let x = &inputs[0];
        let pos = x.relu()?;
        let tail = x.abs()?.neg()?.exp()?.add_scalar(1.0)?.log()?;
        pos.add(&tail)
    }

    /// d softplus / dx = sigmoid(x).
    fn backward(
        &self,
        inputs: &[Tensor],
        _output: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grad.mul(&inputs[0].sigmoid()?)?)])
    }
}

fn softplus(x: &Var) -> Result<Var> {
    apply(Arc::new(Softplus), &[x])
}

/// A layer that uses the custom op.
#[derive(Module)]
struct SoftplusMlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward for SoftplusMlp {
    fn forward(&self, x: &Var) -> Result<Var> {
        self.fc2.forward(&softplus(&self.fc1.forward(x)?)?)
    }
}

fn main() -> Result<()> {
    // 1. The gradient against central differences in float64, on values across both branches.
    let x = Tensor::from_vec(
        vec![-3.0f64, -0.5, 0.0, 0.25, 2.0, 7.5],
        (2, 3),
        Device::Cpu,
    )?;
    gradcheck(
        |v| softplus(&v[0]),
        std::slice::from_ref(&x),
        GradcheckOptions::default(),
    )?;
    println!("gradcheck: softplus backward matches finite differences");

    // 2. The forward against the textbook formula.
    let y = softplus(&Var::constant(x.clone()))?
        .tensor()
        .to_vec::<f64>()?;
    for (a, b) in x.to_vec::<f64>()?.iter().zip(&y) {
        let reference = (1.0 + a.exp()).ln();
        assert!(
            (reference - b).abs() < 1e-12,
            "softplus({a}) = {b}, expected {reference}"
        );
    }
    println!("forward: matches log(1 + exp(x))");

    // 3. Inside a model: a few steps of regression to y = |x|.
    let model = ParamBuilder::new(3).build(|p| {
        Ok(SoftplusMlp {
            fc1: Linear::new(p, 1, 16)?,
            fc2: Linear::new(p, 16, 1)?,
        })
    })?;
    let xs: Vec<f32> = (0..32).map(|i| i as f32 / 8.0 - 2.0).collect();
    let ys: Vec<f32> = xs.iter().map(|x| x.abs()).collect();
    let inputs = Var::constant(Tensor::from_vec(xs, (32, 1), Device::Cpu)?);
    let targets = Var::constant(Tensor::from_vec(ys, (32, 1), Device::Cpu)?);
    let mut opt = AdamW::for_module(&model).weight_decay(0.0).build()?;
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..300 {
        let loss = model.forward(&inputs)?.sub(&targets)?.sqr()?.mean_all()?;
        opt.zero_grad();
        loss.backward()?;
        opt.step(1e-2)?;
        last = loss.tensor().item()?;
        first.get_or_insert(last);
    }
    println!(
        "regression to |x|: mse {:.4} -> {last:.4}",
        first.unwrap_or(last)
    );
    if last >= first.unwrap_or(last) {
        return Err(Error::msg(
            "training with the custom op did not reduce the loss",
        ));
    }
    Ok(())
}
