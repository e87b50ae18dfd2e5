//! [`SparseMoe`]: Mixtral's sparse feed-forward (`block_sparse_moe`): the router, the experts
//! and the dispatch between them (see the [module docs](super)).

use meshgrad_autograd::distributed::{
    all_gather_replicated, all_to_all_rows, split_dim, ChunkOrder, Collectives, FoldedPositions,
};
use meshgrad_autograd::source_grads::set_aside;
use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Device, Result, Tensor};

use super::ep::ExpertParallel;
use super::load;
use super::routing::{check_top_k, run_counts, Routing, RoutingArgs, SequenceSplit};
use crate::cp::ContextParallel;
use crate::layers::Linear;
use crate::llama::block::proj;
use crate::module::{Child, Forward, ModuleField};
use crate::param_builder::ParamBuilder;
use crate::tp::TensorParallel;

/// A mixture of experts' settings (Hugging Face `MixtralConfig` keys in the comments).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeSettings {
    /// Experts per layer (`num_local_experts`).
    pub n_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// The load-balancing loss's coefficient in the training objective
    /// (`router_aux_loss_coef`; a training setting, not part of the model's shape).
    pub router_aux_loss_coef: f64,
    /// `Some(cf)`: each expert takes at most `ceil(cf * T * k / N)` token copies of a sequence
    /// of `T` tokens, the rest are dropped; `None` (the default, as Mixtral): dropless.
    #[serde(default)]
    pub capacity_factor: Option<f64>,
}

impl MoeSettings {
    /// Mixtral's routing: `n_experts` experts, `experts_per_token` per token, the coefficient
    /// 0.02 of Mixtral 8x7B's `config.json` (transformers' `MixtralConfig` defaults to 0.001),
    /// dropless.
    pub fn new(n_experts: usize, experts_per_token: usize) -> Self {
        MoeSettings {
            n_experts,
            experts_per_token,
            router_aux_loss_coef: 0.02,
            capacity_factor: None,
        }
    }

    /// One-line errors: no experts, `experts_per_token` 0 or above `n_experts`, a coefficient
    /// that is not finite and >= 0, a capacity factor that is not finite and > 0.
    pub fn validate(&self) -> Result<()> {
        check_top_k(self.experts_per_token, self.n_experts)?;
        let c = self.router_aux_loss_coef;
        if !(c.is_finite() && c >= 0.0) {
            meshgrad_tensor::bail!("moe: router_aux_loss_coef must be finite and >= 0, got {c}");
        }
        if let Some(cf) = self.capacity_factor {
            if !(cf.is_finite() && cf > 0.0) {
                meshgrad_tensor::bail!("moe: capacity_factor must be finite and > 0, got {cf}");
            }
        }
        Ok(())
    }
}

/// One expert: the SwiGLU feed-forward `w2(silu(w1 x) * w3 x)` (`experts.{e}`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct MoeExpert {
    /// Gate projection `[intermediate, n_embd]`.
    pub w1: Linear,
    /// Down projection `[n_embd, intermediate]`.
    pub w2: Linear,
    /// Up projection `[intermediate, n_embd]`.
    pub w3: Linear,
}

impl MoeExpert {
    /// An expert of width `n_embd` and hidden width `intermediate`.
    pub fn new(p: &ParamBuilder, n_embd: usize, intermediate: usize) -> Result<Self> {
        Ok(MoeExpert {
            w1: proj(p, n_embd, intermediate)?,
            w2: proj(p, intermediate, n_embd)?,
            w3: proj(p, n_embd, intermediate)?,
        })
    }
}

impl MoeExpert {
    /// The forward of rows from `source` (reference mode under expert parallelism): the same
    /// products as [`Forward::forward`], the parameters read through [`set_aside`] for `source`,
    /// so that their gradients are set aside per source while the trainer collects them.
    pub fn forward_for_source(&self, x: &Var, source: usize) -> Result<Var> {
        let linear = |l: &Linear, x: &Var| -> Result<Var> {
            let w = set_aside(&l.weight, source)?;
            let b = l.bias.as_ref().map(|b| set_aside(b, source)).transpose()?;
            Var::linear(x, &w, b.as_ref())
        };
        linear(
            &self.w2,
            &Var::swiglu(&linear(&self.w1, x)?, &linear(&self.w3, x)?)?,
        )
    }
}

