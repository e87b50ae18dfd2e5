//! Ring attention: self-attention over a sequence split across a context-parallel group, as a
//! differentiable function ([`ring_attention()`]).
//!
//! Each rank holds two chunks of every sequence ([`ChunkOrder`](super::ChunkOrder): chunks `i` and `2C - 1 - i` of
//! `2C`) and its queries, keys and values for them. The keys and values pass around the ring
//! ([`Collectives::ring_shift`](super::Collectives::ring_shift), `C - 1` hops): at step `s` rank `i` holds those of rank
//! `j = i - s` (mod `C`) and attends its queries to them with the fused attention kernel. Under
//! a causal mask the chunk pairs decide what runs (Megatron-LM's and torchtitan's split):
//!
//! | source `j` | queries              | keys                   | mask   |
//! |------------|----------------------|------------------------|--------|
//! | `j == i`   | both chunks          | both chunks            | causal (the local order is the global order) |
//! | `j < i`    | both chunks          | the first (chunk `j`)  | none: it precedes both query chunks; chunk `2C-1-j` follows both |
//! | `j > i`    | the second           | both chunks            | none: both precede chunk `2C-1-i` and follow chunk `i` |
//!
//! Without the causal mask (BERT) every step is both chunks against both chunks; a key padding
//! mask `[B, 2L]` is all-gathered once, so each step masks the keys it holds with their owner's
//! padding. Partial results combine by the online-softmax rule on the kernel's row
//! log-sum-exp: `lse = log(e^lse1 + e^lse2)`, `out = e^(lse1 - lse) out1 + e^(lse2 - lse) out2`,
//! in the kernel's compute precision (a row that has seen no key yet has `lse = -inf` and a zero
//! output, and stays so until it sees one).
//!
//! The backward runs the same ring with the final `out` and `lse`: the fused backward of each
//! pair, given the whole row's `out` and `lse`, returns exactly that pair's share of `dq`, `dk`,
//! `dv`. `dq` stays local; the keys' and values' gradients travel with them (one message of
//! keys, values and their partial gradients per hop) and, after the last step, one more hop
//! brings each block's sum home to its owner.
//!
//! # Not bit-identical to one device; what reference mode runs instead
//!
//! A context-parallel run through this ring matches one device to rounding, not bit for bit.
//! Reference mode (`--reference` with `train.reference_positions=folded`) therefore runs
//! [`folded_attention`](super::folded_attention()) instead, and fixes the other sums over
//! positions with [`FoldedPositions`](super::FoldedPositions); on one device too. Where the
//! bits part, and how reference mode fixes each:
//!
//! 1. **The combination order over keys.** Rank `i` combines its key blocks in ring order
//!    (`i, i-1, ..., i+1` mod `C`) by the rule above, which rounds (`exp`, `log`, the weighted
//!    sum), so the result depends on the order; one device's fused kernel runs the online
//!    softmax over key tiles in sequence order instead. *Fix*: the same kernel calls everywhere,
//!    on pairs of fine query and key chunks (`2K` chunks, `K` independent of `C`), each query
//!    chunk's pairs combined in ascending key order; in backward a query chunk's `dq` adds its
//!    pairs in that order, and a key chunk's `dk`, `dv` add the query chunks' shares per
//!    position leaf and then over the leaves' tree (each rank its subtree, the group's tree
//!    all-reduce the rest). Instead of one message per hop carrying one partial per query
//!    chunk, the group all-gathers the keys and values once: simpler, and exact, at the cost of
//!    every rank holding every key and value.
//! 2. **Parameter gradients are sums over positions.** A weight gradient `g^T x` is one matmul
//!    whose inner dimension is the token count (`B T` on one device, `B 2L` on a rank),
//!    accumulated along the tokens by gemm in blocks that depend on that count, and the ranks'
//!    partial sums are then added by the gradient all-reduce: another association of the same
//!    terms. The same holds for biases, norms, the embedding tables and the loss's token mean;
//!    and gemm may pick its kernel by the row count, so even a row's output may depend on how
//!    many rows a rank holds. *Fix*: every layer runs once per position leaf (leaf `j` = fine
//!    chunks `j` and `2K-1-j`), on tensors of the same shape on every layout, and its
//!    parameters' gradients are the tree over the leaves; the *folded* leaves make each rank's
//!    chunks an aligned block of leaves for every power of two `C` dividing `K`, so a subtree,
//!    and the cp group's tree all-reduce completes each row group's tree inside its backward.
//!    The sum lands on the group's first rank (zeros elsewhere), so the data-parallel tree over
//!    `dp x cp` ranks adds each row group's once, after the row groups' tree, as one device.
//!    The loss adds its rows per leaf and over the same tree.
//! 3. **That tree is not the one reference mode uses over positions by default.** Tensor
//!    parallelism's position sums (layer norms, row-parallel biases, sequence-parallel
//!    linears) are trees over `K` chunks in sequence order, so that a sequence-parallel rank's
//!    contiguous positions are a subtree. Subtrees of one binary tree are nested or disjoint,
//!    and `{first half}` (sp = 2) and `{chunks 0, 3 of 4}` (cp = 2) are neither: no single
//!    one-device reference run can serve both. *Fix*: the order is a setting both runs share,
//!    `train.reference_positions` (`sequence`, the default, or `folded`).

