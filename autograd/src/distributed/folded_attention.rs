//! Reference mode's attention under context parallelism: self-attention over a sequence split
//! across a context-parallel group whose every number is one device's
//! ([`folded_attention()`]).
//!
//! The sequence is cut into the `2K` fine chunks of [`FoldedPositions`] (`K` does not depend on
//! the group). The group all-gathers the keys and values once (exact copies); each rank then
//! runs, for each of its query chunks `a` and every key chunk `b` it attends to (`b <= a` under
//! a causal mask, causal within `b == a`; every `b` without), one fused attention call on the
//! pair, of the same shapes on every layout. The pairs' `(out, lse)` are combined by the
//! online-softmax rule in ascending `b` (one fixed order; the rule of
//! [`ring_attention`](super::ring_attention())). Backward, each pair's fused backward gives its
//! share of `dq`, `dk`, `dv`: a query chunk's `dq` adds its pairs in ascending `b`; key chunk
//! `b`'s `dk` and `dv` add, per position leaf, the shares of the leaf's two query chunks, then
//! the leaves in their aligned tree: each rank the subtree of its leaves, the group's tree
//! all-reduce the rest ([`FoldedPositions::sum_over_group`]), and each rank keeps its chunks.
//! One device is the group of one rank: the same calls, combinations and trees.
//!
//! The price is the all-gather instead of the ring (every rank holds every key and value) and
//! `O(K^2)` small kernel calls: reference mode's trade.

use meshgrad_tensor::tree_sum::tree_sum;
use meshgrad_tensor::{AttentionMask, AttentionOutput, DType, Result, Tensor};

use super::folded::FoldedPositions;
use super::RingAttention;
use crate::Var;

/// Everything the pairs need: the group's keys and values and padding, by rank.
struct Gathered {
    /// Per rank: keys and values `[2, B, H, 2L, D]`.
    kv: Vec<Tensor>,
    /// Per rank: key padding `[B, 2L]`.
    pads: Option<Vec<Tensor>>,
    f: usize,
    causal: bool,
    scale: f64,
}

impl Gathered {
    /// Global key chunk `c`'s keys, values and mask for query chunk `q` (global).
    fn keys(
        &self,
        positions: &FoldedPositions,
        c: usize,
        q: usize,
    ) -> Result<(Tensor, Tensor, AttentionMask)> {
        let (r, lc) = positions.owner_of(c);
        let kv = self.kv[r].narrow(3, lc * self.f, self.f)?;
        let k = kv.narrow(0, 0, 1)?.squeeze(0)?.contiguous()?;
        let v = kv.narrow(0, 1, 1)?.squeeze(0)?.contiguous()?;
        let mut mask = AttentionMask {
            causal: self.causal && c == q,
            ..AttentionMask::none()
        };
        if let Some(pads) = &self.pads {
            mask = mask.with_key_padding(pads[r].narrow(1, lc * self.f, self.f)?.contiguous()?);
        }
        Ok((k, v, mask))
    }

    /// The key chunks query chunk `q` (global, of `2K`) attends to, in order.
    fn sources(&self, q: usize, chunks: usize) -> std::ops::Range<usize> {
        if self.causal {
            0..q + 1
        } else {
            0..chunks
        }
    }
}