impl Forward for MoeExpert {
    fn forward(&self, x: &Var) -> Result<Var> {
        self.w2
            .forward(&Var::swiglu(&self.w1.forward(x)?, &self.w3.forward(x)?)?)
    }
}

/// A layer's experts, or under expert parallelism this rank's block of them: `list[i]` is
/// expert `first + i`, and is named so (`experts.{first + i}`), as in the full model.
pub struct ExpertList {
    /// The global index of `list[0]`.
    pub first: usize,
    /// The experts held.
    pub list: Vec<MoeExpert>,
}

impl ModuleField for ExpertList {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        for (i, x) in self.list.iter().enumerate() {
            x.visit_field(&format!("{name}.{}", self.first + i), f)
        }
    }
}

/// Mixtral's sparse feed-forward (`block_sparse_moe`; see the [module docs](super)): the router
/// `gate` `[n_experts, n_embd]` and the experts `experts.{e}.{w1,w2,w3}`.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct SparseMoe {
    /// The router.
    pub gate: Linear,
    /// The experts (this rank's block of them under expert parallelism).
    pub experts: ExpertList,
    /// Expert parallelism: the group the experts are sharded over.
    pub ep: Option<ExpertParallel>,
    /// Context parallelism: the group that splits each sequence (the routed counts and the
    /// capacity's order are the whole sequences'), from the builder.
    pub cp: Option<ContextParallel>,
    /// Sequence parallelism (from the builder's tensor parallelism): the layer gathers its
    /// input's sequence over the group, computes on it as every tensor-parallel rank does
    /// without sequence parallelism (whole experts, the same tokens), and returns this rank's
    /// part.
    #[module(skip)]
    pub sp: Option<TensorParallel>,
    /// Routing settings.
    pub settings: MoeSettings,
    /// The layer's global index (its load's key in [`super::collect_expert_load`]).
    pub layer: usize,
    /// The factor of this layer's load-balancing loss in the objective (before the forward's
    /// loss scale): `router_aux_loss_coef / n_layer` in a model of `n_layer` layers.
    pub aux_weight: f64,
}

/// What [`SparseMoe::forward_routed`] computes besides the output.
pub struct MoeOutput {
    /// The output `[B, T, C]` (carrying the load-balancing loss's gradient, when weighted).
    pub output: Var,
    /// The load-balancing loss averaged over the sequences (a scalar, differentiable); under
    /// context parallelism this rank's part of it (the group's parts add up to it), in the
    /// folded position order the whole value (a constant).
    pub aux: Var,
    /// The routing: one, or one per position leaf in reference mode's folded order.
    pub routings: Vec<Routing>,
}

impl SparseMoe {
    /// The layer of global index `layer`, of width `n_embd`, experts `intermediate` wide, and
    /// its loss weighted by `aux_weight` (see [`SparseMoe::aux_weight`]).
    pub fn new(
        p: &ParamBuilder,
        (n_embd, intermediate): (usize, usize),
        settings: MoeSettings,
        (layer, aux_weight): (usize, f64),
    ) -> Result<Self> {
        settings.validate()?;
        let ep = p
            .expert_parallel_group()
            .filter(|e| e.degree() > 1)
            .cloned();
        let held = match &ep {
            Some(e) => e.local_experts(settings.n_experts)?,
            None => 0..settings.n_experts,
        };
        let gate = proj(p, n_embd, settings.n_experts)?;
        Ok(SparseMoe {
            gate,
            experts: ExpertList {
                first: held.start,
                list: held
                    .map(|_| MoeExpert::new(p, n_embd, intermediate))
                    .collect::<Result<_>>()?,
            },
            ep,
            cp: p
                .context_parallel_group()
                .filter(|c| c.is_active())
                .cloned(),
            sp: p
                .tensor_parallel_group()
                .filter(|tp| tp.splits_sequence())
                .cloned(),
            settings,
            layer,
            aux_weight,
        })
    }

