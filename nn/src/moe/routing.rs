//! [`Routing`]: which experts each token goes to, and the permutation that groups the token
//! copies by expert (plain numbers: nothing here is differentiated).

use meshgrad_tensor::Result;

/// What [`Routing::new`] routes: router probabilities `[rows * tokens, n_experts]` (row-major,
/// the tokens of a sequence consecutive), `top_k` experts per token, and an optional capacity
/// factor.
#[derive(Clone, Copy, Debug)]
pub struct RoutingArgs<'a> {
    /// Router probabilities, token-major.
    pub probs: &'a [f64],
    /// Sequences (rows) in the batch.
    pub rows: usize,
    /// Tokens per sequence.
    pub tokens: usize,
    /// Experts.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// `Some(cf)`: an expert takes at most `ceil(cf * T * top_k / n_experts)` copies of each
    /// sequence of `T` tokens (`tokens`, or [`SequenceSplit::sequence`]); `None`: dropless.
    pub capacity_factor: Option<f64>,
    /// Under context parallelism, where the rows' tokens lie in their sequences (for the
    /// capacity's token order); `None`: each row is a whole sequence.
    pub split: Option<SequenceSplit<'a>>,
}

/// A context-parallel rank's part of each sequence, for the capacity: the local tokens of a row
/// are `segments` equal runs, each contiguous in the sequence, and copies are kept in the
/// sequence's token order as one device keeps them.
#[derive(Clone, Copy, Debug)]
pub struct SequenceSplit<'a> {
    /// Tokens of a whole sequence (the capacity's `T`).
    pub sequence: usize,
    /// Runs of contiguous positions per row.
    pub segments: usize,
    /// `[rows, segments, n_experts]`: the copies of each row routed to each expert (kept or
    /// not) at the sequence's positions before each run, on this rank or another
    /// ([`run_counts`] of every rank).
    pub routed_before: &'a [usize],
}

/// A batch's routing. Token copy ("slot") `s = token * top_k + j` is token `token`'s `j`-th
/// choice (choices by decreasing probability, ties to the lower expert index).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub top_k: usize,
    /// The expert of every slot, `[tokens * top_k]`.
    pub choices: Vec<u32>,
    /// The kept slots' tokens, grouped by expert (expert 0's first), in token order within an
    /// expert: the permutation's gather indices.
    pub permuted_tokens: Vec<u32>,
    /// Kept slots per expert (the lengths of the groups of `permuted_tokens`).
    pub expert_sizes: Vec<usize>,
    /// For every slot, its position in the permuted order, or `permuted_tokens.len()` (a zero
    /// row) when it was dropped.
    pub slot_position: Vec<u32>,
    /// Slots routed to each expert, kept or dropped.
    pub routed: Vec<usize>,
    /// Slots routed to each expert per row, `[rows * n_experts]`.
    pub row_routed: Vec<usize>,
    /// Slots dropped for capacity.
    pub dropped: usize,
}