/// Self-attention over the sequence split across `args.group` (the ring's arguments), every
/// number as one device computes it in reference mode with `leaves` position leaves (see the
/// [module docs](self)): this rank's output `[B, H, 2L, D]`, and the gradients of `q`, `k` and
/// `v` in backward (every member of the group runs its backwards in the same order, as its
/// forwards).
///
/// Errors are one line: operands not all `[B, H, 2L, D]` of one shape, leaves that are not a
/// power of two the group size divides, a local length that does not split into the rank's
/// fine chunks, a padding mask not `[B, 2L]`.
pub fn folded_attention(args: RingAttention<'_>, leaves: usize) -> Result<Var> {
    let positions = FoldedPositions::new(leaves, args.group.clone())?;
    let group = args.group.clone();
    let (q, k, v) = (
        args.q.tensor().contiguous()?,
        args.k.tensor().contiguous()?,
        args.v.tensor().contiguous()?,
    );
    if q.rank() != 4 || k.shape() != q.shape() || v.shape() != q.shape() {
        meshgrad_tensor::bail!(
            "folded attention (rank {} of {}): q {}, k {}, v {} must be one shape [B, H, 2L, D]",
            group.rank(),
            group.describe(),
            q.shape(),
            k.shape(),
            v.shape()
        );
    }
    let (b, len) = (q.dims()[0], q.dims()[2]);
    let f = positions.chunk_len(len)?;
    let stacked = Tensor::stack(&[&k, &v], 0)?.contiguous()?;
    let size = group.size();
    let kv: Vec<Tensor> = if size == 1 {
        vec![stacked]
    } else {
        let all = group.all_gather(&stacked)?;
        (0..size)
            .map(|r| all.narrow(0, 2 * r, 2))
            .collect::<Result<_>>()?
    };
    let pads = match args.key_padding {
        None => None,
        Some(p) if p.dims() != [b, len] => meshgrad_tensor::bail!(
            "folded attention: key padding {} is not [B, 2L] = [{b}, {len}]",
            p.shape()
        ),
        Some(p) if size == 1 => Some(vec![p.clone()]),
        Some(p) => {
            let all = group.all_gather(&p.contiguous()?)?;
            Some(
                (0..size)
                    .map(|r| all.narrow(0, r * b, b))
                    .collect::<Result<_>>()?,
            )
        }
    };
    let gathered = Gathered {
        kv,
        pads,
        f,
        causal: args.causal,
        scale: args.scale,
    };
    let fwd = forward(&positions, &gathered, &q)?;
    let out = fwd.out.clone();
    Ok(Var::from_op(
        "folded_attention",
        out,
        &[args.q, args.k, args.v],
        Box::new(move |g, _| {
            let (dq, dk, dv) = backward(&positions, &gathered, &q, &fwd, g)?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        }),
    ))
}

/// Local query chunk `lq`'s rows of `t` along dimension 2.
fn chunk(t: &Tensor, lq: usize, f: usize) -> Result<Tensor> {
    t.narrow(2, lq * f, f)?.contiguous()
}

/// The combined output (q's dtype) and row log-sum-exp of this rank's queries.
fn forward(
    positions: &FoldedPositions,
    gathered: &Gathered,
    q: &Tensor,
) -> Result<AttentionOutput> {
    let f = gathered.f;
    let chunks = 2 * positions.leaves();
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for lq in 0..q.dims()[2] / f {
        let gq = positions.global_chunk(lq);
        let qc = chunk(q, lq, f)?;
        let mut acc: Option<(Tensor, Tensor)> = None;
        for c in gathered.sources(gq, chunks) {
            let (kc, vc, mask) = gathered.keys(positions, c, gq)?;
            let part = Tensor::attention(&qc, &kc, &vc, &mask, gathered.scale)?;
            let part_out = part.out.to_dtype(part.lse.dtype())?;
            acc = Some(match acc {
                None => (part_out, part.lse),
                Some((o, l)) => super::ring_attention::combine((&o, &l), (&part_out, &part.lse))?,
            });
        }
        let (o, l) = acc.expect("a query chunk attends to at least its own keys");
        outs.push(o);
        lses.push(l);
    }
    let out_refs: Vec<&Tensor> = outs.iter().collect();
    let lse_refs: Vec<&Tensor> = lses.iter().collect();
    Ok(AttentionOutput {
        out: Tensor::cat(&out_refs, 2)?
            .to_dtype(q.dtype())?
            .contiguous()?,
        lse: Tensor::cat(&lse_refs, 2)?.contiguous()?,
    })
}