    /// The output of `x [B, T, C]` with the loss and the routing (see the [module
    /// docs](super)); records the layer's load in the current collection. Under context
    /// parallelism `x` is this rank's chunks of the sequences: the counts behind the loss (and
    /// the capacity's token order) are the whole sequences', gathered over the group.
    pub fn forward_routed(&self, x: &Var) -> Result<MoeOutput> {
        let Some(tp) = &self.sp else {
            return self.forward_whole(x);
        };
        // Sequence parallelism: the tensor-parallel ranks' positions gathered, the layer as
        // without it (the same on every rank, so its parameters' gradients too), this rank's
        // positions of the output (whose backward gathers the gradient).
        let whole = all_gather_replicated(x, 1, &tp.group)?;
        let mut out = self.forward_whole(&whole)?;
        out.output = split_dim(&out.output, 1, &tp.group)?;
        Ok(out)
    }

    /// [`Self::forward_routed`] of `x` holding whole (context-parallel) sequences of this
    /// rank's rows.
    fn forward_whole(&self, x: &Var) -> Result<MoeOutput> {
        let d = x.tensor().dims().to_vec();
        if d.len() != 3 {
            meshgrad_tensor::bail!(
                "moe layer {}: expected input [B, T, C], got {}",
                self.layer,
                x.tensor().shape()
            );
        }
        let (b, t, c) = (d[0], d[1], d[2]);
        let cp = self.cp.as_ref();
        if let Some(folded) = cp.and_then(|cp| cp.folded()).filter(|f| f.splits(t)) {
            return self.forward_folded(x, folded);
        }
        let cp = cp.filter(|cp| cp.degree() > 1);
        let share = cp.map_or(1, |cp| cp.degree());
        let flat = x.reshape((b * t, c))?;
        let probs = self.router(&flat)?;
        let p = probs.tensor().to_vec_f64()?;
        let args = self.routing_args(&p, b, t);
        let routed_before = match (cp, self.settings.capacity_factor) {
            (Some(cp), Some(_)) => Some(routed_before(&args, cp)?),
            _ => None,
        };
        let routing = Routing::new(RoutingArgs {
            split: routed_before.as_ref().map(|r| SequenceSplit {
                sequence: t * share,
                segments: 2,
                routed_before: r,
            }),
            ..args
        })?;
        let mut row_routed: Vec<f64> = routing.row_routed.iter().map(|&c| c as f64).collect();
        if let Some(cp) = cp {
            // Exact: integer counts far below 2^53.
            let t = Tensor::from_vec(row_routed, b * self.settings.n_experts, Device::Cpu)?;
            row_routed = cp.group.all_reduce_sum(&t)?.to_vec_f64()?;
        }
        let totals = Totals {
            row_routed,
            sequence: t * share,
        };
        let (y, aux) = self.dispatch(&flat, &probs, &routing, &totals)?;
        // Each rank's objective is its share of the loss times the group size (the gradients
        // average over the group, as the cross-entropy's).
        let output = self.attach(y.reshape((b, t, c))?, &aux, share as f64)?;
        // This rank's part times the group size, over its rows: the step's reduction sums both
        // over the data-parallel ranks, the context-parallel ones among them, so the parts add
        // up to the sequences' loss with no collective here.
        load::record(
            self.layer,
            &routing.routed,
            routing.dropped,
            aux.tensor().to_vec_f64()?[0] * (share * b) as f64,
            b,
        );
        Ok(MoeOutput {
            output,
            aux,
            routings: vec![routing],
        })
    }

