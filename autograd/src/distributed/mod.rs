//! What autograd needs to know about ranks: a narrow view of a process group ([`Collectives`]),
//! how a parameter is placed across one ([`Placement`]), and communication as differentiable
//! functions, each with its forward and backward side by side (the conjugate pairs of tensor
//! and sequence parallelism):
//!
//! | function                     | forward                       | backward                     |
//! |------------------------------|-------------------------------|------------------------------|
//! | [`all_reduce_backward`]      | identity                      | sum over the group           |
//! | [`all_reduce_forward`]       | sum over the group            | identity                     |
//! | [`all_gather_dim`]           | concatenate the ranks' chunks | this rank's chunk of the sum |
//! | [`reduce_scatter_dim`]       | this rank's chunk of the sum  | concatenate the chunks       |
//! | [`split_dim`]                | this rank's chunk             | concatenate the chunks       |
//! | [`ring_attention()`]         | attention over the sequence split across the group (keys and values pass around the ring) | the same ring backwards (dk, dv return to their owner) |
//! | [`allgather_attention()`]    | attention over the split sequence after an all-gather of the keys and values (`--cp-mode allgather`) | through the all-gather's reduce-scatter |
//! | [`folded_attention()`]       | reference mode's attention over the split sequence: fine chunk pairs in one order after an all-gather | each pair's shares added in one order; keys' over the position leaves' tree and the group |
//! | [`all_to_all_rows`]          | rows sent to the ranks by split sizes | the reverse all-to-all of the gradients |
//!
//! On a group of one rank every function returns its input unchanged (no copy, no node), so a
//! model written for tensor parallelism runs at degree 1 exactly as the plain model.
//!
//! The crate `meshgrad_parallel` implements [`Collectives`] for every `Communicator`; tests can
//! implement it for anything that reduces tensors.

use std::ops::Range;
use std::sync::Arc;

use meshgrad_tensor::exact_sum::ExactSum;
use meshgrad_tensor::{Result, Tensor};

use crate::Var;

pub mod allgather_attention;
pub mod chunk_order;
pub mod folded;
pub mod folded_attention;
pub mod ring_attention;

pub use allgather_attention::{allgather_attention, CpMode};
pub use chunk_order::ChunkOrder;
pub use folded::FoldedPositions;
pub use folded_attention::folded_attention;
pub use ring_attention::{ring_attention, RingAttention};

/// The collectives tensor and sequence parallelism need, on one group of ranks. Every member
/// calls the same collectives in the same order (the usual matching rule); results are fresh
/// tensors.
pub trait Collectives: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The elementwise sum of every rank's `t`, on every rank.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// The elementwise maximum of every rank's `t`, on every rank.
    fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's `t` (all of one shape) concatenated along dimension 0 in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    /// The sum of every rank's `t`, split along dimension 0 into `size()` equal blocks: this
    /// rank's block.
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// A ring shift: sends `t` to the next rank (`rank + 1`, wrapping) and returns what the
    /// previous rank (`rank - 1`, wrapping) sent. Every member calls it, with tensors of one shape
    /// and dtype. The default gathers every rank's `t` and keeps the previous rank's (correct on
    /// any group, but it moves `size()` tensors); communicators override it with one send and one
    /// receive.
    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        let w = self.size();
        if w == 1 {
            return Ok(t.clone());
        }
        let prev = (self.rank() + w - 1) % w;
        let all = self.all_gather(&t.contiguous()?)?;
        let n = t.dims().first().copied().unwrap_or(1);
        if t.rank() == 0 {
            return all.narrow(0, prev, 1)?.reshape(t.shape().clone());
        }
        all.narrow(0, prev * n, n)?.contiguous()
    }
    /// Exchanges rows of dimension 0: `t`'s rows, cut in rank order into blocks of
    /// `send_splits[j]` rows, go to rank `j`; the result concatenates the blocks received from
    /// every rank in rank order, `recv_splits[i]` rows from rank `i` (uneven splits allowed; rank
    /// `i`'s `send_splits[j]` must equal rank `j`'s `recv_splits[i]`). The default serves a group
    /// of one rank only (it returns `t`); communicators override it with their all-to-all.
    fn all_to_all(
        &self,
        t: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Tensor> {
        if self.size() == 1 && send_splits == recv_splits {
            return Ok(t.clone());
        }
        meshgrad_tensor::bail!(
            "all_to_all on {}: this group has no all-to-all (send splits {send_splits:?}, \
             receive splits {recv_splits:?})",
            self.describe()
        )
    }
    /// The group's members for messages, e.g. `tp[0,1]`.
    fn describe(&self) -> String;
    /// Runs `f`, one transfer over this group (a ring hop, an all-to-all), as a span labelled
    /// `label()` when the group records a timeline (`meshgrad train --trace`); the default just
    /// runs it. Callers name what the transfer is for, the group when it happens.
    fn traced(
        &self,
        label: &dyn Fn() -> String,
        f: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        let _ = label;
        f()
    }
}

