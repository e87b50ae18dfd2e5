//! Training configuration for `meshgrad train`.
//!
//! A [`TrainConfig`] is read from a TOML file with the tables `[model]`, `[train]` and `[data]` and
//! the top-level keys `out` and `metrics`. Every key is optional (missing keys take the defaults
//! of [`TrainConfig::default`], a small byte-level GPT that trains in a few minutes on two CPU
//! cores) and unknown keys are errors. `configs/tiny.toml` writes the defaults out with comments.
//!
//! The usual flow is:
//!
//! ```text
//! let mut config = TrainConfig::from_toml_file(path)?;   // or TrainConfig::default()
//! config.apply_override("train.steps", "500")?;          // from --set train.steps=500 or --steps
//! config.validate()?;
//! ```
//!
//! Every error message is one line and names the file and the key involved.
//!
//! This module depends only on `serde`, `serde_json` and `toml`. Every key is written once, as a
//! field of the structs below: the keys `--set` accepts are read from their serde form
//! ([`TrainConfig::keys`]).

mod keys;

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The model's shape: a GPT-style decoder (`kind = "gpt"`), a BERT encoder trained by masked
/// language modelling (`kind = "bert"`) or a Llama decoder (`kind = "llama"`: RMSNorm, rotary
/// position embeddings, a SwiGLU MLP, grouped-query attention, no biases and no dropout), or a
/// Mixtral (`kind = "mixtral"`: a Llama whose feed-forwards are mixtures of experts).
///
/// The keys `n_kv_head`, `intermediate_size`, `rope_theta`, `norm_eps` and `tie_embeddings` are
/// the Llama family's (Mixtral's too); a GPT or BERT config must leave them at their defaults
/// (see [`TrainConfig::validate`]). The keys `n_experts`, `experts_per_token`,
/// `router_aux_loss_coef` and `expert_capacity_factor` are Mixtral's; every other kind must
/// leave them at their defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Number of transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; must divide `n_embd`.
    pub n_head: usize,
    /// Width of the residual stream (embedding size).
    pub n_embd: usize,
    /// Context length: the longest sequence the model sees, and the training window length.
    pub block_size: usize,
    /// Number of token ids; 256 for byte-level text.
    pub vocab_size: usize,
    /// The model's vocabulary (its embedding rows and logits) is its token count rounded up to
    /// a multiple of this; 1, the default, pads nothing. Padding lets tensor parallelism split a
    /// vocabulary it does not divide (GPT-2's 50257, BERT's byte-level 261), as Megatron-LM's
    /// `make-vocab-size-divisible-by` does. The padded ids never occur in the data and are never
    /// sampled; their logits take part in the softmax (they learn to stay low).
    pub vocab_multiple: usize,
    /// Dropout probability, in [0, 1). A Llama has no dropout: it must be 0 there.
    pub dropout: f64,
    /// Whether linear and layer-norm layers have bias terms. A BERT always has them; the Llama
    /// family has no biases at all, so a Llama ignores this key.
    pub bias: bool,
    /// The model family: `"gpt"` (next-token prediction), `"bert"` (masked language modelling;
    /// see `crate::recipe_bert`) or `"llama"` (next-token prediction with a Llama decoder,
    /// `meshgrad_nn::llama`; see `crate::recipe_causal`).
    pub kind: ModelKind,
    /// Llama only: key/value heads per block (grouped-query attention: each serves
    /// `n_head / n_kv_head` query heads); must divide `n_head`. 0, the default, means `n_head`
    /// (multi-head attention); see [`ModelConfig::kv_heads`].
    pub n_kv_head: usize,
    /// Llama only: the hidden width of the SwiGLU MLP. 0, the default, means Llama's rule
    /// `256 * ceil(ceil(8 * n_embd / 3) / 256)` (as `meshgrad_nn::llama::LlamaConfig::new`); see
    /// [`ModelConfig::ffn_hidden`].
    pub intermediate_size: usize,
    /// Llama only: the base of the rotary position embedding's angles (10000, the default, as
    /// Llama 2; 500000 in Llama 3). Finite and > 0.
    pub rope_theta: f64,
    /// Llama only: the RMSNorm epsilon (default 1e-5). Finite and > 0.
    pub norm_eps: f64,
    /// Whether the output head is the token embedding table. Left out (`None`, the default):
    /// the family's default, untied for a Llama; a GPT and a BERT always tie their head to the
    /// token table, so for them only `true` is accepted. See [`ModelConfig::tied`].
    pub tie_embeddings: Option<bool>,
    /// Mixtral only: experts per layer (default 8). At least 1.
    pub n_experts: usize,
    /// Mixtral only: experts each token goes to (default 2); in `1..=n_experts`.
    pub experts_per_token: usize,
    /// Mixtral only: the load-balancing loss's coefficient in the training objective (default
    /// 0.02, Mixtral 8x7B's); finite and >= 0. A training setting: `--set` may change it for a
    /// run started from (`--init-from`) a model folder.
    pub router_aux_loss_coef: f64,
    /// Mixtral only: each expert takes at most `ceil(factor * block_size * experts_per_token /
    /// n_experts)` token copies of a sequence and drops the rest (counted in the metrics).
    /// Unset, the default: dropless. Finite and > 0.
    pub expert_capacity_factor: Option<f64>,
}

/// The model family a config trains: the one place a kind is named as text (`"gpt"`, `"bert"`,
/// `"llama"`, in config files, `--model` and checkpoint metadata).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A GPT-2-style decoder trained on next-token prediction.
    #[default]
    Gpt,
    /// A BERT encoder trained by masked language modelling.
    Bert,
    /// A Llama decoder (`meshgrad_nn::llama`) trained on next-token prediction.
    Llama,
    /// A Mixtral (`meshgrad_nn::mixtral`): a Llama with mixture-of-experts feed-forwards,
    /// trained on next-token prediction.
    Mixtral,
}

impl ModelKind {
    /// The kind as the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelKind::Gpt => "gpt",
            ModelKind::Bert => "bert",
            ModelKind::Llama => "llama",
            ModelKind::Mixtral => "mixtral",
        }
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ModelKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "gpt" => Ok(ModelKind::Gpt),
            "bert" => Ok(ModelKind::Bert),
            "llama" => Ok(ModelKind::Llama),
            "mixtral" => Ok(ModelKind::Mixtral),
            other => Err(format!(
                "unknown model kind {other:?} (expected gpt, bert, llama or mixtral)"
            )),
        }
    }
}

impl ModelConfig {
    /// The model's vocabulary for `ids` token ids: `ids` rounded up to a multiple of
    /// [`ModelConfig::vocab_multiple`] (`ids` itself when that is 0 or 1).
    pub fn padded_vocab(&self, ids: usize) -> usize {
        ids.div_ceil(self.vocab_multiple.max(1)) * self.vocab_multiple.max(1)
    }

