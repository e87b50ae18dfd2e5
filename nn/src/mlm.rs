//! Masked-language-model inputs: which tokens are hidden, and what the model must predict.
//!
//! [`mlm_mask`] follows BERT's recipe (and Hugging Face's `DataCollatorForLanguageModeling`):
//! each token that is not special (padding, `[CLS]`, `[SEP]`, ...) is selected with probability
//! `mask_prob` (0.15); a selected token becomes `[MASK]` with probability 0.8, a random
//! non-special token with probability 0.1, and stays as it is otherwise; its label is its
//! original id. Every other label is -100 ([`IGNORE_INDEX`]).
//!
//! Every decision is a counter-based draw keyed by `(seed, step)` and the token's global
//! position `(row, column)`, never by how the batch is split: rows `a..b` masked on their own
//! (`first_row = a`) are exactly rows `a..b` of the whole batch, so every parallel layout sees the
//! same masks as one device.

use std::ops::Range;

use meshgrad_tensor::{DType, Device, Random, Result, Tensor};

use crate::bert::IGNORE_INDEX;
use crate::module::name_seed;

/// The byte-level vocabulary of `meshgrad train --model bert`: bytes are ids 0..=255 and the
/// five special tokens follow them.
pub mod byte_level {
    /// Padding.
    pub const PAD: u32 = 256;
    /// Unknown token.
    pub const UNK: u32 = 257;
    /// Start of a sequence.
    pub const CLS: u32 = 258;
    /// End of a segment.
    pub const SEP: u32 = 259;
    /// The mask token.
    pub const MASK: u32 = 260;
    /// Vocabulary size: 256 bytes and 5 special tokens.
    pub const VOCAB_SIZE: usize = 261;
}

/// The special tokens appended after a base vocabulary of `base` ids, in the order
/// `[PAD] [UNK] [CLS] [SEP] [MASK]` (ids `base..base + 5`). For the byte-level vocabulary
/// `base` is 256 (see [`byte_level`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `[PAD]`
    pub pad: u32,
    /// `[UNK]`
    pub unk: u32,
    /// `[CLS]`
    pub cls: u32,
    /// `[SEP]`
    pub sep: u32,
    /// `[MASK]`
    pub mask: u32,
}

impl SpecialTokens {
    /// The five special tokens at `base..base + 5`.
    pub fn after(base: u32) -> Self {
        SpecialTokens {
            pad: base,
            unk: base + 1,
            cls: base + 2,
            sep: base + 3,
            mask: base + 4,
        }
    }

    /// The ids, in order.
    pub fn ids(&self) -> [u32; 5] {
        [self.pad, self.unk, self.cls, self.sep, self.mask]
    }
}

/// How [`mlm_mask`] hides tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct MlmConfig {
    /// Probability that a non-special token is selected for prediction (BERT: 0.15).
    pub mask_prob: f64,
    /// Of the selected tokens, the fraction replaced by `[MASK]` (BERT: 0.8).
    pub mask_token_frac: f64,
    /// Of the selected tokens, the fraction replaced by a random token (BERT: 0.1); the rest
    /// stay unchanged.
    pub random_token_frac: f64,
    /// The `[MASK]` id.
    pub mask_token_id: u32,
    /// Tokens that are never selected (padding, `[CLS]`, `[SEP]`, `[MASK]`, ...).
    pub special_ids: Vec<u32>,
    /// Random replacements are drawn uniformly from these ids (the non-special vocabulary).
    pub random_ids: Range<u32>,
}

impl MlmConfig {
    /// BERT's proportions over a vocabulary of `base` ordinary ids followed by `specials`:
    /// random replacements are drawn from `0..base`.
    pub fn bert(base: u32, specials: SpecialTokens) -> Self {
        MlmConfig {
            mask_prob: 0.15,
            mask_token_frac: 0.8,
            random_token_frac: 0.1,
            mask_token_id: specials.mask,
            special_ids: specials.ids().to_vec(),
            random_ids: 0..base,
        }
    }

    /// BERT's proportions over the byte-level vocabulary ([`byte_level`]).
    pub fn byte_level() -> Self {
        MlmConfig::bert(256, SpecialTokens::after(256))
    }

    /// Checks the probabilities and the random-token range.
    pub fn validate(&self) -> Result<()> {
        for (k, p) in [
            ("mask_prob", self.mask_prob),
            ("mask_token_frac", self.mask_token_frac),
            ("random_token_frac", self.random_token_frac),
        ] {
            if !(0.0..=1.0).contains(&p) {
                meshgrad_tensor::bail!("mlm config: {k} must be in [0, 1], got {p}");
            }
        }
        if self.mask_token_frac + self.random_token_frac > 1.0 {
            meshgrad_tensor::bail!(
                "mlm config: mask_token_frac {} + random_token_frac {} exceed 1",
                self.mask_token_frac,
                self.random_token_frac
            );
        }
        if self.random_token_frac > 0.0 && self.random_ids.is_empty() {
            meshgrad_tensor::bail!("mlm config: random_ids is empty");
        }
        Ok(())
    }
}