impl std::fmt::Debug for dyn Collectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} of {}", self.rank(), self.describe())
    }
}

/// How a parameter (or any tensor) is split across a group: along dimension `dim`, which is seen
/// as `chunks` equal blocks, each cut into `group.size()` equal parts; rank `r` holds part `r` of
/// every block, side by side. `chunks` is 1 for a plain split; a fused q/k/v projection uses 3,
/// so each rank holds its heads of q, of k and of v. A tensor without a placement is replicated
/// (the same on every rank).
#[derive(Clone)]
pub struct Placement {
    /// The split dimension.
    pub dim: usize,
    /// Equal blocks along `dim`, each split across the group.
    pub chunks: usize,
    /// The mesh dimension the group runs along (`"tp"`), for messages and checkpoints.
    pub mesh_dim: String,
    /// The ranks sharing the tensor.
    pub group: Arc<dyn Collectives>,
}

impl std::fmt::Debug for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Shard(dim {}, {} chunk(s), {} of {} over {})",
            self.dim,
            self.chunks,
            self.group.rank(),
            self.group.size(),
            self.mesh_dim
        )
    }
}

impl Placement {
    /// A split of `dim` into `chunks` blocks across `group` along mesh dimension `mesh_dim`.
    pub fn shard(dim: usize, chunks: usize, mesh_dim: &str, group: Arc<dyn Collectives>) -> Self {
        Placement {
            dim,
            chunks: chunks.max(1),
            mesh_dim: mesh_dim.to_string(),
            group,
        }
    }

    /// Number of parts (the group size).
    pub fn degree(&self) -> usize {
        self.group.size()
    }

    /// This rank's part.
    pub fn index(&self) -> usize {
        self.group.rank()
    }

    /// The local shape of a tensor whose full shape is `global`, or an error naming the sizes
    /// when `global[dim]` does not split evenly.
    pub fn local_dims(&self, global: &[usize]) -> Result<Vec<usize>> {
        let parts = self.chunks * self.degree();
        match global.get(self.dim) {
            Some(&n) if n % parts == 0 => {
                let mut d = global.to_vec();
                d[self.dim] = n / self.degree();
                Ok(d)
            }
            Some(&n) => meshgrad_tensor::bail!(
                "placement: dimension {} of size {n} (shape {global:?}) does not split into {} \
                 block(s) x {} parts over {}",
                self.dim,
                self.chunks,
                self.degree(),
                self.mesh_dim
            ),
            None => meshgrad_tensor::bail!(
                "placement: shape {global:?} has no dimension {} to split over {}",
                self.dim,
                self.mesh_dim
            ),
        }
    }

    /// The full shape of a tensor whose local shape is `local`.
    pub fn global_dims(&self, local: &[usize]) -> Vec<usize> {
        let mut d = local.to_vec();
        if let Some(n) = d.get_mut(self.dim) {
            *n *= self.degree();
        }
        d
    }

    /// The ranges of the full dimension (of length `global_len`) that rank `index` holds, one per
    /// chunk, in order.
    pub fn ranges(&self, global_len: usize, index: usize) -> Vec<Range<usize>> {
        let block = global_len / self.chunks;
        let part = block / self.degree();
        (0..self.chunks)
            .map(|c| c * block + index * part..c * block + (index + 1) * part)
            .collect()
    }