    /// The keys that fix the model's shape (its parameters' names and sizes), with their
    /// resolved values as text: what a resumed run or a run started from a model folder must
    /// keep (see `train --resume` and `train --init-from`).
    pub fn shape_keys(&self) -> [(&'static str, String); 15] {
        [
            ("model.kind", self.kind.to_string()),
            ("model.n_layer", self.n_layer.to_string()),
            ("model.n_head", self.n_head.to_string()),
            ("model.n_embd", self.n_embd.to_string()),
            ("model.block_size", self.block_size.to_string()),
            ("model.vocab_size", self.vocab_size.to_string()),
            ("model.vocab_multiple", self.vocab_multiple.to_string()),
            ("model.bias", self.bias.to_string()),
            ("model.n_kv_head", self.kv_heads().to_string()),
            ("model.intermediate_size", self.ffn_hidden().to_string()),
            ("model.rope_theta", self.rope_theta.to_string()),
            ("model.norm_eps", self.norm_eps.to_string()),
            ("model.tie_embeddings", self.tied().to_string()),
            ("model.n_experts", self.n_experts.to_string()),
            (
                "model.experts_per_token",
                self.experts_per_token.to_string(),
            ),
        ]
    }

    /// Key/value heads per block: [`ModelConfig::n_kv_head`], or `n_head` when that is 0 (always
    /// `n_head` for a GPT or a BERT, whose `n_kv_head` is 0).
    pub fn kv_heads(&self) -> usize {
        if self.n_kv_head == 0 {
            self.n_head
        } else {
            self.n_kv_head
        }
    }

    /// The MLP's hidden width: [`ModelConfig::intermediate_size`], or when that is 0 the
    /// family's: Llama's rule `256 * ceil(ceil(8 * n_embd / 3) / 256)` (the same as
    /// `meshgrad_nn::llama::LlamaConfig::new`; 512 for `n_embd = 128`, 11008 for 4096), or
    /// `4 * n_embd` for a GPT and a BERT.
    pub fn ffn_hidden(&self) -> usize {
        match (self.intermediate_size, self.kind) {
            (0, ModelKind::Llama | ModelKind::Mixtral) => {
                (8 * self.n_embd).div_ceil(3).div_ceil(256) * 256
            }
            (0, ModelKind::Gpt | ModelKind::Bert) => 4 * self.n_embd,
            (n, _) => n,
        }
    }

    /// Whether the output head is the token embedding table: [`ModelConfig::tie_embeddings`],
    /// or when that is unset the family's default: tied for a GPT and a BERT, untied for a
    /// Llama.
    pub fn tied(&self) -> bool {
        self.tie_embeddings
            .unwrap_or(self.kind.ties_embeddings_by_default())
    }
}

/// The default of [`ModelConfig::rope_theta`].
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The default of [`ModelConfig::norm_eps`].
pub const DEFAULT_NORM_EPS: f64 = 1e-5;

impl ModelKind {
    /// Whether the family's output head is its token table when `tie_embeddings` is left out:
    /// true for GPT and BERT, false for Llama.
    pub fn ties_embeddings_by_default(self) -> bool {
        match self {
            ModelKind::Gpt | ModelKind::Bert => true,
            ModelKind::Llama | ModelKind::Mixtral => false,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            n_layer: 4,
            n_head: 4,
            n_embd: 128,
            block_size: 128,
            vocab_size: 256,
            vocab_multiple: 1,
            dropout: 0.0,
            bias: true,
            kind: ModelKind::Gpt,
            n_kv_head: 0,
            intermediate_size: 0,
            rope_theta: DEFAULT_ROPE_THETA,
            norm_eps: DEFAULT_NORM_EPS,
            tie_embeddings: None,
            n_experts: DEFAULT_N_EXPERTS,
            experts_per_token: DEFAULT_EXPERTS_PER_TOKEN,
            router_aux_loss_coef: DEFAULT_ROUTER_AUX_LOSS_COEF,
            expert_capacity_factor: None,
        }
    }
}

/// The default of [`ModelConfig::n_experts`].
pub const DEFAULT_N_EXPERTS: usize = 8;
/// The default of [`ModelConfig::experts_per_token`].
pub const DEFAULT_EXPERTS_PER_TOKEN: usize = 2;
/// The default of [`ModelConfig::router_aux_loss_coef`].
pub const DEFAULT_ROUTER_AUX_LOSS_COEF: f64 = 0.02;

/// The optimisation loop: steps, batch, AdamW and its learning-rate schedule, evaluation and
/// logging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainParams {
    /// Number of optimizer steps.
    pub steps: usize,
    /// Global batch size, in sequences of `model.block_size` tokens.
    pub batch_size: usize,
    /// Peak learning rate, reached at the end of warmup.
    pub lr: f64,
    /// Final learning rate of the cosine decay; in [0, lr].
    pub min_lr: f64,
    /// Steps of linear warmup from 0 to `lr`; a run shorter than this warms up over all its steps.
    pub warmup_steps: usize,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// AdamW first-moment decay, in [0, 1).
    pub beta1: f64,
    /// AdamW second-moment decay, in [0, 1).
    pub beta2: f64,
    /// Clip the global gradient norm to this value; 0 disables clipping.
    pub grad_clip: f64,
    /// Seed of weight initialisation, dropout and the data sampler.
    pub seed: u64,
    /// Evaluate on the validation split every this many steps; 0 evaluates only at the end.
    pub eval_interval: usize,
    /// Batches of `batch_size` windows per evaluation.
    pub eval_batches: usize,
    /// Print the training loss every this many steps.
    pub log_interval: usize,
    /// Bytes (tokens) of text to sample from the trained model at the end; 0 disables sampling.
    pub sample_tokens: usize,
    /// Where the model trains: `"cpu"`, `"cuda"` (device 0) or `"cuda:N"`.
    pub device: String,
    /// Training precision: `"f32"`, `"bf16"` (bf16 weights and activations, f32 master weights
    /// and AdamW state) or `"f16"` (the same in f16, with dynamic loss scaling).
    pub precision: String,
    /// f16 only: the initial loss scale (default 2^16); halved at every step whose gradients
    /// overflow, doubled after 2000 consecutive good steps. Finite and > 0.
    pub loss_scale_init: f64,
    /// Reference mode: every floating-point sum whose order a layout could change (gradients and
    /// losses over the batch, gradient norms, and the sums tensor parallelism splits, cut into
    /// the GPT's reference chunks: the largest power of two dividing `n_head`, `vocab_size` and
    /// `block_size`) follows one fixed order, so the run is bit-identical under every supported
    /// layout for the same seed, global batch and `row_group`.
    pub reference: bool,
    /// Reference mode: sequences per row group, the unit whose gradient is computed in one
    /// forward and backward pass before row groups are summed in a fixed binary tree. Divides
    /// `batch_size`; the layout and `--microbatches` only decide which rank computes which part
    /// of the tree.
    pub row_group: usize,
    /// Reference mode: the chunk count of the sums tensor parallelism splits (see README's
    /// "Reference mode"); 0 (default) takes the model's, the largest power of two dividing
    /// `n_head`, `vocab_size` and `block_size`; 1 uses no chunked sums (cheaper, and then no
    /// tensor parallelism). Runs compare bit for bit only with the same count.
    pub reference_chunks: usize,
    /// Reference mode: the order of the sums over a sequence's positions. `"sequence"`
    /// (default): trees over `train.reference_chunks` chunks in sequence order, what tensor
    /// parallelism's sequence parallelism needs. `"folded"`: trees over the chunk count's
    /// position leaves, leaf `j` being chunks `j` and `2K - 1 - j` of `2K`, each layer run once
    /// per leaf; what context parallelism (`cp` in `--layout`) needs. Runs compare bit for bit
    /// only with the same order.
    pub reference_positions: String,
}