    /// Reference mode's folded position order (see
    /// [`meshgrad_autograd::distributed::folded`]): the layer once per position leaf (router,
    /// experts and this leaf's part of the loss), its parameters' gradients the tree over the
    /// leaves, with the whole sequences' routed counts counted first (the router once more per
    /// leaf, without gradients). With a capacity factor those counts are kept per fine chunk
    /// (gathered over the group) and each leaf's two chunks start from what the sequence routed
    /// before them, so the copies kept are those one device keeps in token order.
    fn forward_folded(&self, x: &Var, folded: &FoldedPositions) -> Result<MoeOutput> {
        let d = x.tensor().dims().to_vec();
        let (b, c, n) = (d[0], d[2], self.settings.n_experts);
        let leaves = folded.local_leaves();
        let sequence = d[1] * folded.group().size();
        // Per local fine chunk (leaf `a`'s early chunk at `a`, its late one at `2m - 1 - a`),
        // row and expert: the copies routed there (kept or not), `[2m, rows, N]`.
        let mut chunk_routed = vec![0.0; 2 * leaves * b * n];
        meshgrad_autograd::no_grad(|| -> Result<()> {
            for a in 0..leaves {
                let xl = Var::constant(folded.leaf(x.tensor(), 1, a)?);
                let tl = xl.tensor().dims()[1];
                let probs = self.router(&xl.reshape((b * tl, c))?)?;
                let p = probs.tensor().to_vec_f64()?;
                let runs = run_counts(&self.routing_args(&p, b, tl), 2)?;
                for (s, chunk) in [a, 2 * leaves - 1 - a].into_iter().enumerate() {
                    for row in 0..b {
                        for e in 0..n {
                            chunk_routed[(chunk * b + row) * n + e] =
                                runs[(row * 2 + s) * n + e] as f64;
                        }
                    }
                }
            }
            Ok(())
        })?;
        let mut counts = vec![0.0; b * n];
        for chunk in chunk_routed.chunks_exact(b * n) {
            for (s, &r) in counts.iter_mut().zip(chunk) {
                *s += r;
            }
        }
        let counts = Tensor::from_vec(counts, b * n, Device::Cpu)?;
        let totals = Totals {
            row_routed: folded.sum_over_group(&[counts])?.to_vec_f64()?,
            sequence,
        };
        let before = match self.settings.capacity_factor {
            Some(_) => Some(routed_before_chunks(
                &**folded.group(),
                &chunk_routed,
                (2 * folded.leaves(), b * n),
                |r, c| folded.chunk_at(r, c),
            )?),
            None => None,
        };
        let leaf = std::cell::Cell::new(0);
        let leaf_routing = |xl: &Var| -> Result<(Var, Var, Routing)> {
            let tl = xl.tensor().dims()[1];
            let flat = xl.reshape((b * tl, c))?;
            let probs = self.router(&flat)?;
            let p = probs.tensor().to_vec_f64()?;
            let a = leaf.replace(leaf.get() + 1);
            let runs = [a, 2 * leaves - 1 - a].map(|c| folded.global_chunk(c));
            let routed_before = before.as_ref().map(|r| runs_before(r, (b, n), runs));
            let routing = Routing::new(RoutingArgs {
                split: routed_before.as_ref().map(|r| SequenceSplit {
                    sequence,
                    segments: 2,
                    routed_before: r,
                }),
                ..self.routing_args(&p, b, tl)
            })?;
            Ok((flat, probs, routing))
        };
        let mut params: Vec<&Var> = vec![&self.gate.weight];
        for e in &self.experts.list {
            params.extend([&e.w1.weight, &e.w2.weight, &e.w3.weight]);
        }
        let parts = std::cell::RefCell::new((Vec::new(), Vec::new()));
        let output = folded.leafwise(x, 1, &params, |xl| {
            let (flat, probs, routing) = leaf_routing(xl)?;
            let (y, aux) = self.dispatch(&flat, &probs, &routing, &totals)?;
            let y = self.attach(y.reshape(xl.tensor().dims())?, &aux, 1.0)?;
            let mut parts = parts.borrow_mut();
            parts.0.push(aux.tensor().to_dtype(DType::F64)?.reshape(1)?);
            parts.1.push(routing);
            Ok(y)
        })?;
        let (values, routings) = parts.into_inner();
        let aux = folded.sum_over_group(&values)?;
        let mut routed = vec![0; n];
        for r in &routings {
            for (s, &c) in routed.iter_mut().zip(&r.routed) {
                *s += c;
            }
        }
        let dropped = routings.iter().map(|r| r.dropped).sum();
        load::record(
            self.layer,
            &routed,
            dropped,
            aux.to_vec_f64()?[0] * b as f64,
            b,
        );
        Ok(MoeOutput {
            output,
            aux: Var::constant(aux),
            routings,
        })
    }