    /// This rank's part of a full tensor (a contiguous copy).
    pub fn shard_of(&self, full: &Tensor) -> Result<Tensor> {
        self.local_dims(full.dims())?;
        let ranges = self.ranges(full.dims()[self.dim], self.index());
        let parts: Vec<Tensor> = ranges
            .iter()
            .map(|r| full.narrow(self.dim as isize, r.start, r.len()))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::cat(&refs, self.dim as isize)?.contiguous()
    }

    /// The full tensor from every rank's part (a collective: every member calls it).
    pub fn gather(&self, local: &Tensor) -> Result<Tensor> {
        let w = self.degree();
        if w == 1 {
            return local.contiguous();
        }
        let per_rank = gather_chunks(local, w, &*self.group)?;
        // Rank r's part holds its slice of every chunk: interleave them chunk by chunk.
        let c = self.chunks;
        let mut ordered = Vec::with_capacity(c * w);
        let local_len = local.dims()[self.dim];
        for ci in 0..c {
            for part in &per_rank {
                ordered.push(part.narrow(self.dim as isize, ci * local_len / c, local_len / c)?);
            }
        }
        let refs: Vec<&Tensor> = ordered.iter().collect();
        Tensor::cat(&refs, self.dim as isize)
    }
}

/// Every rank's `local` (one shape on all), gathered as a list in rank order.
fn gather_chunks(local: &Tensor, w: usize, group: &dyn Collectives) -> Result<Vec<Tensor>> {
    let flat = local.contiguous()?.reshape(local.elem_count())?;
    let all = group.all_gather(&flat)?;
    let n = local.elem_count();
    (0..w)
        .map(|r| all.narrow(0, r * n, n)?.reshape(local.shape().clone()))
        .collect()
}

/// Concatenates every rank's `local` along `dim`.
fn gather_along(local: &Tensor, dim: usize, group: &dyn Collectives) -> Result<Tensor> {
    let parts = gather_chunks(local, group.size(), group)?;
    let refs: Vec<&Tensor> = parts.iter().collect();
    Tensor::cat(&refs, dim as isize)
}

/// The sum over the group of `full`, split along `dim`: this rank's chunk.
fn reduce_scatter_along(full: &Tensor, dim: usize, group: &dyn Collectives) -> Result<Tensor> {
    let w = group.size();
    let n = full.dims()[dim] / w;
    let chunks: Vec<Tensor> = (0..w)
        .map(|r| {
            let c = full.narrow(dim as isize, r * n, n)?.contiguous()?;
            c.reshape(c.elem_count())
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = chunks.iter().collect();
    let mine = group.reduce_scatter_sum(&Tensor::cat(&refs, 0)?)?;
    let mut dims = full.dims().to_vec();
    dims[dim] = n;
    mine.reshape(dims)
}

fn check_dim(what: &str, x: &Var, dim: usize, group: &dyn Collectives, split: bool) -> Result<()> {
    let dims = x.tensor().dims();
    match dims.get(dim) {
        None => meshgrad_tensor::bail!(
            "{what}: shape {} has no dimension {dim} (group {})",
            x.tensor().shape(),
            group.describe()
        ),
        Some(&n) if split && n % group.size() != 0 => meshgrad_tensor::bail!(
            "{what}: dimension {dim} of size {n} (shape {}) does not split over the {} ranks of {}",
            x.tensor().shape(),
            group.size(),
            group.describe()
        ),
        _ => Ok(()),
    }
}

type Group = Arc<dyn Collectives>;

/// Identity forward; in backward the gradient becomes the sum of every rank's gradient. Put it
/// where a replicated tensor enters computations that differ per rank (the input of a
/// column-parallel linear; a replicated weight used on each rank's own tokens).
pub fn all_reduce_backward(x: &Var, group: &Group) -> Result<Var> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let g = group.clone();
    Ok(Var::from_op(
        "all_reduce_backward",
        x.tensor().clone(),
        &[x],
        Box::new(move |grad, _| Ok(vec![Some(g.all_reduce_sum(grad)?)])),
    ))
}

/// The sum of every rank's `x` forward; identity backward (the output of a row-parallel
/// linear, a vocabulary-parallel embedding).
pub fn all_reduce_forward(x: &Var, group: &Group) -> Result<Var> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let sum = group.all_reduce_sum(x.tensor())?;
    Ok(Var::from_op(
        "all_reduce_forward",
        sum,
        &[x],
        Box::new(move |grad, _| Ok(vec![Some(grad.clone())])),
    ))
}