impl Routing {
    /// Routes `a` (see [`RoutingArgs`]). Errors: `top_k` of 0 or above `n_experts`, sizes that
    /// do not match, a capacity factor that is not finite and positive.
    pub fn new(a: RoutingArgs<'_>) -> Result<Routing> {
        let (n, k) = (a.n_experts, a.top_k);
        check_top_k(k, n)?;
        let n_tok = a.rows * a.tokens;
        if a.probs.len() != n_tok * n {
            meshgrad_tensor::bail!(
                "moe routing: {} probabilities for {} rows x {} tokens x {n} experts",
                a.probs.len(),
                a.rows,
                a.tokens
            );
        }
        let cap = capacity(&a)?;
        let segments = a.split.map_or(1, |s| s.segments);
        if let Some(s) = a.split {
            if s.segments == 0
                || !a.tokens.is_multiple_of(s.segments)
                || s.routed_before.len() != a.rows * s.segments * n
            {
                meshgrad_tensor::bail!(
                    "moe routing: {} tokens per row do not split into {} runs with {} earlier \
                     counts for {} rows x {n} experts",
                    a.tokens,
                    s.segments,
                    s.routed_before.len(),
                    a.rows
                );
            }
        }
        let run = a.tokens.max(1) / segments;
        let choices = choose(a.probs, n, k);
        let mut routed = vec![0; n];
        let mut row_routed = vec![0; a.rows * n];
        for (s, &e) in choices.iter().enumerate() {
            routed[e as usize] += 1;
            row_routed[(s / k / a.tokens.max(1)) * n + e as usize] += 1;
        }
        let mut permuted_tokens = Vec::new();
        let mut expert_sizes = vec![0; n];
        let mut slot_position = vec![u32::MAX; n_tok * k];
        let mut dropped = 0;
        for (e, size) in expert_sizes.iter_mut().enumerate() {
            // Copies kept so far per row and run: before a run, every copy routed earlier was
            // kept up to the capacity.
            let mut kept: Vec<usize> = match a.split {
                Some(s) => (0..a.rows * segments)
                    .map(|rs| s.routed_before[rs * n + e].min(cap))
                    .collect(),
                None => vec![0; a.rows],
            };
            for (s, &c) in choices.iter().enumerate() {
                if c as usize != e {
                    continue;
                }
                let token = s / k;
                let at = token / run.max(1);
                if kept[at] >= cap {
                    dropped += 1;
                    continue;
                }
                kept[at] += 1;
                slot_position[s] = permuted_tokens.len() as u32;
                permuted_tokens.push(token as u32);
                *size += 1;
            }
        }
        let zero_row = permuted_tokens.len() as u32;
        for p in slot_position.iter_mut().filter(|p| **p == u32::MAX) {
            *p = zero_row;
        }
        Ok(Routing {
            top_k: k,
            choices,
            permuted_tokens,
            expert_sizes,
            slot_position,
            routed,
            row_routed,
            dropped,
        })
    }
}

/// Each token's `k` experts by decreasing probability (ties to the lower expert index), from
/// probabilities `[tokens, n]`.
fn choose(probs: &[f64], n: usize, k: usize) -> Vec<u32> {
    let mut choices = Vec::with_capacity(probs.len() / n.max(1) * k);
    let mut order: Vec<usize> = (0..n).collect();
    for p in probs.chunks_exact(n) {
        order.sort_by(|&x, &y| p[y].total_cmp(&p[x]).then(x.cmp(&y)));
        choices.extend(order[..k].iter().map(|&e| e as u32));
    }
    choices
}

/// The copies an expert keeps per sequence (`usize::MAX`: dropless).
fn capacity(a: &RoutingArgs<'_>) -> Result<usize> {
    let tokens = a.split.map_or(a.tokens, |s| s.sequence);
    Ok(match a.capacity_factor {
        None => usize::MAX,
        Some(cf) if cf.is_finite() && cf > 0.0 => {
            (cf * (tokens * a.top_k) as f64 / a.n_experts as f64).ceil() as usize
        }
        Some(cf) => {
            meshgrad_tensor::bail!(
                "moe routing: the capacity factor must be finite and > 0, got {cf}"
            )
        }
    })
}

/// Token copies routed to each expert per row and run of `segments` equal contiguous runs of
/// each row's tokens (`[rows, segments, n_experts]`, before any capacity): what the other
/// context-parallel ranks need to keep copies in the sequence's order ([`SequenceSplit`]).
pub fn run_counts(a: &RoutingArgs<'_>, segments: usize) -> Result<Vec<usize>> {
    let (n, k) = (a.n_experts, a.top_k);
    check_top_k(k, n)?;
    if segments == 0 || !a.tokens.is_multiple_of(segments) || a.probs.len() != a.rows * a.tokens * n
    {
        meshgrad_tensor::bail!(
            "moe routing: {} probabilities for {} rows x {} tokens (in {segments} runs) x {n} \
             experts",
            a.probs.len(),
            a.rows,
            a.tokens
        );
    }
    let run = a.tokens / segments;
    let mut counts = vec![0; a.rows * segments * n];
    for (s, &e) in choose(a.probs, n, k).iter().enumerate() {
        counts[(s / k / run) * n + e as usize] += 1;
    }
    Ok(counts)
}

/// The one-line refusal of `top_k` experts per token among `n_experts`: 0, or more than there
/// are.
pub(crate) fn check_top_k(top_k: usize, n_experts: usize) -> Result<()> {
    if n_experts == 0 {
        meshgrad_tensor::bail!("moe: n_experts must be at least 1, got 0");
    }
    if top_k == 0 || top_k > n_experts {
        meshgrad_tensor::bail!(
            "moe: experts_per_token = {top_k} must be in 1..={n_experts} (n_experts = {n_experts})"
        );
    }
    Ok(())
}
