//! Mixture of experts: Mixtral's sparse feed-forward ([`SparseMoe`], Hugging Face
//! `MixtralSparseMoeBlock`), its routing ([`Routing`]) and the per-step expert load a trainer
//! reports ([`collect_expert_load`]).
//!
//! # The layer
//! A router (a bias-free linear `gate`, `[n_experts, n_embd]`) scores each token; the scores'
//! softmax over the experts (in f32, or f64 for an f64 model) picks each token's `top_k`
//! experts, whose probabilities are renormalised to sum to one (as transformers'
//! `MixtralSparseMoeBlock` does). The token's output is the weighted sum of its experts'
//! outputs; each expert is a SwiGLU feed-forward `w2(silu(w1 x) * w3 x)`.
//!
//! The dispatch is written so that expert parallelism can place an all-to-all between its
//! steps: routing -> **permute** (the token copies gathered, grouped by expert: one
//! `index_select`) -> each expert on its contiguous slice -> **un-permute** (each token's `k`
//! outputs gathered back and added with their weights). Every step is a differentiable op; the
//! gradients scatter-add back in a fixed order.
//!
//! **Dropless by default.** With a capacity factor `cf`, an expert takes at most
//! `ceil(cf * T * k / N)` token copies of each sequence of `T` tokens (in token order; the rest
//! are dropped: that expert adds nothing to the token, the other choices keep their weights),
//! and the dropped copies are counted. The capacity is per sequence, not per batch, so a layout
//! that splits the batch by rows (data parallelism, microbatches) drops the same copies; under
//! context parallelism a rank keeps its chunks' copies after those its group routed at earlier
//! positions ([`SequenceSplit`], from every rank's [`run_counts`]), in the sequence's order.
//!
//! **Context parallelism** ([`crate::cp::ContextParallel`], from the builder): a rank routes its
//! chunks of each sequence; the load-balancing loss's routed counts are the whole sequences'
//! (all-reduced over the group, exact), each rank's loss is its tokens' part of it (the parts add
//! up to the sequence's loss), and its value is summed over the group for the metrics. In
//! reference mode's folded position order the layer runs once per position leaf
//! ([`meshgrad_autograd::distributed::FoldedPositions::leafwise`]), so its parameters'
//! gradients are the same tree over the leaves on one device and on every cp layout; with a
//! capacity factor each leaf's two fine chunks start from the copies the sequence routed at
//! its earlier fine chunks (counted first, over the group), so the kept copies are one
//! device's in token order.
//!
//! **Expert parallelism** ([`ExpertParallel`], built with
//! [`ParamBuilder::expert_parallel`](crate::ParamBuilder::expert_parallel)): a rank holds a block
//! of the experts ([`ExpertList`], named by global index); after the permutation the token copies
//! go to their experts' ranks with an all-to-all, each rank runs its experts on what it received
//! (grouped by expert, each expert's copies in source-rank order) and a second all-to-all brings
//! the outputs back before the un-permutation. Each expert's gradient then sums the
//! contributions of every rank of the group's tokens.
//!
//! # The load-balancing loss
//! For one sequence of `T` tokens and one layer, with `f_e` the number of the sequence's token
//! copies routed to expert `e` divided by `T` (the fraction of tokens that chose `e` among their
//! `k`; the `f_e` sum to `k`) and `P_e` the mean router probability of `e` over the tokens,
//! `aux = N * sum_e f_e * P_e` (`k` when the routing is uniform). This is transformers'
//! `load_balancing_loss_func` for one layer and one sequence. transformers averages over the
//! whole batch with every layer's tokens concatenated, which a layout that splits the batch or
//! the layers cannot compute locally; here the loss is this per-sequence value averaged over the
//! sequences of the batch and the layers, which every layout computes as one device does (data
//! parallelism and microbatches average whole sequences, pipeline stages add whole layers).
//!
//! The training objective is `cross_entropy + router_aux_loss_coef * aux`. The aux term reaches
//! the backward from the layer itself ([`meshgrad_autograd::Var::attach_aux_loss`] on its
//! output, weighted by `coef / n_layer` times the forward's loss scale,
//! [`meshgrad_autograd::loss_scale`]), so a layer on any pipeline stage adds its term with the
//! scale the executor gives the loss; the model's loss value stays the cross-entropy. The values
//! (for the metrics) are collected per step with [`collect_expert_load`].

pub mod ep;
mod layer;
mod load;
mod routing;

pub use ep::{expert_parameter_names, ExpertParallel};
pub use layer::{ExpertList, MoeExpert, MoeOutput, MoeSettings, SparseMoe};
pub use load::{collect_expert_load, ExpertLoad, LayerLoad};
pub use routing::{run_counts, Routing, RoutingArgs, SequenceSplit};