/// Every rank's `x` concatenated along `dim` forward; backward, the sum of the gradients cut
/// back to this rank's chunk (leaving a sequence-parallel region).
pub fn all_gather_dim(x: &Var, dim: usize, group: &Group) -> Result<Var> {
    check_dim("all_gather_dim", x, dim, &**group, false)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let full = gather_along(x.tensor(), dim, &**group)?;
    let g = group.clone();
    Ok(Var::from_op(
        "all_gather_dim",
        full,
        &[x],
        Box::new(move |grad, _| Ok(vec![Some(reduce_scatter_along(grad, dim, &*g)?)])),
    ))
}

/// Every rank's `x` concatenated along `dim` forward; backward, this rank's chunk of the
/// gradient, which every rank holds whole (entering a replicated region from a
/// sequence-parallel one: the region computes the same on every rank, and leaves it through
/// [`split_dim`], whose backward gathers the gradient).
pub fn all_gather_replicated(x: &Var, dim: usize, group: &Group) -> Result<Var> {
    check_dim("all_gather_replicated", x, dim, &**group, false)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let full = gather_along(x.tensor(), dim, &**group)?;
    let (rank, size) = (group.rank(), group.size());
    Ok(Var::from_op(
        "all_gather_replicated",
        full,
        &[x],
        Box::new(move |grad, _| {
            let n = grad.dims()[dim] / size;
            Ok(vec![Some(
                grad.narrow(dim as isize, rank * n, n)?.contiguous()?,
            )])
        }),
    ))
}

/// The sum over the ranks of `x`, cut along `dim` to this rank's chunk, forward; backward, the
/// chunks' gradients concatenated (entering a sequence-parallel region from partial sums).
pub fn reduce_scatter_dim(x: &Var, dim: usize, group: &Group) -> Result<Var> {
    check_dim("reduce_scatter_dim", x, dim, &**group, true)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let mine = reduce_scatter_along(x.tensor(), dim, &**group)?;
    let g = group.clone();
    Ok(Var::from_op(
        "reduce_scatter_dim",
        mine,
        &[x],
        Box::new(move |grad, _| Ok(vec![Some(gather_along(grad, dim, &*g)?)])),
    ))
}

/// This rank's chunk of a replicated `x` along `dim` forward; backward, the chunks' gradients
/// concatenated (entering a sequence-parallel region from replicated values).
pub fn split_dim(x: &Var, dim: usize, group: &Group) -> Result<Var> {
    check_dim("split_dim", x, dim, &**group, true)?;
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let n = x.tensor().dims()[dim] / group.size();
    let mine = x
        .tensor()
        .narrow(dim as isize, group.rank() * n, n)?
        .contiguous()?;
    let g = group.clone();
    Ok(Var::from_op(
        "split_dim",
        mine,
        &[x],
        Box::new(move |grad, _| Ok(vec![Some(gather_along(grad, dim, &*g)?)])),
    ))
}

