//! A Llama-style decoder written only with meshgrad's public API and `#[derive(Module)]` (no
//! hand-written parameter visiting): token embeddings, pre-norm blocks with RMSNorm, rotary
//! position embeddings on q and k, causal fused attention, a SwiGLU feed-forward, an untied
//! output head. Trains for a few steps on the built-in corpus (bytes) and checks that the loss
//! falls.
//!
//! ```text
//! cargo run --release --example llama_style [-- STEPS]     (default 100)
//! ```

use meshgrad::corpus::builtin_dataset;
use meshgrad::prelude::*;
use meshgrad::tensor::AttentionMask;

/// Model hyper-parameters.
#[derive(Clone, Copy, Debug)]
struct LlamaConfig {
    vocab: usize,
    dim: usize,
    n_layers: usize,
    n_heads: usize,
    hidden: usize,
    rope_theta: f64,
    eps: f64,
}

/// `x / rms(x) * weight`.
#[derive(Module)]
struct RmsNorm {
    weight: Var,
    eps: f64,
}

impl RmsNorm {
    fn new(p: &ParamBuilder, dim: usize, eps: f64) -> Result<Self> {
        Ok(RmsNorm {
            weight: p.param(dim, Init::Ones)?,
            eps,
        })
    }
}

impl Forward for RmsNorm {
    fn forward(&self, x: &Var) -> Result<Var> {
        x.rms_norm(Some(&self.weight), self.eps)
    }
}

/// Multi-head causal self-attention with rotary embeddings on q and k.
#[derive(Module)]
struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    n_heads: usize,
    theta: f64,
}

impl Attention {
    fn new(p: &ParamBuilder, c: &LlamaConfig) -> Result<Self> {
        let proj = |i, o| LinearConfig::new(i, o).bias(false).build(p);
        Ok(Attention {
            wq: proj(c.dim, c.dim)?,
            wk: proj(c.dim, c.dim)?,
            wv: proj(c.dim, c.dim)?,
            wo: proj(c.dim, c.dim)?,
            n_heads: c.n_heads,
            theta: c.rope_theta,
        })
    }
}

impl Forward for Attention {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let (b, t) = (x.tensor().dims()[0], x.tensor().dims()[1]);
        let h = self.n_heads;
        let positions = Tensor::arange(0, t as i64, DType::I64, Device::Cpu)?;
        // [B, T, C] -> [B, T, H, D]; rotary on q and k; then heads first: [B, H, T, D].
        let heads = |v: Var| v.reshape((b, t, h, -1));
        let q = heads(self.wq.forward(x)?)?.rotary_embedding(&positions, self.theta)?;
        let k = heads(self.wk.forward(x)?)?.rotary_embedding(&positions, self.theta)?;
        let v = heads(self.wv.forward(x)?)?;
        let d = q.tensor().dims()[3];
        let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
        let y = Var::attention(
            &q,
            &k,
            &v,
            &AttentionMask::causal(),
            1.0 / (d as f64).sqrt(),
        )?;
        self.wo.forward(&y.transpose(1, 2)?.reshape((b, t, -1))?)
    }
}

/// `w2(silu(w1 x) * w3 x)`.
#[derive(Module)]
struct FeedForward {
    w1: Linear,
    w2: Linear,
    w3: Linear,
}

impl Forward for FeedForward {
    fn forward(&self, x: &Var) -> Result<Var> {
        let gated = Var::swiglu(&self.w1.forward(x)?, &self.w3.forward(x)?)?;
        self.w2.forward(&gated)
    }
}

/// A pre-norm decoder block.
#[derive(Module)]
struct TransformerBlock {
    attention_norm: RmsNorm,
    attention: Attention,
    ffn_norm: RmsNorm,
    feed_forward: FeedForward,
}