impl Default for TrainParams {
    fn default() -> Self {
        TrainParams {
            steps: 300,
            batch_size: 16,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup_steps: 30,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            grad_clip: 1.0,
            seed: 1337,
            eval_interval: 100,
            eval_batches: 8,
            log_interval: 10,
            sample_tokens: 200,
            device: "cpu".to_string(),
            precision: "f32".to_string(),
            loss_scale_init: 65536.0,
            reference: false,
            row_group: 1,
            reference_chunks: 0,
            reference_positions: "sequence".to_string(),
        }
    }
}

/// Where the training tokens come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// The training data (see `meshgrad_nn::data::DataFormat`): a folder of llm.c token shards
    /// (`*_val_*` shards are the validation set), a `.bin` file (an llm.c shard if it starts with
    /// the shard header, little-endian `u16` ids otherwise), a `.jsonl` file (a `text` field per
    /// line), or any other file as text. `None` (the key left out) means the built-in corpus,
    /// `assets/corpus.txt`.
    pub path: Option<String>,
    /// Fraction of the tokens, taken from the end, held out for validation; in (0, 1). Not used
    /// for a folder of shards that has validation shards.
    pub val_fraction: f64,
    /// A `tokenizer.json` (Hugging Face format) that text and JSONL data go through; the model's
    /// vocabulary size becomes the tokenizer's. `None`: text is byte-level (vocabulary 256).
    pub tokenizer: Option<String>,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: None,
            val_fraction: 0.1,
            tokenizer: None,
        }
    }
}

/// The whole configuration of a `meshgrad train` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Directory for checkpoints and the resolved config.
    pub out: String,
    /// Optional file to which per-step metrics are written (JSON lines).
    pub metrics: Option<String>,
    /// The `[model]` table.
    pub model: ModelConfig,
    /// The `[train]` table.
    pub train: TrainParams,
    /// The `[data]` table.
    pub data: DataConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            out: "runs/latest".to_string(),
            metrics: None,
            model: ModelConfig::default(),
            train: TrainParams::default(),
            data: DataConfig::default(),
        }
    }
}

