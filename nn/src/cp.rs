//! Context parallelism: the group of ranks that split every sequence, as the layers see it.
//!
//! A model built through a [`ParamBuilder`](crate::ParamBuilder) that carries a
//! [`ContextParallel`] ([`ParamBuilder::context_parallel`](crate::ParamBuilder::context_parallel))
//! takes this rank's part of each sequence: chunks `i` and `2C - 1 - i` of `2C`
//! ([`ChunkOrder`]), side by side. Its attention layers run ring attention over the group
//! ([`meshgrad_autograd::distributed::ring_attention()`]; or, with [`CpMode::AllGather`],
//! [`meshgrad_autograd::distributed::allgather_attention()`]) and its position encodings (GPT's
//! learned table, Llama's rotary embedding) read the global positions of the local tokens
//! ([`ContextParallel::positions`]). Everything else in a transformer is per token. On a group of
//! one rank the model is the plain model.
//!
//! In reference mode with the folded position order ([`ContextParallel::folded`], also on one
//! device, as a group of one rank) attention is
//! [`folded_attention()`](meshgrad_autograd::distributed::folded_attention()) instead, and the
//! layers run per position leaf ([`meshgrad_autograd::distributed::folded`]).

use std::sync::Arc;

use meshgrad_autograd::distributed::{
    allgather_attention, folded_attention, ring_attention, ChunkOrder, Collectives, CpMode,
    FoldedPositions, RingAttention,
};
use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

/// This rank's context-parallel group (mesh dimension `cp`).
#[derive(Clone)]
pub struct ContextParallel {
    /// The ranks that split each sequence, in ring order.
    pub group: Arc<dyn Collectives>,
    /// Reference mode's folded position order over the group, if set ([`Self::folded`]).
    folded: Option<FoldedPositions>,
    /// Ring or all-gather attention ([`Self::with_mode`]).
    mode: CpMode,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ContextParallel(rank {} of {})",
            self.group.rank(),
            self.group.describe()
        )
    }
}

impl ContextParallel {
    /// Context parallelism over `group`.
    pub fn new(group: Arc<dyn Collectives>) -> Self {
        ContextParallel {
            group,
            folded: None,
            mode: CpMode::Ring,
        }
    }

    /// The attention the group runs: the ring (the default) or an all-gather of the keys and
    /// values ([`allgather_attention()`]). Reference mode's folded order runs
    /// [`folded_attention()`] whatever the mode.
    pub fn with_mode(mut self, mode: CpMode) -> Self {
        self.mode = mode;
        self
    }

    /// The attention the group runs outside the folded order.
    pub fn mode(&self) -> CpMode {
        self.mode
    }

    /// Reference mode's folded position order of `leaves` position leaves over the group (see
    /// [`meshgrad_autograd::distributed::folded`]), or a one-line error unless `leaves` is a
    /// power of two the group size divides.
    pub fn with_folded(mut self, leaves: usize) -> Result<Self> {
        self.folded = Some(FoldedPositions::new(leaves, self.group.clone())?);
        Ok(self)
    }

    /// The folded position order, in reference mode with `train.reference_positions=folded`.
    pub fn folded(&self) -> Option<&FoldedPositions> {
        self.folded.as_ref()
    }

    /// Whether attention and positions differ from the plain model's: more than one rank, or
    /// the folded order (also on one rank).
    pub fn is_active(&self) -> bool {
        self.degree() > 1 || self.folded.is_some()
    }

    /// Number of ranks (`C`).
    pub fn degree(&self) -> usize {
        self.group.size()
    }

    /// Which chunks of a sequence this rank holds.
    pub fn order(&self) -> ChunkOrder {
        ChunkOrder::new(self.group.rank(), self.group.size())
    }

    /// The global positions (`i64 [local]`) of this rank's `local` positions: the whole sequence
    /// is `local x degree` long.
    pub fn positions(&self, local: usize, device: Device) -> Result<Tensor> {
        if self.degree() == 1 {
            return Tensor::arange(0, local as i64, DType::I64, device);
        }
        self.order().positions(local * self.degree(), device)
    }

    /// This rank's rows of `full` along dimension `dim` (a per-position table of the whole
    /// sequence, `local x degree` long): its two chunks side by side.
    pub fn local_rows(&self, full: &Tensor, dim: usize) -> Result<Tensor> {
        if self.degree() == 1 {
            return Ok(full.clone());
        }
        self.order().local_of(full, dim)
    }

    /// Causal self-attention of this rank's `q`, `k`, `v` (`[B, H, 2L, D]`) over the whole
    /// sequence: ring (or all-gather) attention over the group.
    pub fn causal_attention(&self, q: &Var, k: &Var, v: &Var, scale: f64) -> Result<Var> {
        self.attention(q, k, v, None, true, scale)
    }

    /// Self-attention of this rank's `q`, `k`, `v` (`[B, H, 2L, D]`) over the whole sequence,
    /// causal or not, with this rank's key padding `[B, 2L]` (integer, nonzero = attend) if any:
    /// ring attention over the group, or all-gather attention ([`Self::with_mode`]; in the
    /// folded order, [`folded_attention()`]).
    pub fn attention(
        &self,
        q: &Var,
        k: &Var,
        v: &Var,
        key_padding: Option<&Tensor>,
        causal: bool,
        scale: f64,
    ) -> Result<Var> {
        let args = RingAttention {
            q,
            k,
            v,
            key_padding,
            causal,
            scale,
            group: &self.group,
        };
        match (&self.folded, self.mode) {
            (Some(positions), _) => folded_attention(args, positions.leaves()),
            (None, CpMode::Ring) => ring_attention(args),
            (None, CpMode::AllGather) => allgather_attention(args),
        }
    }
}