impl Forward for TransformerBlock {
    fn forward(&self, x: &Var) -> Result<Var> {
        let h = (x + self.attention.forward(&self.attention_norm.forward(x)?)?)?;
        &h + self.feed_forward.forward(&self.ffn_norm.forward(&h)?)?
    }
}

/// The whole model; parameter names follow Meta's Llama checkpoints (`layers.0.attention.wq.weight`).
#[derive(Module)]
struct Llama {
    tok_embeddings: Embedding,
    layers: Vec<TransformerBlock>,
    norm: RmsNorm,
    output: Linear,
}

impl Llama {
    fn new(c: LlamaConfig, seed: u64) -> Result<Self> {
        ParamBuilder::new(seed).build(|p| {
            let no_bias = |i, o| LinearConfig::new(i, o).bias(false).build(p);
            Ok(Llama {
                tok_embeddings: Embedding::new(p, c.vocab, c.dim, 0.02)?,
                layers: (0..c.n_layers)
                    .map(|_| {
                        Ok(TransformerBlock {
                            attention_norm: RmsNorm::new(p, c.dim, c.eps)?,
                            attention: Attention::new(p, &c)?,
                            ffn_norm: RmsNorm::new(p, c.dim, c.eps)?,
                            feed_forward: FeedForward {
                                w1: no_bias(c.dim, c.hidden)?,
                                w2: no_bias(c.hidden, c.dim)?,
                                w3: no_bias(c.dim, c.hidden)?,
                            },
                        })
                    })
                    .collect::<Result<_>>()?,
                norm: RmsNorm::new(p, c.dim, c.eps)?,
                output: no_bias(c.dim, c.vocab)?,
            })
        })
    }

    /// Mean next-token cross-entropy of `ids [B, T]` against `targets [B, T]`.
    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Var> {
        let mut x = self.tok_embeddings.forward(ids)?;
        for layer in &self.layers {
            x = layer.forward(&x)?;
        }
        let logits = self.output.forward(&self.norm.forward(&x)?)?; // [B, T, V]
        logits.cross_entropy(targets, None)
    }
}

fn main() -> Result<()> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| {
            s.parse()
                .map_err(|_| Error::msg(format!("STEPS must be a number, got {s}")))
        })
        .transpose()?
        .unwrap_or(100);
    let cfg = LlamaConfig {
        vocab: 256,
        dim: 96,
        n_layers: 3,
        n_heads: 4,
        hidden: 256,
        rope_theta: 10_000.0,
        eps: 1e-5,
    };
    let model = Llama::new(cfg, 7)?;
    println!("{cfg:?}: {} parameters", model.num_parameters());
    println!(
        "first names: {:?}",
        &model
            .named_parameters()
            .iter()
            .take(4)
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
    );

    let (batch, seq, seed) = (8usize, 64usize, 7u64);
    let data = builtin_dataset();
    let mut opt = AdamW::for_module(&model)
        .weight_decay(0.1)
        .betas(0.9, 0.95)
        .build()?;
    let mut first = None;
    let mut last = f64::NAN;
    for step in 0..steps {
        let b = data.batch(seed, step as u64, 0..batch as u64, seq)?;
        let ids = Tensor::from_slice(&b.inputs, (batch, seq), Device::Cpu)?;
        let targets = Tensor::from_slice(&b.targets, (batch, seq), Device::Cpu)?;
        let loss = model.loss(&ids, &targets)?;
        opt.zero_grad();
        loss.backward()?;
        clip_grad_norm(&model.parameters(), 1.0)?;
        opt.step(3e-3)?;
        last = loss.tensor().item()?;
        first.get_or_insert(last);
        if step % 25 == 0 {
            println!("step {step}: loss {last:.4}");
        }
    }
    let first = first.unwrap_or(last);
    println!(
        "loss {first:.4} -> {last:.4} in {steps} steps (ln 256 = {:.4})",
        256f64.ln()
    );
    if steps >= 10 && last >= first {
        return Err(Error::msg("the loss did not fall"));
    }
    Ok(())
}
