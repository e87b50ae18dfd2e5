//! # Writing a model with meshgrad
//!
//! A short guide, from a layer to a sharded training run. Every example here is compiled and
//! run by `cargo test --doc`. The runnable programs in `examples/` go further: `train_gpt`,
//! `train_bert`, `llama_style`, `custom_op` and `fsdp_from_code`.
//! The last section drives `meshgrad train` itself from code: a Llama, then its fine-tuning.
//!
//! ## 1. A model is a struct that derives `Module`
//!
//! Fields that are parameters (`Var`) or modules are visited under their field names, so each
//! name is written once; `Vec<T>` elements are named `field.0`, `field.1`, ...; `Option<T>` is
//! visited when present; plain data (sizes, flags) is ignored. Parameters are created through a
//! [`ParamBuilder`](crate::nn::ParamBuilder), which initialises each one from the run seed and its
//! full name once the model is built (so the values never depend on creation order or sharding)
//! and reports any parameter the model cannot reach.
//!
//! ```
//! use meshgrad::prelude::*;
//!
//! #[derive(Module)]
//! struct RmsNorm {
//!     weight: Var,
//!     eps: f64,
//! }
//!
//! impl Forward for RmsNorm {
//!     fn forward(&self, x: &Var) -> Result<Var> {
//!         // Operators return Result and chain; `?` where a value is needed.
//!         let inv_rms = (x.sqr()?.mean(&[-1], true)? + self.eps)?.powf(-0.5)?;
//!         x * inv_rms * &self.weight
//!     }
//! }
//!
//! #[derive(Module)]
//! struct Block {
//!     norm: RmsNorm,
//!     mlp: Sequential,
//! }
//!
//! impl Forward for Block {
//!     fn forward(&self, x: &Var) -> Result<Var> {
//!         x + self.mlp.forward(&self.norm.forward(x)?)?
//!     }
//! }
//!
//! #[derive(Module)]
//! struct Net {
//!     blocks: Vec<Block>,
//!     head: Linear,
//! }
//!
//! let net = ParamBuilder::new(42).build(|p| {
//!     let block = |_| -> Result<Block> {
//!         Ok(Block {
//!             norm: RmsNorm { weight: p.param(16, Init::Ones)?, eps: 1e-6 },
//!             mlp: Sequential::new()
//!                 .push(Linear::new(p, 16, 64)?)
//!                 .push(Activation::Gelu)
//!                 .push(Linear::new(p, 64, 16)?),
//!         })
//!     };
//!     Ok(Net { blocks: (0..2).map(block).collect::<Result<_>>()?, head: Linear::new(p, 16, 4)? })
//! })?;
//! let names: Vec<String> = net.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(&names[..3], ["blocks.0.norm.weight", "blocks.0.mlp.0.weight", "blocks.0.mlp.0.bias"]);
//! assert_eq!(net.module_paths()[1], "blocks.0");
//! # Ok::<(), meshgrad::tensor::Error>(())
//! ```
//!
//! The fused ops a modern model needs are there: `rms_norm`, `rotary_embedding`, `swiglu`,
//! `silu`, `layer_norm`, [`Var::attention`](crate::autograd::Var::attention) with causal,
//! key-padding and additive-bias masks ([`AttentionMask`](crate::tensor::AttentionMask)),
//! `cross_entropy` over `[..., V]` logits with an ignore index, `gather` / `index_select`,
//! `logsumexp`, `clamp`, `sin` / `cos`. Tensors print their values (`println!("{t}")`), and
//! `reshape` takes one inferred dimension: `x.reshape((b, t, -1))`.
//!
//! ## 2. Training
//!
//! Optimizers are built from a module with defaults ([`AdamW::for_module`](crate::nn::optim::AdamW::for_module));
//! frozen parameters ([`Module::freeze`](crate::nn::Module::freeze)) get no gradient and are left
//! out. Dropout needs no argument: its masks are keyed by the layer's path, the
//! [`ForwardCtx`](crate::autograd::ForwardCtx) (step and first global row) and how often the layer
//! was used in the current forward, so a second use draws a fresh mask, a loop that never sets a
//! context still advances, and a batch split across ranks or microbatches sees the masks of the
//! single-device run.
//!
//! ```
//! use meshgrad::prelude::*;
//!
//! let model = ParamBuilder::new(0).build(|p| {
//!     Ok(Sequential::new().push(Linear::new(p, 2, 8)?).push(Dropout::new(0.1)?).push(Linear::new(p, 8, 1)?))
//! })?;
//! model.freeze("0")?; // the first layer stays as initialised
//! let mut opt = AdamW::for_module(&model).weight_decay(0.0).build()?;
//! let x = Var::constant(Tensor::randn((16, 2), 1)?);
//! let y = Var::constant(Tensor::randn((16, 1), 2)?);
//! for step in 0..20u64 {
//!     let loss = ForwardCtx::new(step, 0).scope(|| (model.forward(&x)? - &y)?.sqr()?.mean_all())?;
//!     opt.zero_grad();
//!     loss.backward()?;
//!     clip_grad_norm(&model.parameters(), 1.0)?;
//!     opt.step(1e-2)?;
//! }
//! let path = std::env::temp_dir().join(format!("meshgrad_guide_{}.safetensors", std::process::id()));
//! model.save(&path)?; // atomic
//! model.load(&path)?; // strict: names and shapes must match
//! # std::fs::remove_file(&path).ok();
//! # Ok::<(), meshgrad::tensor::Error>(())
//! ```
//!
//! ## 3. Custom ops
//!
//! An op with its own backward implements [`Function`](crate::autograd::Function) and joins the
//! graph through [`apply`](crate::autograd::apply); [`gradcheck`](crate::autograd::gradcheck)
//! checks it against central differences in float64. See `examples/custom_op.rs`.
//!
//! ## 4. Data parallel and fully sharded, from code
//!
//! [`run_ranks`](crate::parallel::run_ranks) starts ranks as threads with an in-process
//! communicator. [`Ddp`](crate::parallel::Ddp) averages gradients during backward;
//! [`ShardedDataParallel`](crate::parallel::ShardedDataParallel) shards optimizer state (ZeRO-1),
//! gradients (ZeRO-2) and parameters (ZeRO-3 / FSDP) of any `Module`, with any optimizer
//! ([`OptimizerFactory`](crate::parallel::zero::OptimizerFactory): an `AdamWConfig`, an
//! `SgdConfig` or a closure) over each rank's shard. ZeRO-3 units are chosen by
//! module path ([`WrapPolicy`](crate::parallel::zero::WrapPolicy): `paths(["blocks.*"])`, or the
//! default that takes the elements of the model's first module list); a unit is gathered when
//! its parameters are first read and released when the next one is, so the model's forward needs
//! no hooks. Each rank passes its rows of the global batch; the run matches the single device to
//! rounding. See `examples/fsdp_from_code.rs` and the crate docs of `meshgrad::parallel::zero`.
//!
//! ## 5. Training a Llama and fine-tuning it, from code
//!
//! [`train::train`](crate::train::train) is `meshgrad train` as a function: a
//! [`TrainConfig`](crate::config::TrainConfig) (every key of `configs/tiny.toml` and `--set`), an
//! optional layout, the run options. The model kind picks the family's recipe; the layout does
//! not change the code. [`TrainOptions::init_from`](crate::run_setup::TrainOptions::init_from)
//! starts from a model folder (here the one the first run wrote, a Hugging Face
//! `LlamaForCausalLM` folder) with a fresh optimizer: its first validation loss is the first
//! run's last (to rounding), although it runs on two ranks that each hold half of every parameter.
//!
//! ```
//! use meshgrad::config::TrainConfig;
//! use meshgrad::run_setup::{TrainOptions, Verbosity};
//! use meshgrad::train::train;
//!
//! let mut cfg = TrainConfig::default();
//! for (key, value) in [
//!     ("model.kind", "llama"), ("model.n_layer", "2"), ("model.n_embd", "32"),
//!     ("model.n_head", "4"), ("model.n_kv_head", "2"), ("model.block_size", "16"),
//!     ("train.steps", "3"), ("train.batch_size", "4"), ("train.eval_batches", "1"),
//!     ("train.sample_tokens", "0"),
//! ] {
//!     cfg.apply_override(key, value)?;
//! }
//! let dir = std::env::temp_dir().join(format!("meshgrad_guide_llama_{}", std::process::id()));
//! cfg.out = dir.join("pretrained").display().to_string();
//! let pretrained = train(&cfg, None, &TrainOptions::default(), Verbosity::Quiet)?;
//!
//! let mut tune = cfg.clone();
//! tune.out = dir.join("tuned").display().to_string();
//! (tune.train.lr, tune.train.min_lr) = (1e-4, 1e-5);
//! let opts = TrainOptions { init_from: Some(dir.join("pretrained")), ..TrainOptions::default() };
//! let layout = "fsdp=2".parse()?;
//! let tuned = train(&tune, Some(&layout), &opts, Verbosity::Quiet)?;
//! // To rounding: each rank averages its half of the validation rows.
//! assert!((tuned.initial_val_loss - pretrained.final_val_loss).abs() < 1e-5);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
