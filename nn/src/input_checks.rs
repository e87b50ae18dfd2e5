//! The input checks the model families share, written once: token ids (every family), the
//! next-token targets and whether a model can generate (GPT, Llama). Each message starts with
//! the family's name.

use meshgrad_tensor::{Result, Tensor};

use crate::layers::LmHead;
use crate::StageSpec;

/// Checks token ids `[B, T]` (integers, `1 <= T <= max_len`; `len_key` names the config key
/// of `max_len` in the message), returning `(B, T)`.
pub(crate) fn check_ids(
    model: &str,
    ids: &Tensor,
    (max_len, len_key): (usize, &str),
) -> Result<(usize, usize)> {
    if ids.rank() != 2 || !ids.dtype().is_int() {
        meshgrad_tensor::bail!(
            "{model}: token ids must be an integer tensor [B, T], got {} of {}",
            ids.shape(),
            ids.dtype()
        );
    }
    let (b, t) = (ids.dims()[0], ids.dims()[1]);
    if t > max_len || t == 0 {
        meshgrad_tensor::bail!("{model}: sequence length {t} must be in 1..={max_len} ({len_key})");
    }
    Ok((b, t))
}

/// Checks that `targets` have the shape of the token ids `ids`.
pub(crate) fn check_targets_match_ids(model: &str, targets: &Tensor, ids: &Tensor) -> Result<()> {
    if targets.dims() != ids.dims() {
        meshgrad_tensor::bail!(
            "{model}: targets {} must match ids {}",
            targets.shape(),
            ids.shape()
        );
    }
    Ok(())
}

/// Checks that `targets` are an integer tensor `[B, T]` (before the logits are computed).
pub(crate) fn check_targets(model: &str, targets: &Tensor) -> Result<()> {
    if targets.rank() != 2 || !targets.dtype().is_int() {
        meshgrad_tensor::bail!(
            "{model} stage: targets must be an integer tensor [B, T], got {} of {}",
            targets.shape(),
            targets.dtype()
        );
    }
    Ok(())
}

/// Checks that `targets` have the `rows` of the stage's input.
pub(crate) fn check_target_rows(model: &str, targets: &Tensor, rows: usize) -> Result<()> {
    if rows != targets.dims()[0] {
        meshgrad_tensor::bail!(
            "{model} stage: targets {} do not match the batch of the input ({rows} rows)",
            targets.shape()
        );
    }
    Ok(())
}

/// Checks that a model can generate: it is whole (`full`; `spec` its stage) and the logits of
/// its `head` are not split over tensor-parallel ranks.
pub(crate) fn check_generate<'a>(
    model: &str,
    (spec, full): (&StageSpec, bool),
    head: impl FnOnce() -> Result<&'a LmHead>,
) -> Result<()> {
    if !full {
        meshgrad_tensor::bail!("generate: this {model} is a stage ({spec}), not the whole model");
    }
    if head()?.vocab_parallel().is_some() {
        meshgrad_tensor::bail!(
            "generate: this model's logits are split over tensor-parallel ranks; generate from a \
             single-device model (load the gathered checkpoint)"
        );
    }
    Ok(())
}