    /// The router's probabilities `[tokens, N]` of `flat [tokens, C]`: the softmax of the
    /// gate's scores in f32 (f64 for an f64 model), as transformers' `softmax(dtype=float)`.
    fn router(&self, flat: &Var) -> Result<Var> {
        let route_dtype = if flat.tensor().dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        self.gate.forward(flat)?.to_dtype(route_dtype)?.softmax(-1)
    }

    /// The routing of `rows` sequences of `tokens` tokens from their probabilities `p`.
    fn routing_args<'a>(&self, p: &'a [f64], rows: usize, tokens: usize) -> RoutingArgs<'a> {
        RoutingArgs {
            probs: p,
            rows,
            tokens,
            n_experts: self.settings.n_experts,
            top_k: self.settings.experts_per_token,
            capacity_factor: self.settings.capacity_factor,
            split: None,
        }
    }

    /// The routed tokens of `flat [tokens, C]` through their experts, weighted and added back
    /// (`[tokens, C]`), and their part of the load-balancing loss ([`load_balancing_loss`]).
    fn dispatch(
        &self,
        flat: &Var,
        probs: &Var,
        routing: &Routing,
        totals: &Totals,
    ) -> Result<(Var, Var)> {
        let device = flat.tensor().device();
        let k = self.settings.experts_per_token;
        let tokens = flat.tensor().dims()[0];
        let choices = Tensor::from_vec(routing.choices.clone(), (tokens, k), device)?;
        let top = probs.gather(1, &choices)?;
        let weights = top
            .div(&top.sum(&[-1], true)?)?
            .to_dtype(flat.tensor().dtype())?;
        let permuted = permute(flat, routing)?;
        let expert_out = match &self.ep {
            Some(ep) => self.run_experts_parallel(&permuted, routing, ep)?,
            None => self.run_experts(&permuted, &routing.expert_sizes)?,
        };
        let y = unpermute(&expert_out, routing, &weights)?;
        let aux = load_balancing_loss(probs, totals, self.settings.n_experts)?;
        Ok((y, aux))
    }

    /// `y` carrying the loss `aux`'s gradient, weighted by the layer's weight, the forward's
    /// loss scale and `share` (unless the layer's weight is zero).
    fn attach(&self, y: Var, aux: &Var, share: f64) -> Result<Var> {
        if self.aux_weight == 0.0 {
            return Ok(y);
        }
        y.attach_aux_loss(
            aux,
            self.aux_weight * meshgrad_autograd::loss_scale() * share,
        )
    }

    /// Each held expert on its contiguous slice of `permuted [S, C]`, `sizes[i]` rows for
    /// `experts.list[i]` (experts without tokens skipped); the outputs in the same order. With
    /// no rows at all the result is `permuted` itself (`[0, C]`, still on the graph).
    pub fn run_experts(&self, permuted: &Var, sizes: &[usize]) -> Result<Var> {
        if sizes.len() != self.experts.list.len() {
            meshgrad_tensor::bail!(
                "moe layer {}: {} expert sizes for the {} experts held",
                self.layer,
                sizes.len(),
                self.experts.list.len()
            );
        }
        let mut outs = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for (expert, &size) in self.experts.list.iter().zip(sizes) {
            if size > 0 {
                outs.push(expert.forward(&permuted.narrow(0, start, size)?)?);
            }
            start += size;
        }
        if outs.is_empty() {
            return Ok(permuted.clone());
        }
        let refs: Vec<&Var> = outs.iter().collect();
        Var::cat(&refs, 0)
    }

    /// Expert parallelism: the permuted copies `[S, C]` (grouped by global expert) go to their
    /// experts' ranks (one all-to-all of the expert counts, one of the rows), this rank's
    /// experts run on what arrived (regrouped by expert, each expert's copies in source-rank
    /// order), and the outputs go back (the reverse all-to-all): `[S, C]` in `permuted`'s order.
    fn run_experts_parallel(
        &self,
        permuted: &Var,
        routing: &Routing,
        ep: &ExpertParallel,
    ) -> Result<Var> {
        let (e, n) = (ep.degree(), self.settings.n_experts);
        let per = n / e;
        // Every rank's per-expert counts (exact in f64: far below 2^53).
        let sizes: Vec<f64> = routing.expert_sizes.iter().map(|&s| s as f64).collect();
        let all = ep
            .group
            .all_gather(&Tensor::from_vec(sizes, n, Device::Cpu)?)?
            .to_vec_f64()?;
        let count = |src: usize, expert: usize| all[src * n + expert] as usize;
        let me = ep.group.rank();
        let send: Vec<usize> = (0..e)
            .map(|r| routing.expert_sizes[r * per..(r + 1) * per].iter().sum())
            .collect();
        let recv: Vec<usize> = (0..e)
            .map(|src| (me * per..(me + 1) * per).map(|x| count(src, x)).sum())
            .collect();
        let received = all_to_all_rows(permuted, &send, &recv, &ep.group)?;
        if ep.reference {
            let out =
                self.run_experts_by_source(&received, e, |src, i| count(src, me * per + i))?;
            let out = self.read_experts(&out)?;
            return all_to_all_rows(&out, &recv, &send, &ep.group);
        }
        // Arrived grouped by source, then expert: regroup by expert, then source.
        let mut src_start = vec![0usize; e];
        for s in 1..e {
            src_start[s] = src_start[s - 1] + recv[s - 1];
        }
        let mut order: Vec<u32> = Vec::with_capacity(recv.iter().sum());
        let mut local_sizes = vec![0usize; per];
        for (i, size) in local_sizes.iter_mut().enumerate() {
            for (src, start) in src_start.iter().enumerate() {
                let before: usize = (0..i).map(|j| count(src, me * per + j)).sum();
                let c = count(src, me * per + i);
                order.extend((start + before..start + before + c).map(|x| x as u32));
                *size += c;
            }
        }
        let device = permuted.tensor().device();
        let by_expert = gather_rows(&received, &order, device)?;
        let out = self.run_experts(&by_expert, &local_sizes)?;
        let out = self.read_experts(&out)?;
        // Back to source order: the inverse permutation.
        let mut inverse = vec![0u32; order.len()];
        for (pos, &src_row) in order.iter().enumerate() {
            inverse[src_row as usize] = pos as u32;
        }
        let back = gather_rows(&out, &inverse, device)?;
        all_to_all_rows(&back, &recv, &send, &ep.group)
    }

    /// `out` itself, after reading every parameter of the experts held, and reading them again
    /// in its backward (before the experts' backward, which follows it). An expert without
    /// tokens is skipped, so without this a rank whose experts of this layer all got none would
    /// not read them, where a rank holding the same experts with tokens would: under expert
    /// parallelism with ZeRO-3 the experts are sharded over the ranks holding the same ones
    /// (see `meshgrad_parallel::ExpertDataParallel`) and gathered when first read, and every
    /// rank of that group must gather the same units in the same order. Reading an already
    /// present parameter costs nothing, and nothing is added to any gradient.
    fn read_experts(&self, out: &Var) -> Result<Var> {
        let params: Vec<Tensor> = (self.experts.list.iter())
            .flat_map(crate::Module::parameters)
            .map(|v| v.tensor().clone())
            .collect();
        for t in &params {
            t.ensure_materialized()?;
        }
        Ok(Var::from_op(
            "read_experts",
            out.tensor().clone(),
            &[out],
            Box::new(move |g, _| {
                for t in &params {
                    t.ensure_materialized()?;
                }
                Ok(vec![Some(g.clone())])
            }),
        ))
    }

    /// Reference mode's experts under expert parallelism: `received` holds the copies of each
    /// of the `sources` ranks in turn, each grouped by this rank's experts (`count(source, i)`
    /// copies for `experts.list[i]`); each source's copies of each expert run on their own,
    /// with the expert's parameters set aside for that source (see
    /// [`ExpertParallel`]'s docs). The outputs in `received`'s order (`received` itself when
    /// nothing arrived).
    fn run_experts_by_source(
        &self,
        received: &Var,
        sources: usize,
        count: impl Fn(usize, usize) -> usize,
    ) -> Result<Var> {
        let mut outs = Vec::new();
        let mut start = 0;
        for src in 0..sources {
            for (i, expert) in self.experts.list.iter().enumerate() {
                let c = count(src, i);
                if c > 0 {
                    outs.push(expert.forward_for_source(&received.narrow(0, start, c)?, src)?);
                }
                start += c;
            }
        }
        if outs.is_empty() {
            return Ok(received.clone());
        }
        let refs: Vec<&Var> = outs.iter().collect();
        Var::cat(&refs, 0)
    }
}