/// Domain tag of the masking streams (so they never coincide with other draws of the same seed).
const MLM_DOMAIN: &str = "meshgrad.mlm";

/// The three uniform draws of every token of global row `row` (columns `0..t`): selection,
/// action and random token. Element `(row, col)` is index `row * 2^32 + col` of its stream, so
/// the draws do not depend on the row length either.
fn row_draws(keys: [u64; 3], row: u64, t: usize) -> Result<[Vec<f64>; 3]> {
    let draw = |k: u64| -> Result<Vec<f64>> {
        Random::new(k)
            .offset(row << 32)
            .dtype(DType::F64)
            .uniform(t, 0.0, 1.0)?
            .to_vec::<f64>()
    };
    Ok([draw(keys[0])?, draw(keys[1])?, draw(keys[2])?])
}

/// Masks the token rows `ids` (`rows * t` ids, row-major; the rows are global rows
/// `first_row..first_row + rows` of step `step`) as the [module docs](self) describe. Returns the
/// input ids with the replacements and the labels (the original id where a token was selected,
/// -100 elsewhere).
pub fn mlm_mask_rows(
    ids: &[u32],
    t: usize,
    first_row: u64,
    step: u64,
    seed: u64,
    cfg: &MlmConfig,
) -> Result<(Vec<u32>, Vec<i64>)> {
    cfg.validate()?;
    if t == 0 || !ids.len().is_multiple_of(t) {
        meshgrad_tensor::bail!("mlm_mask: {} ids do not form rows of length {t}", ids.len());
    }
    if t as u64 > u32::MAX as u64 {
        meshgrad_tensor::bail!("mlm_mask: rows of {t} tokens are too long (at most 2^32 - 1)");
    }
    let base = name_seed(seed, &format!("{MLM_DOMAIN}.{step}"));
    let keys = [
        name_seed(base, "select"),
        name_seed(base, "action"),
        name_seed(base, "token"),
    ];
    let n_random = (cfg.random_ids.end - cfg.random_ids.start) as f64;
    let mut out = ids.to_vec();
    let mut labels = vec![IGNORE_INDEX; ids.len()];
    for (r, row) in ids.chunks(t).enumerate() {
        let [sel, act, tok] = row_draws(keys, first_row + r as u64, t)?;
        for (c, &id) in row.iter().enumerate() {
            if cfg.special_ids.contains(&id) || sel[c] >= cfg.mask_prob {
                continue;
            }
            let i = r * t + c;
            labels[i] = id as i64;
            if act[c] < cfg.mask_token_frac {
                out[i] = cfg.mask_token_id;
            } else if act[c] < cfg.mask_token_frac + cfg.random_token_frac {
                let k =
                    ((tok[c] * n_random) as u32).min(cfg.random_ids.end - cfg.random_ids.start - 1);
                out[i] = cfg.random_ids.start + k;
            }
        }
    }
    Ok((out, labels))
}

/// [`mlm_mask_rows`] on a tensor of token ids `[rows, T]` (any integer dtype): returns the masked
/// ids (same dtype and device) and the labels (`i64`), for global rows
/// `first_row..first_row + rows` of step `step`.
pub fn mlm_mask(
    ids: &Tensor,
    first_row: u64,
    step: u64,
    seed: u64,
    cfg: &MlmConfig,
) -> Result<(Tensor, Tensor)> {
    if ids.rank() != 2 || !ids.dtype().is_int() {
        meshgrad_tensor::bail!(
            "mlm_mask: ids must be an integer tensor [rows, T], got {} of {}",
            ids.shape(),
            ids.dtype()
        );
    }
    let v: Vec<u32> = ids
        .to_vec_f64()?
        .into_iter()
        .map(|x| {
            if x < 0.0 || x > u32::MAX as f64 {
                Err(meshgrad_tensor::Error::msg(format!(
                    "mlm_mask: token id {x} is not a valid id"
                )))
            } else {
                Ok(x as u32)
            }
        })
        .collect::<Result<_>>()?;
    let t = ids.dims()[1];
    let (masked, labels) = mlm_mask_rows(&v, t, first_row, step, seed, cfg)?;
    let shape = ids.shape().clone();
    Ok((
        Tensor::from_vec(masked, shape.clone(), Device::Cpu)?
            .to_dtype(ids.dtype())?
            .to_device(ids.device())?,
        Tensor::from_vec(labels, shape, Device::Cpu)?.to_device(ids.device())?,
    ))
}
