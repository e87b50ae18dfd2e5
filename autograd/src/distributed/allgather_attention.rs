//! All-gather attention: self-attention over a sequence split across a context-parallel group,
//! the keys and values all-gathered once (`--cp-mode allgather`, [`allgather_attention()`]),
//! the alternative to the [ring](super::ring_attention()) that Megatron-LM and torchtitan also
//! offer.
//!
//! Each rank holds chunks `i` and `2C - 1 - i` of `2C` ([`ChunkOrder`]). The group all-gathers
//! every rank's keys and values (its backward reduce-scatters their gradients home; both are spans
//! of `--trace`) and keeps, in sequence order, the chunks its queries read (those up to its later
//! chunk `2C - 1 - i`; the whole sequence without the causal mask); each local query chunk `g` then
//! attends, in one fused kernel call, to the keys of chunks `0..=g` with the causal mask aligned
//! bottom-right (query `j` of chunk `g` sees keys up to position `g L + j`). Without the causal
//! mask (BERT) both query chunks attend to the whole sequence at once, masked by the all-gathered
//! key padding.
//!
//! Against the ring: one collective per direction instead of `C - 1` hops, no combination of
//! partial results (so one device's online softmax over the keys, in sequence order), but a
//! rank holds, and the backward keeps, up to the whole sequence's keys and values (`(2C + 1) /
//! 2` times its own: the longer prefix, and the shorter one's contiguous copy that attention
//! keeps).

use meshgrad_tensor::{AttentionMask, Result};

use super::ring_attention::RingAttention;
use super::{gather_along, reduce_scatter_along, ChunkOrder, Group};
use crate::Var;

/// The first `chunks` chunks of the sequence of every rank's `x` (`[B, H, 2L, D]`, chunks `i`
/// and `2C - 1 - i`) along dimension 2, in sequence order and contiguous (`[B, H, chunks L,
/// D]`): one all-gather forward; backward, the gradient's chunks put back in rank order (zeros
/// past the prefix) and reduce-scattered home. Only the prefix stays with the graph; both
/// transfers are spans of the group's timeline (`--trace`) named `what`.
fn gathered_prefix(x: &Var, group: &Group, chunks: usize, what: &'static str) -> Result<Var> {
    let (size, half) = (group.size(), x.tensor().dims()[2] / 2);
    let raw = group.traced(
        &|| format!("{} all-gather {what} forward", group.describe()),
        &mut || gather_along(&x.tensor().contiguous()?, 2, &**group),
    )?;
    let pieces: Vec<_> = (0..chunks)
        .map(|g| raw.narrow(2, ChunkOrder::gathered_piece(size, g) * half, half))
        .collect::<Result<_>>()?;
    let refs: Vec<_> = pieces.iter().collect();
    let prefix = meshgrad_tensor::Tensor::cat(&refs, 2)?.contiguous()?;
    drop((pieces, raw));
    let g = group.clone();
    Ok(Var::from_op(
        "allgather_attention_gather",
        prefix,
        &[x],
        Box::new(move |grad, _| {
            // Rank order: piece 2 r + s is rank r's chunk s; zeros past the prefix.
            let zero = grad.narrow(2, 0, half)?.zeros_like()?;
            let by_rank: Vec<_> = (0..2 * size)
                .map(|p| {
                    let g = ChunkOrder::new(p / 2, size).chunks()[p % 2];
                    match g < chunks {
                        true => grad.narrow(2, g * half, half),
                        false => Ok(zero.clone()),
                    }
                })
                .collect::<Result<_>>()?;
            let refs: Vec<_> = by_rank.iter().collect();
            let full = meshgrad_tensor::Tensor::cat(&refs, 2)?;
            let back = g.traced(
                &|| format!("{} reduce-scatter {what} gradients backward", g.describe()),
                &mut || reduce_scatter_along(&full, 2, &*g),
            )?;
            Ok(vec![Some(back)])
        }),
    ))
}

/// Self-attention of this rank's `q`, `k`, `v` (`[B, H, 2L, D]`, chunks `i` and `2C - 1 - i`)
/// over the whole sequence, the keys and values all-gathered (see the [module docs](self)):
/// `[B, H, 2L, D]`. Errors (one line): shapes that differ or are not 4-D, an odd local length,
/// a padding mask not `[B, 2L]`.
pub fn allgather_attention(args: RingAttention<'_>) -> Result<Var> {
    let group: &Group = args.group;
    let (b, len) = args.checked_sizes("all-gather attention")?;
    let (size, me, half) = (group.size(), group.rank(), len / 2);
    // Query chunk g (of 2C) attends to the keys of chunks 0..=g; the later local chunk
    // (2C - 1 - i) reads the longest prefix, the earlier one (i) a part of it.
    let chunks = if args.causal { 2 * size - me } else { 2 * size };
    let k = gathered_prefix(args.k, group, chunks, "keys")?;
    let v = gathered_prefix(args.v, group, chunks, "values")?;
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
            let pieces: Vec<Var> = (0..2 * size)
                .map(|g| rows.narrow(1, ChunkOrder::gathered_piece(size, g) * half, half))
                .collect::<Result<_>>()?;
            let refs: Vec<&Var> = pieces.iter().collect();
            mask = mask.with_key_padding(Var::cat(&refs, 1)?.tensor().contiguous()?);
        }
        return Var::attention(args.q, &k, &v, &mask, args.scale);
    }
    // Causal, aligned bottom-right: query j of chunk g sees keys up to g L + j.
    let outs: Vec<Var> = ChunkOrder::new(me, size)
        .chunks()
        .iter()
        .enumerate()
        .map(|(h, &g)| {
            let keys = (g + 1) * half;
            let (k, v) = match keys == chunks * half {
                true => (k.clone(), v.clone()),
                false => (k.narrow(2, 0, keys)?, v.narrow(2, 0, keys)?),
            };
            Var::attention(
                &args.q.narrow(2, h * half, half)?,
                &k,
                &v,
                &AttentionMask::causal(),
                args.scale,
            )
        })
        .collect::<Result<_>>()?;
    Var::cat(&[&outs[0], &outs[1]], 2)
}

/// Which attention a context-parallel group runs (`--cp-mode`).
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