impl Forward for SparseMoe {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        Ok(self.forward_routed(x)?.output)
    }
}

/// Rows `ids` of `x` (an `index_select`; `x` itself when there are no rows).
fn gather_rows(x: &Var, ids: &[u32], device: Device) -> Result<Var> {
    if ids.is_empty() {
        return Ok(x.clone());
    }
    x.index_select(0, &Tensor::from_vec(ids.to_vec(), ids.len(), device)?)
}

/// The permutation: the kept token copies of `flat [tokens, C]`, grouped by expert
/// (`[S, C]`, a gather).
pub fn permute(flat: &Var, routing: &Routing) -> Result<Var> {
    let ids = Tensor::from_vec(
        routing.permuted_tokens.clone(),
        routing.permuted_tokens.len(),
        flat.tensor().device(),
    )?;
    flat.index_select(0, &ids)
}

/// The weighted un-permutation: each token's `k` expert outputs gathered back from `expert_out
/// [S, C]` (a dropped copy reads a zero row) and added with their `weights [tokens, k]`, in
/// choice order. `[tokens, C]`.
pub fn unpermute(expert_out: &Var, routing: &Routing, weights: &Var) -> Result<Var> {
    let (s, c) = (expert_out.tensor().dims()[0], expert_out.tensor().dims()[1]);
    let k = routing.top_k;
    let tokens = routing.slot_position.len() / k;
    let t = expert_out.tensor();
    let source = if routing.dropped > 0 {
        let zero = Var::constant(Tensor::zeros((1, c), t.dtype(), t.device())?);
        Var::cat(&[expert_out, &zero], 0)?
    } else {
        expert_out.clone()
    };
    debug_assert!(routing.slot_position.iter().all(|&p| p as usize <= s));
    let ids = Tensor::from_vec(
        routing.slot_position.clone(),
        routing.slot_position.len(),
        t.device(),
    )?;
    source
        .index_select(0, &ids)?
        .reshape((tokens, k, c))?
        .mul(&weights.unsqueeze(-1)?)?
        .sum(&[1], false)
}