/// The rows of `x` (dimension 0) exchanged over `group` ([`Collectives::all_to_all`]): block
/// `j` of `send_splits[j]` rows goes to rank `j`, and the result holds the blocks received from
/// every rank in rank order (`recv_splits[i]` rows from rank `i`). Backward: the reverse
/// all-to-all of the gradient (the splits swapped), so each row's gradient returns to the rank
/// it came from. A collective in both directions: every member calls it, and every member's
/// backward reaches it. On a group of one rank it returns `x`.
pub fn all_to_all_rows(
    x: &Var,
    send_splits: &[usize],
    recv_splits: &[usize],
    group: &Group,
) -> Result<Var> {
    let rows = x.tensor().dims().first().copied();
    let sent: usize = send_splits.iter().sum();
    if rows != Some(sent) || send_splits.len() != group.size() || recv_splits.len() != group.size()
    {
        meshgrad_tensor::bail!(
            "all_to_all_rows: shape {} with send splits {send_splits:?} and receive splits \
             {recv_splits:?} over the {} ranks of {}",
            x.tensor().shape(),
            group.size(),
            group.describe()
        );
    }
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let xt = x.tensor().contiguous()?;
    let out = group.traced(
        &|| format!("{} all_to_all forward ({sent} rows out)", group.describe()),
        &mut || group.all_to_all(&xt, send_splits, recv_splits),
    )?;
    let (g, send, recv) = (group.clone(), send_splits.to_vec(), recv_splits.to_vec());
    Ok(Var::from_op(
        "all_to_all_rows",
        out,
        &[x],
        Box::new(move |grad, _| {
            let grad = grad.contiguous()?;
            let back: usize = recv.iter().sum();
            Ok(vec![Some(g.traced(
                &|| format!("{} all_to_all backward ({back} rows out)", g.describe()),
                &mut || g.all_to_all(&grad, &recv, &send),
            )?)])
        }),
    ))
}

/// The total of per-tensor values (sums of squares, element counts) in which every element of a
/// split tensor counts once: values of tensors with a [`Placement`] over more than one rank are
/// summed over their group (one all-reduce per group, in order of first appearance: a collective
/// that every member calls with the same groups), the others (replicated) are added as they are.
pub fn sum_over_placements(
    items: impl IntoIterator<Item = (Option<Placement>, f64)>,
) -> Result<f64> {
    let mut total = 0.0;
    let mut split: Vec<(Group, f64)> = Vec::new();
    for (placement, v) in items {
        match placement {
            Some(p) if p.degree() > 1 => {
                match split.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &p.group)) {
                    Some((_, acc)) => *acc += v,
                    None => split.push((p.group.clone(), v)),
                }
            }
            _ => total += v,
        }
    }
    for (group, local) in split {
        let t = Tensor::from_vec(vec![local], 1, meshgrad_tensor::Device::Cpu)?;
        total += group.all_reduce_sum(&t)?.to_vec::<f64>()?[0];
    }
    Ok(total)
}

/// The squares of every gradient element of `params` as an order-free [`ExactSum`]: each
/// parameter's squares, combined by [`exact_sum_over_placements`] (split parameters over their
/// group, each element once; replicated ones as they are). Parameters without a gradient add
/// nothing. A collective over each tensor-parallel group among the parameters' placements.
pub fn exact_grad_squares<'a>(params: impl IntoIterator<Item = &'a Var>) -> Result<ExactSum> {
    let mut items = Vec::new();
    for p in params {
        if let Some(g) = p.grad() {
            let mut s = ExactSum::new();
            s.add_squares(&g)?;
            items.push((p.placement(), s));
        }
    }
    exact_sum_over_placements(items)
}

/// [`sum_over_placements`] for order-free exact sums ([`ExactSum`]): the sums of tensors with a
/// [`Placement`] over more than one rank are merged per group and their words all-reduced over
/// it (integers, so exact in any order), the others (replicated) are merged as they are. The
/// result is the same bits however the tensors are split. A collective over each group, in order
/// of first appearance.
pub fn exact_sum_over_placements(
    items: impl IntoIterator<Item = (Option<Placement>, ExactSum)>,
) -> Result<ExactSum> {
    let mut total = ExactSum::new();
    let mut split: Vec<(Group, ExactSum)> = Vec::new();
    for (placement, v) in items {
        match placement {
            Some(p) if p.degree() > 1 => {
                match split.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &p.group)) {
                    Some((_, acc)) => acc.merge(&v),
                    None => split.push((p.group.clone(), v)),
                }
            }
            _ => total.merge(&v),
        }
    }
    for (group, local) in split {
        let words = local.to_words();
        let n = words.len();
        let t = Tensor::from_vec(words, n, meshgrad_tensor::Device::Cpu)?;
        let summed = group.all_reduce_sum(&t)?.to_vec::<f64>()?;
        total.merge(&ExactSum::from_words(&summed)?);
    }
    Ok(total)
}