use std::ops::Range;

use meshgrad_tensor::{AttentionMask, AttentionOutput, DType, Result, Tensor};

use super::Group;
use crate::Var;

/// The arguments of [`ring_attention()`].
pub struct RingAttention<'a> {
    /// This rank's queries `[B, H, 2L, D]` (its two chunks side by side, [`ChunkOrder`](super::ChunkOrder)).
    pub q: &'a Var,
    /// This rank's keys, shaped like `q`.
    pub k: &'a Var,
    /// This rank's values, shaped like `q`.
    pub v: &'a Var,
    /// This rank's key padding `[B, 2L]` (integer, nonzero = attend), if any.
    pub key_padding: Option<&'a Tensor>,
    /// Causal masking over the global positions.
    pub causal: bool,
    /// The score scale (usually `1 / sqrt(D)`).
    pub scale: f64,
    /// The context-parallel group (the ring).
    pub group: &'a Group,
}

impl RingAttention<'_> {
    /// The batch size and local length `(B, 2L)`, after the checks both context-parallel
    /// attentions make (one-line errors naming `name` and the rank): q, k and v of one 4-D shape
    /// `[B, H, 2L, D]`, an even local length, a padding mask `[B, 2L]`.
    pub(crate) fn checked_sizes(&self, name: &str) -> Result<(usize, usize)> {
        let (q, k, v) = (self.q.tensor(), self.k.tensor(), self.v.tensor());
        let where_ = || {
            format!(
                "{name} (rank {} of {})",
                self.group.rank(),
                self.group.describe()
            )
        };
        if q.rank() != 4 || k.shape() != q.shape() || v.shape() != q.shape() {
            meshgrad_tensor::bail!(
                "{}: q {}, k {}, v {} must be one shape [B, H, 2L, D]",
                where_(),
                q.shape(),
                k.shape(),
                v.shape()
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
        if let Some(p) = self.key_padding.filter(|p| p.dims() != [b, len]) {
            meshgrad_tensor::bail!(
                "{}: key padding {} is not [B, 2L] = [{b}, {len}]",
                where_(),
                p.shape()
            );
        }
        Ok((b, len))
    }
}

/// Which queries of this rank meet which keys of the block it holds, and how.
#[derive(Clone, Debug)]
struct Pair {
    queries: Range<usize>,
    keys: Range<usize>,
    causal: bool,
}

/// The pair of this rank (`me`) and the keys of rank `src` (local length `2L`), see the
/// [module docs](self).
fn pair(me: usize, src: usize, len: usize, causal: bool) -> Pair {
    let (all, half) = (0..len, len / 2);
    match (causal, src.cmp(&me)) {
        (false, _) => Pair {
            queries: all.clone(),
            keys: all,
            causal: false,
        },
        (true, std::cmp::Ordering::Equal) => Pair {
            queries: all.clone(),
            keys: all,
            causal: true,
        },
        (true, std::cmp::Ordering::Less) => Pair {
            queries: all,
            keys: 0..half,
            causal: false,
        },
        (true, std::cmp::Ordering::Greater) => Pair {
            queries: half..len,
            keys: all,
            causal: false,
        },
    }
}

/// Rows `r` of `t` along dimension `dim` (a view).
fn rows(t: &Tensor, dim: usize, r: &Range<usize>) -> Result<Tensor> {
    t.narrow(dim as isize, r.start, r.len())
}

/// `t` with rows `r` of dimension `dim` replaced by `f(those rows)`.
fn update_rows(
    t: &Tensor,
    dim: usize,
    r: &Range<usize>,
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let n = t.dims()[dim];
    let mid = f(&rows(t, dim, r)?)?;
    if r.start == 0 && r.end == n {
        return Ok(mid);
    }
    let mut parts = Vec::new();
    if r.start > 0 {
        parts.push(rows(t, dim, &(0..r.start))?);
    }
    parts.push(mid);
    if r.end < n {
        parts.push(rows(t, dim, &(r.end..n))?);
    }
    let refs: Vec<&Tensor> = parts.iter().collect();
    Tensor::cat(&refs, dim as isize)
}

/// The online-softmax combination of two partial results `(out [.., T, D], lse [.., T])` over
/// disjoint key sets (see the [module docs](self)); both in one float dtype.
pub(super) fn combine(a: (&Tensor, &Tensor), b: (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
    let (o1, l1) = a;
    let (o2, l2) = b;
    // A finite stand-in for a maximum of -inf (no key seen on either side): the weights are
    // then 0 and the row stays (0, -inf).
    let m = l1.maximum(l2)?.clamp(Some(f32::MIN as f64), None)?;
    let w1 = l1.sub(&m)?.exp()?;
    let w2 = l2.sub(&m)?.exp()?;
    let s = w1.add(&w2)?;
    let lse = m.add(&s.log()?)?;
    // s >= 1 whenever a side has seen a key (its weight is e^0), 0 otherwise.
    let denom = s.clamp(Some(1.0), None)?.unsqueeze(-1)?;
    let out = o1
        .mul(&w1.unsqueeze(-1)?)?
        .add(&o2.mul(&w2.unsqueeze(-1)?)?)?
        .div(&denom)?;
    Ok((out, lse))
}

/// Everything the ring needs besides the operands.
#[derive(Clone)]
struct Ring {
    group: Group,
    causal: bool,
    scale: f64,
    /// Every rank's key padding `[B, 2L]`, by rank.
    pads: Option<Vec<Tensor>>,
}

impl Ring {
    fn size(&self) -> usize {
        self.group.size()
    }
    fn rank(&self) -> usize {
        self.group.rank()
    }
    /// The rank whose keys this rank holds at step `s`.
    fn source(&self, s: usize) -> usize {
        (self.rank() + self.size() - s % self.size()) % self.size()
    }
    /// One ring shift of `t`, traced as `<group> ring <what()>` (see
    /// [`Collectives::traced`](super::Collectives::traced)).
    fn hop(&self, t: &Tensor, what: impl Fn() -> String) -> Result<Tensor> {
        self.group.traced(
            &|| format!("{} ring {}", self.group.describe(), what()),
            &mut || self.group.ring_shift(t),
        )
    }
    fn mask(&self, src: usize, p: &Pair) -> Result<AttentionMask> {
        let mut m = AttentionMask {
            causal: p.causal,
            ..AttentionMask::none()
        };
        if let Some(pads) = &self.pads {
            m = m.with_key_padding(rows(&pads[src], 1, &p.keys)?.contiguous()?);
        }
        Ok(m)
    }
}

/// Keys and values stacked as one message `[2, B, H, 2L, D]`, and back.
fn stack_kv(k: &Tensor, v: &Tensor) -> Result<Tensor> {
    Tensor::stack(&[k, v], 0)?.contiguous()
}
fn unstack(t: &Tensor, i: usize) -> Result<Tensor> {
    let dims = t.dims()[1..].to_vec();
    t.narrow(0, i, 1)?.contiguous()?.reshape(dims)
}

/// Self-attention over the sequence split across `args.group` (see the [module docs](self)):
/// this rank's output `[B, H, 2L, D]` for its queries, over every rank's keys; the gradients of
/// `q`, `k` and `v` in backward (a ring over the group again: every member runs the backward of
/// its ring attentions in the same order, as it runs their forwards). On a group of one rank it
/// is plain fused attention over the local sequence.
///
/// Errors are one line naming the shapes and the group: operands not all `[B, H, 2L, D]` of one
/// shape, an odd local length, a padding mask not `[B, 2L]`.
pub fn ring_attention(args: RingAttention<'_>) -> Result<Var> {
    let group = args.group;
    let (b, _) = args.checked_sizes("ring attention")?;
    let (q, k, v) = (
        args.q.tensor().contiguous()?,
        args.k.tensor().contiguous()?,
        args.v.tensor().contiguous()?,
    );
    let pads = match args.key_padding {
        None => None,
        Some(p) if group.size() == 1 => Some(vec![p.clone()]),
        Some(p) => {
            let all = group.all_gather(&p.contiguous()?)?;
            Some(
                (0..group.size())
                    .map(|r| all.narrow(0, r * b, b)?.contiguous())
                    .collect::<Result<_>>()?,
            )
        }
    };
    let ring = Ring {
        group: group.clone(),
        causal: args.causal,
        scale: args.scale,
        pads,
    };
    let fwd = forward(&ring, &q, &k, &v)?;
    let out = fwd.out.clone();
    Ok(Var::from_op(
        "ring_attention",
        out,
        &[args.q, args.k, args.v],
        Box::new(move |g, _| {
            let (dq, dk, dv) = backward(&ring, (&q, &k, &v), &fwd, g)?;
            Ok(vec![Some(dq), Some(dk), Some(dv)])
        }),
    ))
}

/// The forward ring: the combined output (q's dtype) and row log-sum-exp.
fn forward(ring: &Ring, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionOutput> {
    let len = q.dims()[2];
    let mut kv = stack_kv(k, v)?;
    let mut acc: Option<(Tensor, Tensor)> = None;
    for s in 0..ring.size() {
        if s > 0 {
            kv = ring.hop(&kv, || format!("hop {s}/{} forward", ring.size() - 1))?;
        }
        let src = ring.source(s);
        let p = pair(ring.rank(), src, len, ring.causal);
        let (kb, vb) = (unstack(&kv, 0)?, unstack(&kv, 1)?);
        let part = Tensor::attention(
            &rows(q, 2, &p.queries)?,
            &rows(&kb, 2, &p.keys)?,
            &rows(&vb, 2, &p.keys)?,
            &ring.mask(src, &p)?,
            ring.scale,
        )?;
        let compute = part.lse.dtype();
        let part_out = part.out.to_dtype(compute)?;
        acc = Some(match acc {
            // Step 0 covers every query (its own keys).
            None => (part_out, part.lse),
            Some((o, l)) => {
                let (o_rows, l_rows) = (rows(&o, 2, &p.queries)?, rows(&l, 2, &p.queries)?);
                let (co, cl) = combine((&o_rows, &l_rows), (&part_out, &part.lse))?;
                (
                    update_rows(&o, 2, &p.queries, |_| Ok(co))?,
                    update_rows(&l, 2, &p.queries, |_| Ok(cl))?,
                )
            }
        });
    }
    let (out, lse) = acc.expect("a group has at least one rank");
    Ok(AttentionOutput {
        out: out.to_dtype(q.dtype())?.contiguous()?,
        lse: lse.contiguous()?,
    })
}

/// The backward ring: `(dq, dk, dv)` in the operands' dtype.
fn backward(
    ring: &Ring,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    fwd: &AttentionOutput,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let len = q.dims()[2];
    let compute: DType = fwd.lse.dtype();
    let dout = dout.contiguous()?;
    let mut kv = stack_kv(k, v)?;
    let mut dq = Tensor::zeros(q.shape(), compute, q.device())?;
    // The partial gradients of the keys and values this rank holds, stacked like `kv`.
    let mut dkv = Tensor::zeros(kv.shape(), compute, q.device())?;
    for s in 0..ring.size() {
        if s > 0 {
            // One message in compute precision (the keys and values convert back exactly).
            let both = ring.hop(&Tensor::cat(&[&kv.to_dtype(compute)?, &dkv], 0)?, || {
                format!("hop {s}/{} backward", ring.size() - 1)
            })?;
            kv = both.narrow(0, 0, 2)?.to_dtype(q.dtype())?.contiguous()?;
            dkv = both.narrow(0, 2, 2)?.contiguous()?;
        }
        let src = ring.source(s);
        let p = pair(ring.rank(), src, len, ring.causal);
        let (kb, vb) = (unstack(&kv, 0)?, unstack(&kv, 1)?);
        let sub = AttentionOutput {
            out: rows(&fwd.out, 2, &p.queries)?,
            lse: rows(&fwd.lse, 2, &p.queries)?,
        };
        let g = Tensor::attention_backward(
            &rows(q, 2, &p.queries)?,
            &rows(&kb, 2, &p.keys)?,
            &rows(&vb, 2, &p.keys)?,
            &sub,
            &rows(&dout, 2, &p.queries)?,
            &ring.mask(src, &p)?,
            ring.scale,
            false,
        )?;
        dq = update_rows(&dq, 2, &p.queries, |d| d.add(&g.dq.to_dtype(compute)?))?;
        let part = stack_kv(&g.dk, &g.dv)?.to_dtype(compute)?;
        dkv = update_rows(&dkv, 3, &p.keys, |d| d.add(&part))?;
    }
    // One more hop brings each block's summed gradient home.
    let dkv = ring
        .hop(&dkv, || "hop home backward (dk, dv)".to_string())?
        .to_dtype(q.dtype())?;
    Ok((
        dq.to_dtype(q.dtype())?,
        unstack(&dkv, 0)?,
        unstack(&dkv, 1)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_pairs_follow_the_chunk_order() {
        // Rank 1 of 3 holds chunks 1 and 4 (local length 4: two chunks of 2).
        let p = pair(1, 1, 4, true);
        assert_eq!((p.queries, p.keys, p.causal), (0..4, 0..4, true));
        // Rank 0's chunks 0 and 5: chunk 0 precedes both of rank 1's, chunk 5 follows both.
        let p = pair(1, 0, 4, true);
        assert_eq!((p.queries, p.keys, p.causal), (0..4, 0..2, false));
        // Rank 2's chunks 2 and 3: after chunk 1, before chunk 4.
        let p = pair(1, 2, 4, true);
        assert_eq!((p.queries, p.keys, p.causal), (2..4, 0..4, false));
        let p = pair(1, 2, 4, false);
        assert_eq!((p.queries, p.keys, p.causal), (0..4, 0..4, false));
    }
}