/// The routed counts of the sequences a forward's tokens belong to (the whole sequences, over
/// every context-parallel rank).
struct Totals {
    /// Copies routed to each expert per row, `[rows * N]`.
    row_routed: Vec<f64>,
    /// Tokens of a whole sequence (`T`).
    sequence: usize,
}

/// The load-balancing loss of the tokens of `probs [rows * t, N]` averaged over the rows: per
/// sequence `N * sum_e f_e * P_e` (see the [module docs](super)) with `f_e` from the whole
/// sequences' counts `totals` and `P_e` summed over these tokens only, so that the parts of a
/// sequence's tokens (context-parallel ranks, position leaves) add up to its loss.
fn load_balancing_loss(probs: &Var, totals: &Totals, n: usize) -> Result<Var> {
    let p = probs.tensor();
    let rows = totals.row_routed.len() / n.max(1);
    let t = totals.sequence as f64;
    let f: Vec<f64> = totals
        .row_routed
        .iter()
        .map(|&c| n as f64 * c / (t * t))
        .collect();
    let f = Tensor::from_vec(f, (rows, n), p.device())?.to_dtype(p.dtype())?;
    probs
        .reshape((rows, p.dims()[0] / rows.max(1), n))?
        .sum(&[1], false)?
        .mul(&Var::constant(f))?
        .sum(&[-1], false)?
        .mean_all()
}