/// Errors from reading, overriding and validating a [`TrainConfig`]. Each message is one line.
#[derive(Debug)]
pub enum ConfigError {
    /// The config file could not be read.
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// The TOML is malformed, has an unknown key, or a value of the wrong type.
    Parse {
        /// The file (or other origin) of the TOML text.
        origin: String,
        /// 1-based line of the error, when known.
        line: Option<usize>,
        /// 1-based column of the error, when known.
        column: Option<usize>,
        /// Dotted key at the error (e.g. `train.steps`), when it can be told.
        key: Option<String>,
        /// The parser's message, on one line.
        message: String,
    },
    /// An override names a key that does not exist.
    UnknownKey {
        /// The key as given.
        key: String,
        /// The closest known key, if one is close.
        suggestion: Option<String>,
    },
    /// An override's value cannot be parsed as the key's type.
    BadValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What the key takes, e.g. "a non-negative integer".
        expected: String,
    },
    /// An override that is not of the form `key=value`.
    BadAssignment {
        /// The text as given.
        text: String,
    },
    /// A value that parses but is not allowed (see [`TrainConfig::validate`]).
    Invalid {
        /// The key, or keys, at fault.
        key: String,
        /// Why, naming the values.
        message: String,
    },
    /// The config could not be written as TOML.
    Serialize {
        /// The serializer's message.
        message: String,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Io { path, error } => {
                write!(f, "cannot read config file {}: {error}", path.display())
            }
            ConfigError::Parse {
                origin,
                line,
                column,
                key,
                message,
            } => {
                write!(f, "invalid config {origin}")?;
                if let Some(line) = line {
                    write!(f, ", line {line}")?;
                    if let Some(column) = column {
                        write!(f, ", column {column}")?;
                    }
                }
                if let Some(key) = key {
                    write!(f, ", key `{key}`")?;
                }
                write!(f, ": {message}")
            }
            ConfigError::UnknownKey { key, suggestion } => {
                write!(f, "unknown config key `{key}`")?;
                match suggestion {
                    Some(s) => write!(f, "; did you mean `{s}`?"),
                    None => write!(f, "; known keys: {}", TrainConfig::keys().join(", ")),
                }
            }
            ConfigError::BadValue {
                key,
                value,
                expected,
            } => write!(
                f,
                "invalid value {value:?} for config key `{key}`: expected {expected}"
            ),
            ConfigError::BadAssignment { text } => {
                write!(
                    f,
                    "invalid config override {text:?}: expected KEY=VALUE, e.g. train.steps=500"
                )
            }
            ConfigError::Invalid { key, message } => {
                write!(f, "invalid config value for `{key}`: {message}")
            }
            ConfigError::Serialize { message } => {
                write!(f, "cannot write config as TOML: {message}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// The largest integer a TOML file holds (TOML integers are signed 64-bit).
pub const MAX_TOML_INT: u64 = i64::MAX as u64;

impl TrainConfig {
    /// Reads and parses a TOML config file. Keys left out take their defaults.
    ///
    /// It does not call [`TrainConfig::validate`]: apply overrides first, then validate.
    pub fn from_toml_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        TrainConfig::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses TOML text; `origin` names it in error messages (a file name, or e.g. `"<string>"`).
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|err| {
            let (line, column, key) = match err.span() {
                Some(span) => locate(text, span),
                None => (None, None, None),
            };
            ConfigError::Parse {
                origin: origin.to_string(),
                line,
                column,
                key,
                message: one_line(err.message()),
            }
        })
    }

    /// The config as TOML text (for saving the resolved config next to a checkpoint). Keys whose
    /// value is `None` are left out.
    pub fn to_toml_string(&self) -> Result<String, ConfigError> {
        toml::to_string(self).map_err(|err| ConfigError::Serialize {
            message: one_line(&err.to_string()),
        })
    }

    /// Applies a `KEY=VALUE` assignment, as given to `--set`; see [`TrainConfig::apply_override`].
    pub fn apply_assignment(&mut self, assignment: &str) -> Result<(), ConfigError> {
        match assignment.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => self.apply_override(key.trim(), value),
            _ => Err(ConfigError::BadAssignment {
                text: assignment.to_string(),
            }),
        }
    }

    /// Checks the values, returning the first problem found as a one-line
    /// [`ConfigError::Invalid`] that names the key and the value(s).
    ///
    /// Checks: a BERT (`model.kind = "bert"`) has `bias` and a `block_size` of at least 3; all
    /// sizes and counts positive (`eval_interval` and `sample_tokens` may be 0);
    /// every integer at most [`MAX_TOML_INT`] (what the saved TOML can hold, so a run never
    /// fails to save its config after training); `n_embd` divisible by `n_head`;
    /// `vocab_size >= 256` for byte-level data (no tokenizer, and no path or a path that is
    /// neither a `.bin` file nor a folder of shards); `dropout` in [0, 1); `lr` finite and > 0;
    /// `min_lr` in [0, lr]; `beta1`, `beta2` in [0, 1); `weight_decay`, `grad_clip` finite and at
    /// least 0, and `lr * weight_decay` below 1 (AdamW scales the weights by `1 - lr *
    /// weight_decay` each step); `device` one of `cpu`, `cuda`, `cuda:N`; `precision` one of
    /// [`PRECISIONS`]; `reference_positions` one of [`REFERENCE_POSITIONS`]; `loss_scale_init` finite and > 0; `val_fraction` in (0, 1); `out`, and
    /// `metrics`, `data.path` and `data.tokenizer` when set, non-empty. A Llama
    /// (`model.kind = "llama"`) has `dropout` 0, an even head width `n_embd / n_head` (rotary
    /// embeddings rotate pairs), an `n_kv_head` (when set) dividing `n_head`, and `rope_theta`
    /// and `norm_eps` finite and > 0; a GPT or a BERT leaves the Llama keys (`n_kv_head`,
    /// `intermediate_size`, `rope_theta`, `norm_eps`) at their defaults and `tie_embeddings`
    /// unset or `true`. (Whether the device is usable, and whether the precision suits the
    /// layout, is checked when the run starts.)
    pub fn validate(&self) -> Result<(), ConfigError> {
        let m = &self.model;
        let t = &self.train;
        let invalid = |key: &str, message: String| {
            Err(ConfigError::Invalid {
                key: key.to_string(),
                message,
            })
        };
        if m.kind == ModelKind::Bert && !m.bias {
            return invalid(
                "model.bias",
                "BERT always has biases (model.kind = \"bert\" needs bias = true)".to_string(),
            );
        }
        let positive = [
            ("model.n_layer", m.n_layer),
            ("model.n_head", m.n_head),
            ("model.n_embd", m.n_embd),
            ("model.block_size", m.block_size),
            ("model.vocab_size", m.vocab_size),
            ("model.vocab_multiple", m.vocab_multiple),
            ("train.steps", t.steps),
            ("train.batch_size", t.batch_size),
            ("train.eval_batches", t.eval_batches),
            ("train.log_interval", t.log_interval),
            ("train.row_group", t.row_group),
        ];
        for (key, value) in positive {
            if value == 0 {
                return invalid(key, "must be at least 1, got 0".to_string());
            }
        }
        // The resolved config is saved as TOML (meshgrad.toml beside the checkpoint), whose
        // integers are signed 64-bit: refuse now what could not be written after the run.
        if let Some((key, n)) = self.integer_too_large_for_toml() {
            return invalid(
                &key,
                format!(
                    "{n} is too large: the config file (TOML) holds integers up to {MAX_TOML_INT}"
                ),
            );
        }
        if m.kind == ModelKind::Bert && m.block_size < 3 {
            return invalid(
                "model.block_size",
                format!(
                    "BERT rows hold [CLS], at least one token and [SEP], so block_size must be \
                     at least 3, got {}",
                    m.block_size
                ),
            );
        }
        // n_head >= 1 was checked above.
        let remainder = m.n_embd % m.n_head;
        if remainder != 0 {
            return invalid(
                "model.n_embd",
                format!(
                    "n_embd = {} is not divisible by n_head = {}",
                    m.n_embd, m.n_head
                ),
            );
        }
        let token_ids = |p: &str| {
            let p = Path::new(p);
            p.extension().is_some_and(|e| e.eq_ignore_ascii_case("bin")) || p.is_dir()
        };
        let byte_level = self.data.tokenizer.is_none()
            && match &self.data.path {
                None => true,
                Some(p) => !token_ids(p),
            };
        if byte_level && m.vocab_size < 256 {
            return invalid(
                "model.vocab_size",
                format!(
                    "vocab_size = {} is too small for byte-level text data, which needs 256",
                    m.vocab_size
                ),
            );
        }
        let unit_open = [
            ("model.dropout", m.dropout),
            ("train.beta1", t.beta1),
            ("train.beta2", t.beta2),
        ];
        for (key, value) in unit_open {
            if !(0.0..1.0).contains(&value) {
                return invalid(key, format!("must be in [0, 1), got {value}"));
            }
        }
        if let Err((key, message)) = m.check_family_keys() {
            return invalid(key, message);
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return invalid("train.lr", format!("must be a number > 0, got {}", t.lr));
        }
        if !(t.min_lr.is_finite() && t.min_lr >= 0.0) {
            return invalid(
                "train.min_lr",
                format!("must be a number >= 0, got {}", t.min_lr),
            );
        }
        if t.min_lr > t.lr {
            return invalid(
                "train.min_lr",
                format!("min_lr = {} is greater than lr = {}", t.min_lr, t.lr),
            );
        }
        let non_negative = [
            ("train.weight_decay", t.weight_decay),
            ("train.grad_clip", t.grad_clip),
        ];
        for (key, value) in non_negative {
            if !(value.is_finite() && value >= 0.0) {
                return invalid(key, format!("must be a number >= 0, got {value}"));
            }
        }
        // AdamW's decoupled decay multiplies the weights by 1 - lr * weight_decay each step (at
        // the peak learning rate): at 1 or more it zeroes or flips them.
        if t.lr * t.weight_decay >= 1.0 {
            return invalid(
                "train.weight_decay",
                format!(
                    "weight_decay = {} times lr = {} is {} >= 1: each step would scale the \
                     weights by 1 - lr * weight_decay <= 0",
                    short(t.weight_decay),
                    short(t.lr),
                    short(t.lr * t.weight_decay)
                ),
            );
        }
        if !valid_device(&t.device) {
            return invalid(
                "train.device",
                format!(
                    "must be \"cpu\", \"cuda\" or \"cuda:N\", got {:?}",
                    t.device
                ),
            );
        }
        for (key, value, allowed) in [
            ("train.precision", &t.precision, PRECISIONS),
            (
                "train.reference_positions",
                &t.reference_positions,
                REFERENCE_POSITIONS,
            ),
        ] {
            if !allowed.contains(&value.as_str()) {
                return invalid(key, format!("must be {}, got {value:?}", one_of(allowed)));
            }
        }
        if !(t.loss_scale_init.is_finite() && t.loss_scale_init > 0.0) {
            return invalid(
                "train.loss_scale_init",
                format!("must be a number > 0, got {}", t.loss_scale_init),
            );
        }
        let vf = self.data.val_fraction;
        if !(vf > 0.0 && vf < 1.0) {
            return invalid("data.val_fraction", format!("must be in (0, 1), got {vf}"));
        }
        if self.out.trim().is_empty() {
            return invalid("out", "must not be empty".to_string());
        }
        if self.metrics.as_deref().is_some_and(|p| p.trim().is_empty()) {
            return invalid("metrics", "must not be empty when set".to_string());
        }
        if self
            .data
            .tokenizer
            .as_deref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return invalid(
                "data.tokenizer",
                "must not be empty when set (leave it out for byte-level text)".to_string(),
            );
        }
        if self
            .data
            .path
            .as_deref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return invalid(
                "data.path",
                "must not be empty when set (leave it out for the built-in corpus)".to_string(),
            );
        }
        Ok(())
    }
}

