//! All-gather attention: self-attention over a sequence split across a context-parallel group,
//! the keys and values all-gathered once (`--cp-mode allgather`, [`allgather_attention()`]),
//! the alternative to the [ring](super::ring_attention()) that Megatron-LM and torchtitan also
//! offer.
//!
//! Each rank holds chunks `i` and `2C - 1 - i` of `2C` ([`ChunkOrder`](super::ChunkOrder)). The
//! group all-gathers every rank's keys and values (its backward reduce-scatters their gradients
//! home; both are spans of `--trace`) and puts the chunks in sequence order; each local query
//! chunk `g` then attends, in one fused kernel call, to the keys of chunks `0..=g` with the
//! causal mask aligned bottom-right (query `j` of chunk `g` sees keys up to position
//! `g L + j`). Without the causal mask (BERT) both query chunks attend to the whole sequence
//! at once, masked by the all-gathered key padding.
//!
//! Against the ring: one collective per direction instead of `C - 1` hops, no combination of
//! partial results (so one device's online softmax over the keys, in sequence order), but every
//! rank holds, and the backward keeps, the whole sequence's keys and values.

use meshgrad_tensor::{AttentionMask, Result};

use super::ring_attention::RingAttention;
use super::{gather_along, reduce_scatter_along, Group};
use crate::Var;

/// Every rank's `x` concatenated along `dim` (forward), the gradients' sum cut back to this
/// rank's part (backward), each one span of the group's timeline (`--trace`) named `what`.
fn gather_traced(x: &Var, dim: usize, group: &Group, what: &'static str) -> Result<Var> {
    let full = group.traced(
        &|| format!("{} all-gather {what} forward", group.describe()),
        &mut || gather_along(x.tensor(), dim, &**group),
    )?;
    let g = group.clone();
    Ok(Var::from_op(
        "allgather_attention_gather",
        full,
        &[x],
        Box::new(move |grad, _| {
            let back = g.traced(
                &|| format!("{} reduce-scatter {what} gradients backward", g.describe()),
                &mut || reduce_scatter_along(grad, dim, &*g),
            )?;
            Ok(vec![Some(back)])
        }),
    ))
}

/// The chunks of an all-gathered `[.., C 2L, ..]` (rank `r`'s chunks `r` and `2C - 1 - r` at
/// `r 2L`) along `dim`, put in sequence order: chunk `g` of `2C`.
fn sequence_order(all: &Var, dim: usize, size: usize, half: usize) -> Result<Var> {
    let pieces: Vec<Var> = (0..2 * size)
        .map(|g| {
            let (rank, second) = if g < size {
                (g, 0)
            } else {
                (2 * size - 1 - g, 1)
            };
            all.narrow(dim as isize, (2 * rank + second) * half, half)
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Var> = pieces.iter().collect();
    Var::cat(&refs, dim as isize)
}

/// Self-attention of this rank's `q`, `k`, `v` (`[B, H, 2L, D]`, chunks `i` and `2C - 1 - i`)
/// over the whole sequence, the keys and values all-gathered (see the [module docs](self)):
/// `[B, H, 2L, D]`. Errors (one line): shapes that differ or are not 4-D, an odd local length,
/// a padding mask not `[B, 2L]`.
pub fn allgather_attention(args: RingAttention<'_>) -> Result<Var> {
    let group: &Group = args.group;
    let q = args.q.tensor();
    let where_ = || {
        format!(
            "all-gather attention (rank {} of {})",
            group.rank(),
            group.describe()
        )
    };
    if q.rank() != 4 || args.k.tensor().shape() != q.shape() || args.v.tensor().shape() != q.shape()
    {
        meshgrad_tensor::bail!(
            "{}: q {}, k {}, v {} must be one shape [B, H, 2L, D]",
            where_(),
            q.shape(),
            args.k.tensor().shape(),
            args.v.tensor().shape()
        );
    }
    let (b, len) = (q.dims()[0], q.dims()[2]);
    if len == 0 || !len.is_multiple_of(2) {
        meshgrad_tensor::bail!(
            "{}: the local sequence of {len} positions is not two equal chunks (q {})",
            where_(),
            q.shape()
        );
    }
    if let Some(p) = args.key_padding.filter(|p| p.dims() != [b, len]) {
        meshgrad_tensor::bail!(
            "{}: key padding {} is not [B, 2L] = [{b}, {len}]",
            where_(),
            p.shape()
        );
    }
    let (size, me, half) = (group.size(), group.rank(), len / 2);
    let gather = |x: &Var, what: &'static str| -> Result<Var> {
        let all = gather_traced(&x.contiguous()?, 2, group, what)?;
        sequence_order(&all, 2, size, half)
    };
    let (k, v) = (gather(args.k, "keys")?, gather(args.v, "values")?);
    if !args.causal {
        let mut mask = AttentionMask::none();
        if let Some(p) = args.key_padding {
            let all = Var::constant(group.all_gather(&p.contiguous()?)?);
            // [C B, 2L] by rank -> [B, C 2L] by rank -> sequence order.
            let by_rank: Vec<Var> = (0..size)
                .map(|r| all.narrow(0, r * b, b))
                .collect::<Result<_>>()?;
            let refs: Vec<&Var> = by_rank.iter().collect();
            let rows = Var::cat(&refs, 1)?;
            mask = mask.with_key_padding(
                sequence_order(&rows, 1, size, half)?
                    .tensor()
                    .contiguous()?,
            );
        }
        return Var::attention(args.q, &k, &v, &mask, args.scale);
    }
    // Query chunk g of the sequence attends to the keys of chunks 0..=g, causal bottom-right.
    let outs: Vec<Var> = [me, 2 * size - 1 - me]
        .iter()
        .enumerate()
        .map(|(h, &g)| {
            let keys = (g + 1) * half;
            Var::attention(
                &args.q.narrow(2, h * half, half)?.contiguous()?,
                &k.narrow(2, 0, keys)?.contiguous()?,
                &v.narrow(2, 0, keys)?.contiguous()?,
                &AttentionMask::causal(),
                args.scale,
            )
        })
        .collect::<Result<_>>()?;
    Var::cat(&[&outs[0], &outs[1]], 2)
}

/// Which attention a context-parallel group runs (`train.cp_mode`, `--cp-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CpMode {
    /// Ring attention: keys and values pass around the group, `C - 1` hops
    /// ([`ring_attention()`](super::ring_attention())).
    #[default]
    Ring,
    /// The keys and values all-gathered once ([`allgather_attention()`]).
    AllGather,
}

impl CpMode {
    /// The config spelling: `ring` or `allgather`.
    pub fn as_str(self) -> &'static str {
        match self {
            CpMode::Ring => "ring",
            CpMode::AllGather => "allgather",
        }
    }

    /// From the config spelling, or a one-line error naming both.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ring" => Ok(CpMode::Ring),
            "allgather" => Ok(CpMode::AllGather),
            other => meshgrad_tensor::bail!(
                "context parallelism: cp mode '{other}' is not \"ring\" or \"allgather\""
            ),
        }
    }
}