/// `(dq, dk, dv)` of this rank's queries, keys and values, in the operands' dtype.
fn backward(
    positions: &FoldedPositions,
    gathered: &Gathered,
    q: &Tensor,
    fwd: &AttentionOutput,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let f = gathered.f;
    let compute: DType = fwd.lse.dtype();
    let chunks = 2 * positions.leaves();
    let local = q.dims()[2] / f;
    let dout = dout.contiguous()?;
    // Per local query chunk: dq, and each key chunk's (dk, dv) share stacked [2, B, H, f, D].
    let mut dqs = Vec::with_capacity(local);
    let mut shares: Vec<Vec<Option<Tensor>>> = vec![vec![None; chunks]; local];
    for (lq, row) in shares.iter_mut().enumerate() {
        let gq = positions.global_chunk(lq);
        let sub = AttentionOutput {
            out: chunk(&fwd.out, lq, f)?,
            lse: fwd.lse.narrow(2, lq * f, f)?.contiguous()?,
        };
        let (qc, dc) = (chunk(q, lq, f)?, chunk(&dout, lq, f)?);
        let mut dq: Option<Tensor> = None;
        for c in gathered.sources(gq, chunks) {
            let (kc, vc, mask) = gathered.keys(positions, c, gq)?;
            let g =
                Tensor::attention_backward(&qc, &kc, &vc, &sub, &dc, &mask, gathered.scale, false)?;
            let part = g.dq.to_dtype(compute)?;
            dq = Some(match dq {
                None => part,
                Some(d) => d.add(&part)?,
            });
            row[c] = Some(Tensor::stack(&[&g.dk, &g.dv], 0)?.to_dtype(compute)?);
        }
        dqs.push(dq.expect("a query chunk attends to at least its own keys"));
    }
    // Key chunk c's gradient: per leaf a (local query chunks a and 2m - 1 - a) the two shares
    // added, the leaves' subtree here and the rest of the tree over the group.
    let m = positions.local_leaves();
    let kv_shape = {
        let mut d = vec![2];
        d.extend_from_slice(&q.dims()[..2]);
        d.extend([f, q.dims()[3]]);
        d
    };
    let zero = Tensor::zeros(kv_shape, compute, q.device())?;
    let per_chunk: Vec<Tensor> = (0..chunks)
        .map(|c| {
            let leaves: Vec<Tensor> = (0..m)
                .map(|a| match (&shares[a][c], &shares[2 * m - 1 - a][c]) {
                    (Some(x), Some(y)) => x.add(y),
                    (Some(x), None) | (None, Some(x)) => Ok(x.clone()),
                    (None, None) => Ok(zero.clone()),
                })
                .collect::<Result<_>>()?;
            tree_sum(&leaves)
        })
        .collect::<Result<_>>()?;
    // In the group's layout: rank r's local chunks side by side, ranks stacked.
    let size = positions.group().size();
    let mut by_rank = Vec::with_capacity(size);
    for r in 0..size {
        let parts: Vec<&Tensor> = (0..local)
            .map(|lc| &per_chunk[positions.chunk_at(r, lc)])
            .collect();
        by_rank.push(Tensor::cat(&parts, 3)?);
    }
    let refs: Vec<&Tensor> = by_rank.iter().collect();
    let all = positions.sum_over_group(&[Tensor::stack(&refs, 0)?])?;
    let mine = all
        .narrow(0, positions.group().rank(), 1)?
        .squeeze(0)?
        .to_dtype(q.dtype())?;
    let dq_refs: Vec<&Tensor> = dqs.iter().collect();
    Ok((
        Tensor::cat(&dq_refs, 2)?.to_dtype(q.dtype())?,
        mine.narrow(0, 0, 1)?.squeeze(0)?.contiguous()?,
        mine.narrow(0, 1, 1)?.squeeze(0)?.contiguous()?,
    ))
}