/// The copies routed at each chunk's earlier chunks of the sequence, `[chunks, per_chunk]` for
/// every global chunk (of `chunks`) and `per_chunk` counts (rows x experts), from every rank's
/// copies routed at its local chunks (`local`, `[local chunks, per_chunk]`; an all-gather over
/// `group`), `chunk_at(r, c)` naming rank `r`'s local chunk `c`. What the capacity needs to keep
/// copies in the sequence's token order when a rank holds chunks of it.
fn routed_before_chunks(
    group: &dyn Collectives,
    local: &[f64],
    (chunks, per_chunk): (usize, usize),
    chunk_at: impl Fn(usize, usize) -> usize,
) -> Result<Vec<usize>> {
    let all = group
        .all_gather(&Tensor::from_vec(local.to_vec(), local.len(), Device::Cpu)?)?
        .to_vec_f64()?;
    let local_chunks = local.len() / per_chunk.max(1);
    let mut by_chunk = vec![0; chunks * per_chunk];
    for (at, counts) in all.chunks_exact(per_chunk).enumerate() {
        let g = chunk_at(at / local_chunks, at % local_chunks);
        for (to, &c) in by_chunk[g * per_chunk..(g + 1) * per_chunk]
            .iter_mut()
            .zip(counts)
        {
            *to = c as usize;
        }
    }
    // Exclusive prefix sums over the chunks in sequence order.
    let mut before = vec![0; by_chunk.len()];
    for i in per_chunk..before.len() {
        before[i] = before[i - per_chunk] + by_chunk[i - per_chunk];
    }
    Ok(before)
}

/// A rank's [`SequenceSplit::routed_before`], `[rows, 2, N]`, for its two runs at global chunks
/// `runs` from [`routed_before_chunks`]' `before` (`[chunks, rows, N]`).
fn runs_before(before: &[usize], (rows, n): (usize, usize), runs: [usize; 2]) -> Vec<usize> {
    (0..rows)
        .flat_map(|row| runs.map(|g| &before[(g * rows + row) * n..(g * rows + row + 1) * n]))
        .flatten()
        .copied()
        .collect()
}

/// Under context parallelism with a capacity factor: for each row, run (this rank's two chunks)
/// and expert `[rows, 2, N]`, the copies routed at the sequence's earlier chunks, from every
/// rank's [`run_counts`] (an all-gather over the group).
fn routed_before(args: &RoutingArgs<'_>, cp: &ContextParallel) -> Result<Vec<usize>> {
    let (rows, n) = (args.rows, args.n_experts);
    // [rows, 2, N] to [2, rows, N]: by local chunk.
    let runs = run_counts(args, 2)?;
    let local: Vec<f64> = (0..2)
        .flat_map(|s| (0..rows).flat_map(move |row| (0..n).map(move |e| (row, s, e))))
        .map(|(row, s, e)| runs[(row * 2 + s) * n + e] as f64)
        .collect();
    let size = cp.degree();
    let chunk_at = |r: usize, s: usize| ChunkOrder::new(r, size).chunks()[s];
    let before = routed_before_chunks(&*cp.group, &local, (2 * size, rows * n), chunk_at)?;
    Ok(runs_before(&before, (rows, n), cp.order().chunks()))
}