impl ModelConfig {
    /// The family-specific checks of [`TrainConfig::validate`]: the key at fault and why, on one
    /// line. Runs after the generic checks (`n_head >= 1`, `n_embd` divisible by `n_head`,
    /// `dropout` in [0, 1)).
    fn check_family_keys(&self) -> Result<(), (&'static str, String)> {
        let m = self;
        if m.kind == ModelKind::Mixtral {
            m.check_mixtral_keys()?;
        } else {
            m.refuse_mixtral_keys()?;
        }
        match m.kind {
            ModelKind::Llama | ModelKind::Mixtral => {
                if m.dropout != 0.0 {
                    return Err((
                        "model.dropout",
                        format!(
                            "a Llama has no dropout (model.kind = \"llama\" needs dropout = 0), \
                             got {}",
                            m.dropout
                        ),
                    ));
                }
                let head_dim = m.n_embd / m.n_head;
                if !head_dim.is_multiple_of(2) {
                    return Err((
                        "model.n_embd",
                        format!(
                            "the head width n_embd / n_head = {} / {} = {head_dim} must be even \
                             for a Llama (rotary embeddings rotate pairs)",
                            m.n_embd, m.n_head
                        ),
                    ));
                }
                if m.n_kv_head != 0 && !m.n_head.is_multiple_of(m.n_kv_head) {
                    return Err((
                        "model.n_kv_head",
                        format!(
                            "model.n_kv_head = {} does not divide model.n_head = {} (each kv head \
                             serves a whole group of query heads)",
                            m.n_kv_head, m.n_head
                        ),
                    ));
                }
                let positive = [
                    ("model.rope_theta", m.rope_theta),
                    ("model.norm_eps", m.norm_eps),
                ];
                for (key, value) in positive {
                    if !(value.is_finite() && value > 0.0) {
                        return Err((key, format!("must be a finite number > 0, got {value}")));
                    }
                }
            }
            ModelKind::Gpt | ModelKind::Bert => {
                let llama_only = [
                    ("model.n_kv_head", m.n_kv_head != 0, m.n_kv_head.to_string()),
                    (
                        "model.intermediate_size",
                        m.intermediate_size != 0,
                        m.intermediate_size.to_string(),
                    ),
                    (
                        "model.rope_theta",
                        m.rope_theta != DEFAULT_ROPE_THETA,
                        m.rope_theta.to_string(),
                    ),
                    (
                        "model.norm_eps",
                        m.norm_eps != DEFAULT_NORM_EPS,
                        m.norm_eps.to_string(),
                    ),
                ];
                if let Some((key, _, value)) = llama_only.into_iter().find(|(_, set, _)| *set) {
                    return Err((
                        key,
                        format!(
                            "{key} = {value} is a Llama key (model.kind = \"{}\"); leave it out \
                             or set model.kind = \"llama\"",
                            m.kind
                        ),
                    ));
                }
                if m.tie_embeddings == Some(false) {
                    return Err((
                        "model.tie_embeddings",
                        format!(
                            "model.tie_embeddings = false is for a Llama only: a {} always ties \
                             its output head to the token table (model.kind = \"{}\")",
                            m.kind.as_str().to_uppercase(),
                            m.kind
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl ModelConfig {
    /// A Mixtral's keys: `experts_per_token` in `1..=n_experts`, the coefficient finite and
    /// >= 0, the capacity factor (when set) finite and > 0.
    fn check_mixtral_keys(&self) -> Result<(), (&'static str, String)> {
        let m = self;
        if m.n_experts == 0 {
            return Err(("model.n_experts", "must be at least 1, got 0".to_string()));
        }
        if m.experts_per_token == 0 || m.experts_per_token > m.n_experts {
            return Err((
                "model.experts_per_token",
                format!(
                    "must be in 1..={} (model.n_experts = {}), got {}",
                    m.n_experts, m.n_experts, m.experts_per_token
                ),
            ));
        }
        let c = m.router_aux_loss_coef;
        if !(c.is_finite() && c >= 0.0) {
            return Err((
                "model.router_aux_loss_coef",
                format!("must be a finite number >= 0, got {c}"),
            ));
        }
        if let Some(f) = m.expert_capacity_factor {
            if !(f.is_finite() && f > 0.0) {
                return Err((
                    "model.expert_capacity_factor",
                    format!("must be a finite number > 0, got {f}"),
                ));
            }
        }
        Ok(())
    }

    /// Another kind's config leaves the Mixtral keys at their defaults.
    fn refuse_mixtral_keys(&self) -> Result<(), (&'static str, String)> {
        let m = self;
        let set = [
            (
                "model.n_experts",
                m.n_experts != DEFAULT_N_EXPERTS,
                m.n_experts.to_string(),
            ),
            (
                "model.experts_per_token",
                m.experts_per_token != DEFAULT_EXPERTS_PER_TOKEN,
                m.experts_per_token.to_string(),
            ),
            (
                "model.router_aux_loss_coef",
                m.router_aux_loss_coef != DEFAULT_ROUTER_AUX_LOSS_COEF,
                m.router_aux_loss_coef.to_string(),
            ),
            (
                "model.expert_capacity_factor",
                m.expert_capacity_factor.is_some(),
                format!("{:?}", m.expert_capacity_factor),
            ),
        ];
        if let Some((key, _, value)) = set.into_iter().find(|(_, s, _)| *s) {
            return Err((
                key,
                format!(
                    "{key} = {value} is a Mixtral key (model.kind = \"{}\"); leave it out or \
                     set model.kind = \"mixtral\"",
                    m.kind
                ),
            ));
        }
        Ok(())
    }
}

/// `"a"`, `"b"` or `"c"` for the values `allowed`.
fn one_of(allowed: &[&str]) -> String {
    let quoted: Vec<String> = allowed.iter().map(|a| format!("{a:?}")).collect();
    match quoted.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// The values `train.reference_positions` takes.
pub const REFERENCE_POSITIONS: &[&str] = &["sequence", "folded"];

/// The values `train.precision` takes.
pub const PRECISIONS: &[&str] = &["f32", "bf16", "f16"];

/// Whether `s` names a device: `cpu`, `cuda` or `cuda:N` (`N` a non-negative integer).
fn valid_device(s: &str) -> bool {
    match s {
        "cpu" | "cuda" => true,
        _ => s
            .strip_prefix("cuda:")
            .is_some_and(|n| !n.is_empty() && n.parse::<usize>().is_ok()),
    }
}

/// A number for a message: as written (`0.1`, `3000`) unless very large or small, then with
/// four significant digits at most (`1e30`, `3.142e-7`).
fn short(x: f64) -> String {
    if x == 0.0 || !x.is_finite() || (1e-4..1e6).contains(&x.abs()) {
        return x.to_string();
    }
    let s = format!("{x:.3e}");
    match s.split_once('e') {
        Some((mantissa, exp)) if mantissa.contains('.') => {
            let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
            format!("{mantissa}e{exp}")
        }
        _ => s,
    }
}

/// Joins a multi-line message into one line.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// Line, column (1-based) and, when it can be told, the dotted key at byte offset `span.start`.
///
/// The key is read from the source line (`key = value`) and the nearest `[table]` header above it.
fn locate(text: &str, span: Range<usize>) -> (Option<usize>, Option<usize>, Option<String>) {
    let start = span.start.min(text.len());
    let before = &text[..start];
    let line_index = before.matches('\n').count();
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = text[line_start..start].chars().count() + 1;
    let lines: Vec<&str> = text.lines().collect();
    let key = lines.get(line_index).and_then(|line| {
        let line = line.trim();
        if let Some(header) = table_header(line) {
            return Some(header);
        }
        let (name, _) = line.split_once('=')?;
        let name = clean_key(name);
        if name.is_empty() {
            return None;
        }
        let table = lines[..line_index]
            .iter()
            .rev()
            .find_map(|l| table_header(l.trim()));
        Some(match table {
            Some(table) => format!("{table}.{name}"),
            None => name,
        })
    });
    (Some(line_index + 1), Some(column), key)
}

/// The name of a `[table]` header line.
fn table_header(line: &str) -> Option<String> {
    let inner = line.strip_prefix('[')?;
    let end = inner.find(']')?;
    Some(clean_key(&inner[..end]))
}

/// A TOML key with whitespace and quotes removed.
fn clean_key(key: &str) -> String {
    key.split('.')
        .map(|part| part.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        let config = TrainConfig::default();
        config.validate().unwrap();
        assert_eq!(config.model.n_embd % config.model.n_head, 0);
        assert_eq!(config.out, "runs/latest");
        assert_eq!(config.data.path, None);
    }

    #[test]
    fn empty_file_gives_defaults() {
        let config = TrainConfig::from_toml_str("", "<empty>").unwrap();
        assert_eq!(config, TrainConfig::default());
    }

    #[test]
    fn parses_partial_file() {
        let text = r#"
out = "runs/x"
metrics = "runs/x/metrics.jsonl"

[model]
n_layer = 2
dropout = 0.1

[train]
steps = 50
lr = 3e-4

[data]
path = "data/train.bin"
val_fraction = 0.05
"#;
        let config = TrainConfig::from_toml_str(text, "t.toml").unwrap();
        assert_eq!(config.out, "runs/x");
        assert_eq!(config.metrics.as_deref(), Some("runs/x/metrics.jsonl"));
        assert_eq!(config.model.n_layer, 2);
        assert_eq!(config.model.n_head, 4); // default kept
        assert_eq!(config.model.dropout, 0.1);
        assert_eq!(config.train.steps, 50);
        assert_eq!(config.train.lr, 3e-4);
        assert_eq!(config.train.batch_size, 16);
        assert_eq!(config.data.path.as_deref(), Some("data/train.bin"));
        assert_eq!(config.data.val_fraction, 0.05);
        config.validate().unwrap();
    }

    #[test]
    fn example_config_file_parses_and_equals_defaults() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.toml");
        let config = TrainConfig::from_toml_file(&path).unwrap();
        config.validate().unwrap();
        assert_eq!(config, TrainConfig::default());
    }

    #[test]
    fn missing_file_error_names_path() {
        let err = TrainConfig::from_toml_file("no/such/config.toml").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("no/such/config.toml"), "{msg}");
        assert!(msg.contains("os error"), "{msg}");
    }

    #[test]
    fn unknown_key_error_names_key_and_line() {
        let text = "[model]\nn_layer = 2\nn_layers = 3\n";
        let err = TrainConfig::from_toml_str(text, "cfg.toml").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("cfg.toml"), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");
        assert!(msg.contains("`model.n_layers`"), "{msg}");
        assert!(msg.contains("unknown field `n_layers`"), "{msg}");

        let err = TrainConfig::from_toml_str("outt = \"x\"\n", "cfg.toml").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown field `outt`"), "{msg}");

        let err = TrainConfig::from_toml_str("[optim]\nlr = 1.0\n", "cfg.toml").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown field `optim`"), "{msg}");
        assert!(!msg.contains('\n'), "{msg}");
    }

    #[test]
    fn bad_value_error_names_key() {
        let text = "[train]\nsteps = \"many\"\n";
        let err = TrainConfig::from_toml_str(text, "cfg.toml").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("`train.steps`"), "{msg}");
        assert!(msg.contains("line 2"), "{msg}");

        let err = TrainConfig::from_toml_str("[train]\nsteps = -5\n", "cfg.toml").unwrap_err();
        assert!(err.to_string().contains("`train.steps`"), "{err}");

        // Malformed TOML gives a one-line message with the position.
        let err = TrainConfig::from_toml_str("[train\nsteps = 1\n", "cfg.toml").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        assert!(msg.contains("line 1"), "{msg}");
    }

    #[test]
    fn validate_reports_bad_values() {
        let cases: Vec<(&str, &str, &str)> = vec![
            ("model.n_embd", "130", "not divisible by n_head = 4"),
            ("model.n_layer", "0", "at least 1"),
            ("train.batch_size", "0", "at least 1"),
            ("train.lr", "0", "> 0"),
            ("train.lr", "-1e-3", "> 0"),
            ("train.lr", "NaN", "> 0"),
            ("model.dropout", "1.0", "[0, 1)"),
            ("model.dropout", "-0.1", "[0, 1)"),
            ("data.val_fraction", "0", "(0, 1)"),
            ("data.val_fraction", "1", "(0, 1)"),
            ("train.min_lr", "0.01", "greater than lr"),
            ("train.beta2", "1", "[0, 1)"),
            ("train.grad_clip", "-1", ">= 0"),
            (
                "train.weight_decay",
                "1e30",
                "times lr = 0.003 is 3e27 >= 1",
            ),
            ("model.vocab_size", "100", "byte-level"),
            ("out", "", "empty"),
            ("train.device", "gpu", "\"cpu\", \"cuda\" or \"cuda:N\""),
            ("train.device", "cuda:x", "got \"cuda:x\""),
            ("train.precision", "fp16", "\"f32\", \"bf16\" or \"f16\""),
            (
                "train.reference_positions",
                "fold",
                "\"sequence\" or \"folded\"",
            ),
            ("train.loss_scale_init", "0", "> 0"),
            ("train.loss_scale_init", "inf", "> 0"),
        ];
        for (key, value, expected) in cases {
            let mut config = TrainConfig::default();
            config.apply_override(key, value).unwrap();
            let err = config.validate().unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(key), "{key}={value}: {msg}");
            assert!(msg.contains(expected), "{key}={value}: {msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        // Integers the saved TOML cannot hold: refused when set from text, and by validation
        // when set in code. And BERT rows too short for [CLS] x [SEP].
        let too_large = [
            (
                "train.seed",
                "9223372036854775808",
                "integers up to 9223372036854775807",
            ),
            ("train.seed", "18446744073709551615", "too large"),
            ("train.steps", "9223372036854775808", "too large"),
            ("train.warmup_steps", "18446744073709551615", "too large"),
            ("model.n_layer", "9223372036854775808", "too large"),
        ];
        for (key, value, expected) in too_large {
            let mut config = TrainConfig::default();
            let msg = config.apply_override(key, value).unwrap_err().to_string();
            assert!(msg.contains(key) && msg.contains(expected), "{msg}");
            assert_eq!(config, TrainConfig::default());
        }
        let mut config = TrainConfig::default();
        config.train.warmup_steps = usize::MAX;
        let msg = config.validate().unwrap_err().to_string();
        assert!(
            msg.contains("train.warmup_steps") && msg.contains("too large"),
            "{msg}"
        );
        let mut config = TrainConfig::default();
        config
            .apply_override("train.seed", "9223372036854775807")
            .unwrap();
        config.validate().unwrap();
        config.to_toml_string().unwrap();
        config.apply_override("model.kind", "bert").unwrap();
        config.apply_override("model.block_size", "2").unwrap();
        let msg = config.validate().unwrap_err().to_string();
        assert!(
            msg.contains("`model.block_size`") && msg.contains("at least 3"),
            "{msg}"
        );
        // A .bin dataset may have a small vocabulary.
        let mut config = TrainConfig::default();
        config.apply_assignment("data.path=tokens.bin").unwrap();
        config.apply_assignment("model.vocab_size=100").unwrap();
        config.validate().unwrap();
        // So may text through a tokenizer.
        let mut config = TrainConfig::default();
        config.apply_assignment("data.tokenizer=tok.json").unwrap();
        config.apply_assignment("model.vocab_size=100").unwrap();
        config.validate().unwrap();
        config.apply_assignment("data.tokenizer=").unwrap();
        assert_eq!(config.data.tokenizer, None);
        assert!(config.validate().is_err());
    }

    #[test]
    fn short_numbers() {
        assert_eq!(short(0.1), "0.1");
        assert_eq!(short(3000.0), "3000");
        assert_eq!(short(1e30), "1e30");
        assert_eq!(short(0.003 * 1e30), "3e27");
        assert_eq!(short(-3.14159e-7), "-3.142e-7");
    }

    #[test]
    fn overrides() {
        let mut config = TrainConfig::default();
        config.apply_override("train.steps", "500").unwrap();
        config.apply_override("train.lr", "3e-4").unwrap();
        config.apply_override("model.bias", "false").unwrap();
        config.apply_override("out", "\"runs/b\"").unwrap();
        config.apply_assignment("data.path=corpus.txt").unwrap();
        config.apply_assignment("metrics = m.jsonl").unwrap();
        config.apply_assignment("train.seed=7").unwrap();
        assert_eq!(config.train.steps, 500);
        assert_eq!(config.train.lr, 3e-4);
        assert!(!config.model.bias);
        assert_eq!(config.out, "runs/b");
        assert_eq!(config.data.path.as_deref(), Some("corpus.txt"));
        assert_eq!(config.metrics.as_deref(), Some("m.jsonl"));
        assert_eq!(config.train.seed, 7);
        config.apply_assignment("data.path=").unwrap();
        assert_eq!(config.data.path, None);
        config.validate().unwrap();
    }

    #[test]
    fn override_errors_name_the_key() {
        let mut config = TrainConfig::default();
        let msg = config
            .apply_override("train.step", "5")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`train.step`"), "{msg}");
        assert!(msg.contains("did you mean `train.steps`"), "{msg}");

        let msg = config.apply_override("steps", "5").unwrap_err().to_string();
        assert!(msg.contains("did you mean `train.steps`"), "{msg}");

        let msg = config.apply_override("zzz", "5").unwrap_err().to_string();
        assert!(msg.contains("known keys"), "{msg}");
        let msg = config
            .apply_override("zzz.qqqqqqq", "5")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("known keys: data.path, data.tokenizer, data.val_fraction, metrics"),
            "{msg}"
        );
        // An enum names its values.
        let msg = config
            .apply_override("model.kind", "t5")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`model.kind`") && msg.contains("`gpt`, `bert`, `llama`"),
            "{msg}"
        );
        assert_eq!(
            "t5".parse::<ModelKind>().unwrap_err(),
            "unknown model kind \"t5\" (expected gpt, bert, llama or mixtral)"
        );
        let msg = config
            .apply_override("model.tie_embeddings", "yes")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`model.tie_embeddings`") && msg.contains("a boolean"),
            "{msg}"
        );

        let msg = config
            .apply_override("train.steps", "5x")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("`train.steps`"), "{msg}");
        assert!(msg.contains("\"5x\""), "{msg}");
        assert!(msg.contains("non-negative integer"), "{msg}");

        let msg = config
            .apply_override("model.bias", "yes")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("true or false"), "{msg}");

        let msg = config
            .apply_override("train.lr", "fast")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`train.lr`") && msg.contains("a number"),
            "{msg}"
        );

        let err = config.apply_assignment("train.steps").unwrap_err();
        assert!(matches!(err, ConfigError::BadAssignment { .. }), "{err}");
        assert!(config.apply_assignment("=5").is_err());
        // Nothing was changed by the failed overrides.
        assert_eq!(config, TrainConfig::default());
    }

    #[test]
    fn every_key_of_the_structs_can_be_set() {
        // The keys are the serialized config's (every optional key set), and each takes a value.
        let config = TrainConfig {
            metrics: Some("m".into()),
            model: ModelConfig {
                tie_embeddings: Some(true),
                expert_capacity_factor: Some(1.25),
                ..ModelConfig::default()
            },
            data: DataConfig {
                path: Some("p".into()),
                tokenizer: Some("t".into()),
                ..DataConfig::default()
            },
            ..TrainConfig::default()
        };
        let value: toml::Value = toml::from_str(&config.to_toml_string().unwrap()).unwrap();
        let mut serialized = Vec::new();
        for (k, v) in value.as_table().unwrap() {
            match v.as_table() {
                Some(table) => serialized.extend(table.keys().map(|f| format!("{k}.{f}"))),
                None => serialized.push(k.clone()),
            }
        }
        serialized.sort();
        assert_eq!(serialized, TrainConfig::keys());
        for key in TrainConfig::keys() {
            let mut c = TrainConfig::default();
            let value = match key.as_str() {
                "out" | "metrics" | "data.path" | "data.tokenizer" => "x",
                "model.bias" => "false",
                "model.tie_embeddings" => "true",
                "model.experts_per_token" => "1",
                "train.reference" => "true",
                "model.kind" => "bert",
                "train.device" => "cuda",
                "train.precision" => "bf16",
                _ => "2",
            };
            c.apply_override(&key, value).unwrap();
            assert_ne!(c, TrainConfig::default(), "{key}={value} changed nothing");
        }
    }

    #[test]
    fn toml_round_trip() {
        let mut config = TrainConfig::default();
        config.train.lr = 6e-4;
        config.data.path = Some("d.bin".into());
        let text = config.to_toml_string().unwrap();
        let back = TrainConfig::from_toml_str(&text, "<round trip>").unwrap();
        assert_eq!(back, config);
    }

    /// A small Llama config: 4 heads of width 32.
    fn llama() -> TrainConfig {
        let mut config = TrainConfig::default();
        config.model.kind = ModelKind::Llama;
        config.model.dropout = 0.0;
        config
    }

    #[test]
    fn llama_kind_parses_and_prints() {
        assert_eq!("llama".parse::<ModelKind>().unwrap(), ModelKind::Llama);
        assert_eq!(ModelKind::Llama.as_str(), "llama");
        assert_eq!(ModelKind::Llama.to_string(), "llama");
        let config = TrainConfig::from_toml_str("[model]\nkind = \"llama\"\n", "t").unwrap();
        assert_eq!(config, llama());
        config.validate().unwrap();
        let mut c = TrainConfig::default();
        c.apply_override("model.kind", "llama").unwrap();
        assert_eq!(c.model.kind, ModelKind::Llama);
    }

    #[test]
    fn llama_defaults_and_helpers() {
        let m = ModelConfig::default();
        assert_eq!(m.n_kv_head, 0);
        assert_eq!(m.intermediate_size, 0);
        assert_eq!(m.rope_theta, 10000.0);
        assert_eq!(m.norm_eps, 1e-5);
        assert_eq!(m.tie_embeddings, None);
        // GPT (and BERT): 4 x n_embd, tied, n_head kv heads.
        assert_eq!(m.kv_heads(), 4);
        assert_eq!(m.ffn_hidden(), 512);
        assert!(m.tied());
        let bert = ModelConfig {
            kind: ModelKind::Bert,
            ..ModelConfig::default()
        };
        assert!(bert.tied());
        assert_eq!(bert.ffn_hidden(), 4 * 128);

        let mut m = llama().model;
        assert_eq!(m.kv_heads(), 4);
        // ceil(8 * 128 / 3) = 342, rounded up to 512.
        assert_eq!(m.ffn_hidden(), 512);
        assert!(!m.tied());
        m.n_embd = 4096;
        // ceil(32768 / 3) = 10923, rounded up to 43 * 256 = 11008 (Llama 2 7B).
        assert_eq!(m.ffn_hidden(), 11008);
        // The same rule as the model's own config.
        for n_embd in [64, 128, 200, 768, 4096] {
            m.n_embd = n_embd;
            let nn = meshgrad_nn::llama::LlamaConfig::new(256, 128, n_embd, 2, 4);
            assert_eq!(m.ffn_hidden(), nn.intermediate_size, "n_embd {n_embd}");
            assert_eq!(m.kv_heads(), nn.n_kv_head);
            assert_eq!(m.tied(), nn.tie_embeddings);
            assert_eq!(m.rope_theta, nn.rope_theta);
            assert_eq!(m.norm_eps, nn.norm_eps);
        }
        m.n_kv_head = 2;
        m.intermediate_size = 300;
        m.tie_embeddings = Some(true);
        assert_eq!(m.kv_heads(), 2);
        assert_eq!(m.ffn_hidden(), 300);
        assert!(m.tied());
    }

    #[test]
    fn llama_refusals() {
        let cases: Vec<(&str, &str, &str)> = vec![
            (
                "model.n_kv_head",
                "3",
                "model.n_kv_head = 3 does not divide model.n_head = 4",
            ),
            (
                "model.n_kv_head",
                "8",
                "model.n_kv_head = 8 does not divide model.n_head = 4",
            ),
            ("model.rope_theta", "0", "finite number > 0, got 0"),
            ("model.rope_theta", "-1", "finite number > 0"),
            ("model.rope_theta", "inf", "finite number > 0"),
            ("model.norm_eps", "0", "finite number > 0"),
            ("model.norm_eps", "NaN", "finite number > 0"),
            ("model.dropout", "0.1", "a Llama has no dropout"),
            // n_embd 132 over 4 heads: heads of width 33, odd.
            (
                "model.n_embd",
                "132",
                "n_embd / n_head = 132 / 4 = 33 must be even",
            ),
        ];
        for (key, value, expected) in cases {
            let mut config = llama();
            config.apply_override(key, value).unwrap();
            let msg = config.validate().unwrap_err().to_string();
            assert!(msg.contains(key), "{key}={value}: {msg}");
            assert!(msg.contains(expected), "{key}={value}: {msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        // Allowed: grouped-query and multi-query attention, any MLP width, a tied head, a bias
        // key (ignored).
        let mut config = llama();
        for kv in ["1", "2", "4"] {
            config.apply_override("model.n_kv_head", kv).unwrap();
            config.validate().unwrap();
        }
        config
            .apply_override("model.intermediate_size", "100")
            .unwrap();
        config
            .apply_override("model.tie_embeddings", "true")
            .unwrap();
        config.apply_override("model.rope_theta", "500000").unwrap();
        config.apply_override("model.norm_eps", "1e-6").unwrap();
        config.apply_override("model.bias", "false").unwrap();
        config.validate().unwrap();
        config.model.bias = true;
        config.validate().unwrap();
    }

    #[test]
    fn llama_keys_refused_for_gpt_and_bert() {
        let cases = [
            ("model.n_kv_head", "2"),
            ("model.intermediate_size", "512"),
            ("model.rope_theta", "500000"),
            ("model.norm_eps", "1e-6"),
        ];
        for kind in ["gpt", "bert"] {
            for (key, value) in cases {
                let mut config = TrainConfig::default();
                config.apply_override("model.kind", kind).unwrap();
                config.validate().unwrap();
                config.apply_override(key, value).unwrap();
                let msg = config.validate().unwrap_err().to_string();
                let expected = format!("is a Llama key (model.kind = \"{kind}\")");
                assert!(msg.contains(key) && msg.contains(&expected), "{msg}");
                assert!(!msg.contains('\n'), "{msg}");
            }
            let mut config = TrainConfig::default();
            config.apply_override("model.kind", kind).unwrap();
            // Tied is what a GPT and a BERT are: saying so is allowed, untying is not.
            config
                .apply_override("model.tie_embeddings", "true")
                .unwrap();
            config.validate().unwrap();
            config
                .apply_override("model.tie_embeddings", "false")
                .unwrap();
            let msg = config.validate().unwrap_err().to_string();
            assert!(
                msg.contains("`model.tie_embeddings`")
                    && msg.contains("for a Llama only")
                    && msg.contains("always ties"),
                "{msg}"
            );
            assert!(!msg.contains('\n'), "{msg}");
        }
    }

    #[test]
    fn llama_overrides() {
        let mut config = llama();
        config.apply_assignment("model.n_kv_head=2").unwrap();
        config
            .apply_assignment("model.intermediate_size=344")
            .unwrap();
        config.apply_assignment("model.rope_theta=500000").unwrap();
        config.apply_assignment("model.norm_eps=1e-6").unwrap();
        config
            .apply_assignment("model.tie_embeddings=true")
            .unwrap();
        assert_eq!(config.model.n_kv_head, 2);
        assert_eq!(config.model.intermediate_size, 344);
        assert_eq!(config.model.rope_theta, 500000.0);
        assert_eq!(config.model.norm_eps, 1e-6);
        assert_eq!(config.model.tie_embeddings, Some(true));
        config
            .apply_assignment("model.tie_embeddings=false")
            .unwrap();
        assert_eq!(config.model.tie_embeddings, Some(false));
        config.validate().unwrap();
        // Empty unsets it: the family's default.
        config.apply_assignment("model.tie_embeddings=").unwrap();
        assert_eq!(config.model.tie_embeddings, None);
        assert!(!config.model.tied());
        // Wrong types name the key.
        for (key, value) in [
            ("model.n_kv_head", "-1"),
            ("model.n_kv_head", "two"),
            ("model.rope_theta", "big"),
            ("model.tie_embeddings", "1"),
        ] {
            let before = config.clone();
            let msg = config.apply_override(key, value).unwrap_err().to_string();
            assert!(msg.contains(&format!("`{key}`")), "{msg}");
            assert_eq!(config, before);
        }
        for key in [
            "model.n_kv_head",
            "model.intermediate_size",
            "model.rope_theta",
            "model.norm_eps",
            "model.tie_embeddings",
        ] {
            assert!(TrainConfig::keys().contains(&key.to_string()), "{key}");
        }
    }

    #[test]
    fn llama_toml_round_trip() {
        let mut config = llama();
        config.model.n_kv_head = 2;
        config.model.rope_theta = 500000.0;
        config.model.norm_eps = 1e-6;
        config.model.intermediate_size = 344;
        for tie in [None, Some(false), Some(true)] {
            config.model.tie_embeddings = tie;
            let text = config.to_toml_string().unwrap();
            assert_eq!(text.contains("tie_embeddings"), tie.is_some(), "{text}");
            assert!(text.contains("kind = \"llama\""), "{text}");
            let back = TrainConfig::from_toml_str(&text, "<round trip>").unwrap();
            assert_eq!(back, config);
            back.validate().unwrap();
        }
    }

    #[test]
    fn config_without_llama_keys_loads_with_defaults() {
        // A resolved config as saved before the Llama keys existed.
        let mut old = TrainConfig::default();
        old.model.n_layer = 2;
        let text = old.to_toml_string().unwrap();
        let text: String = text
            .lines()
            .filter(|l| {
                ![
                    "n_kv_head",
                    "intermediate_size",
                    "rope_theta",
                    "norm_eps",
                    "tie_embeddings",
                ]
                .iter()
                .any(|k| l.starts_with(k))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        assert!(!text.contains("rope_theta"), "{text}");
        let back = TrainConfig::from_toml_str(&text, "<old>").unwrap();
        assert_eq!(back, old);
        back.validate().unwrap();
    }
}
