//! The pipeline executor in lockstep with a single device: a small GPT (8 blocks, biases and
//! dropout on) trained 3 steps with AdamW and gradient clipping on one device, accumulating
//! gradients over the same M = 4 microbatches (each microbatch's loss divided by M), and under
//! every schedule: GPipe, 1F1B and zero-bubble (split backward) with pp=2 and pp=4, interleaved
//! 1F1B with 2 chunks per rank with pp=1 (chunks handing activations and gradients to each other
//! on one rank, both tied copies local), pp=2 and pp=4; and a small BERT (4 layers, dropout on)
//! under zero-bubble and interleaved with pp=2. Losses and final weights (each chunk's
//! parameters compared by name with the full model's; the tied table taken from virtual stage 0
//! and the last virtual stage's copy checked equal to it bit for bit) must agree within 1e-5
//! relative (f32). Per-stage gradients are the single device's bit for bit (chained stages and
//! the split backward both are); the only layout-dependent rounding is the tied table's
//! gradient (the single device adds the embedding's and the head's contributions per
//! microbatch, the pipeline sums each over the microbatches first) and the order of the f64
//! norm sums. Reference mode's `execute_with` hands over each microbatch's gradients alone,
//! the single device's per-microbatch gradients bit for bit (the tied table's as the head's plus
//! the embedding's).
//!
//! Every run uses rendezvous sends (a send completes when its receive takes the message), so
//! the schedules are shown not to deadlock on a backend without buffering; a hand-made schedule
//! whose two ranks exchange tensors in the same step passes thanks to grouped transfers, and
//! one that deadlocks fails after the timeout with an error naming the ranks and the actions.
//! Every action of every run is recorded in a timeline span.

use crate::common;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{assert_close, full_weights, RunOut};
use meshgrad_nn::bert::IGNORE_INDEX;
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer};
use meshgrad_nn::{
    BertBatch, BertConfig, BertForMaskedLM, ForwardCtx, Gpt, GptBatch, GptConfig, ModelStage,
    Module, StageSpec,
};
use meshgrad_parallel::comm::{run_ranks, run_ranks_each, RunOptions};
use meshgrad_parallel::layout::ParallelLayout;
use meshgrad_parallel::micro_rows;
use meshgrad_parallel::pipeline::{
    execute, execute_with, Action, ExecuteOptions, Microbatch, PipelineGrads, Schedule,
    ScheduleKind, Timeline,
};
use meshgrad_parallel::{DataParallel, Ddp, DdpConfig};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 7;
const BATCH: usize = 8;
const MICRO: usize = 4;
const T: usize = 16;
const STEPS: usize = 3;
const LR: f64 = 1e-3;
const CLIP: f64 = 0.5;
const TOL: f64 = 1e-5;

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 8,
        n_head: 2,
        n_embd: 16,
        dropout: 0.1,
        bias: true,
        layer_norm_eps: 1e-5,
    }
}

fn bert_config() -> BertConfig {
    BertConfig {
        vocab_size: 40,
        hidden_size: 16,
        num_hidden_layers: 4,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: T,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        pad_token_id: 0,
        initializer_range: 0.02,
    }
}

fn dataset() -> &'static TokenDataset {
    static DATA: OnceLock<TokenDataset> = OnceLock::new();
    DATA.get_or_init(|| {
        let tokens: Vec<u32> = (0..4000u64)
            .map(|i| {
                let h = meshgrad_nn::data::splitmix64(i);
                if h.is_multiple_of(5) {
                    (h >> 8) as u32 % 64
                } else {
                    ((i * 7 + i / 13) % 64) as u32
                }
            })
            .collect();
        TokenDataset::from_tokens("synthetic", tokens, 64).unwrap()
    })
}

fn gpt_batch(step: usize, rows: Range<u64>) -> Result<GptBatch> {
    let n = (rows.end - rows.start) as usize;
    let b = dataset()
        .batch(SEED, step as u64, rows, T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    Ok(GptBatch {
        ids: Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?,
        targets: Tensor::from_vec(b.targets, (n, T), Device::Cpu)?,
        ignore_index: None,
    })
}

/// Rows `rows` of step `step`'s BERT batch: padding at the end of some rows (mask 0), two token
/// types, about a third of the real tokens labelled; a function of (step, row) only.
fn bert_batch(step: usize, rows: Range<u64>) -> Result<BertBatch> {
    let vocab = bert_config().vocab_size as u64;
    let (mut ids, mut mask, mut types, mut labels) = (vec![], vec![], vec![], vec![]);
    for r in rows.clone() {
        let len = T - (r as usize % 4) * 3;
        for c in 0..T {
            let h = meshgrad_nn::data::splitmix64((step as u64) << 32 | r << 8 | c as u64);
            let real = c < len;
            ids.push(if real {
                1 + (h % (vocab - 1)) as u32
            } else {
                0
            });
            mask.push(u32::from(real));
            types.push(u32::from(real && c >= len / 2));
            labels.push(if real && (h >> 20).is_multiple_of(3) {
                ((h >> 32) % vocab) as i64
            } else {
                IGNORE_INDEX
            });
        }
    }
    let n = (rows.end - rows.start) as usize;
    let u = |v: Vec<u32>| Tensor::from_vec(v, (n, T), Device::Cpu);
    Ok(BertBatch {
        ids: u(ids)?,
        attention_mask: Some(u(mask)?),
        token_type_ids: Some(u(types)?),
        labels: Tensor::from_vec(labels, (n, T), Device::Cpu)?,
        denominator: None,
    })
}

fn optimizer(named: Vec<(String, meshgrad_autograd::Var)>) -> AdamW {
    AdamW::new(param_groups_for_decay(named, 0.1), AdamWConfig::default()).unwrap()
}

/// One device, gradient accumulation over the step's MICRO microbatches: `loss(step, rows)`
/// runs one microbatch's forward.
fn single_device(
    model: &dyn Module,
    loss: impl Fn(usize, Range<u64>) -> Result<meshgrad_autograd::Var>,
) -> RunOut {
    let mut opt = optimizer(model.named_parameters());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        let mut sum = 0.0;
        for rows in micro_rows(0..BATCH as u64, MICRO).unwrap() {
            let l = ForwardCtx::new(step as u64, rows.start)
                .scope(|| loss(step, rows.clone()))
                .unwrap();
            l.mul_scalar(1.0 / MICRO as f64)
                .unwrap()
                .backward()
                .unwrap();
            sum += l.tensor().item().unwrap();
        }
        losses.push(sum / MICRO as f64);
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step(LR).unwrap();
    }
    RunOut {
        losses,
        weights: full_weights(model).unwrap(),
    }
}

fn gpt_single_device() -> &'static RunOut {
    static OUT: OnceLock<RunOut> = OnceLock::new();
    OUT.get_or_init(|| {
        let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
        single_device(&model, |step, rows| {
            let b = gpt_batch(step, rows)?;
            model.loss(&b.ids, &b.targets, None)
        })
    })
}

fn bert_single_device() -> &'static RunOut {
    static OUT: OnceLock<RunOut> = OnceLock::new();
    OUT.get_or_init(|| {
        let model = BertForMaskedLM::new(bert_config(), SEED, DType::F32, Device::Cpu).unwrap();
        freeze(&BertModel, &model).unwrap();
        single_device(&model, |step, rows| {
            let b = bert_batch(step, rows)?;
            let (mask, types) = (b.attention_mask.as_ref(), b.token_type_ids.as_ref());
            model.loss(&b.ids, mask, types, &b.labels)
        })
    })
}

/// A model as the pipeline runs it: its stages, its microbatches, the full model's parameter
/// names and its tied table.
trait Staged: Sync {
    type Stage: ModelStage;
    fn n_layer(&self) -> usize;
    fn stage(&self, spec: StageSpec) -> Result<Self::Stage>;
    fn batch(&self, step: usize, rows: Range<u64>) -> Result<<Self::Stage as ModelStage>::Batch>;
    fn names(&self) -> Vec<String>;
    fn tied(&self) -> &'static str;
    /// Parameters frozen in every run (see [`freeze`]).
    fn frozen(&self, _name: &str) -> bool {
        false
    }
}

/// Freezes `model`'s parameters that `m` names frozen: BERT's attention key biases, whose
/// gradient is zero analytically (softmax is invariant to adding `q·b` to every score of a
/// row), so what backward computes for them is rounding noise, which AdamW's normalised step
/// turns into updates that depend on the last bits of every other weight (and so on the tied
/// table's summation order): ~50% apart between runs that agree everywhere else to 1e-6.
fn freeze<M: Staged>(m: &M, model: &dyn Module) -> Result<()> {
    for (n, p) in model.named_parameters() {
        if m.frozen(&n) {
            p.set_requires_grad(false)?;
        }
    }
    Ok(())
}

struct GptModel;

impl Staged for GptModel {
    type Stage = Gpt;
    fn n_layer(&self) -> usize {
        gpt_config().n_layer
    }
    fn stage(&self, spec: StageSpec) -> Result<Gpt> {
        Gpt::new_stage(gpt_config(), spec, SEED, DType::F32, Device::Cpu)
    }
    fn batch(&self, step: usize, rows: Range<u64>) -> Result<GptBatch> {
        gpt_batch(step, rows)
    }
    fn names(&self) -> Vec<String> {
        let full = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
        full.named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }
    fn tied(&self) -> &'static str {
        "wte.weight"
    }
}

struct BertModel;

impl Staged for BertModel {
    type Stage = BertForMaskedLM;
    fn n_layer(&self) -> usize {
        bert_config().num_hidden_layers
    }
    fn stage(&self, spec: StageSpec) -> Result<BertForMaskedLM> {
        BertForMaskedLM::new_stage(bert_config(), spec, SEED, DType::F32, Device::Cpu)
    }
    fn batch(&self, step: usize, rows: Range<u64>) -> Result<BertBatch> {
        bert_batch(step, rows)
    }
    fn names(&self) -> Vec<String> {
        let full = BertForMaskedLM::new(bert_config(), SEED, DType::F32, Device::Cpu).unwrap();
        full.named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect()
    }
    fn tied(&self) -> &'static str {
        "bert.embeddings.word_embeddings.weight"
    }
    fn frozen(&self, name: &str) -> bool {
        name.ends_with("attention.self.key.bias")
    }
}

/// This rank's chunks: chunk `c` is virtual stage `c * P + rank` of an even split.
fn chunks<M: Staged>(model: &M, schedule: &Schedule, rank: usize) -> Result<Vec<M::Stage>> {
    let specs = StageSpec::even(model.n_layer(), schedule.virtual_stages())?;
    (0..schedule.chunks)
        .map(|c| {
            let stage = model.stage(specs[schedule.virtual_stage(rank, c)].clone())?;
            freeze(model, &stage)?;
            Ok(stage)
        })
        .collect()
}

fn microbatches<M: Staged>(
    model: &M,
    step: usize,
) -> Result<Vec<Microbatch<<M::Stage as ModelStage>::Batch>>> {
    micro_rows(0..BATCH as u64, MICRO)?
        .into_iter()
        .map(|rows| {
            Ok(Microbatch {
                first_row: rows.start,
                batch: model.batch(step, rows)?,
            })
        })
        .collect()
}

/// The ranks of `schedule`, each holding its chunks, trained STEPS steps with rendezvous sends;
/// the weights joined by name (the tied table from virtual stage 0, checked equal to the last
/// virtual stage's copy). Every step's timeline has one span per action.
fn pipeline_run<M: Staged>(model: &M, schedule: &Schedule) -> RunOut {
    let pp = schedule.stages;
    // Rendezvous sends: a schedule that would deadlock on NCCL or MPI fails here too.
    let opts = RunOptions::with_timeout(Duration::from_secs(60)).rendezvous();
    let outs = run_ranks(pp, &opts, |ctx| {
        let rank = ctx.comm.rank();
        let stages = chunks(model, schedule, rank)?;
        let grads = PipelineGrads::new(&stages, ctx.comm.clone())?;
        // One optimizer over every chunk (with one rank, both copies of the tied table: their
        // names made distinct).
        let named = stages.iter().enumerate().flat_map(|(c, s)| {
            s.named_parameters()
                .into_iter()
                .map(move |(n, p)| (format!("chunk{c}.{n}"), p))
        });
        let mut opt = optimizer(named.collect());
        let timeline = Timeline::new(rank, Instant::now());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            opt.zero_grad();
            timeline.clear();
            let mbs = microbatches(model, step)?;
            let loss = execute(
                &stages,
                schedule,
                ctx.comm.as_ref(),
                &mbs,
                step as u64,
                Some(&timeline),
            )?;
            losses.push(loss);
            let mut labels: Vec<String> = timeline.spans().into_iter().map(|s| s.label).collect();
            let mut want: Vec<String> = schedule.ranks[rank]
                .iter()
                .map(|a| a.label(schedule.chunks))
                .collect();
            labels.sort();
            want.sort();
            assert_eq!(labels, want, "rank {rank}: one span per action");
            grads.step(&mut opt, Some(CLIP), LR)?;
        }
        let mut weights = Vec::new();
        for s in &stages {
            weights.extend(full_weights(s)?);
        }
        Ok((losses, weights))
    })
    .unwrap();
    for (r, (l, _)) in outs.iter().enumerate() {
        assert_eq!(l, &outs[0].0, "rank {r} reports the last stage's losses");
    }
    let mut weights: HashMap<String, Vec<f32>> = HashMap::new();
    for (_, ws) in &outs {
        for (name, w) in ws {
            match weights.get(name) {
                // Only the tied table is held twice: the copies take the same updates.
                Some(first) => {
                    assert_eq!(name, model.tied());
                    assert_eq!(first, w, "the last virtual stage's {name} copy");
                }
                None => {
                    weights.insert(name.clone(), w.clone());
                }
            }
        }
    }
    let names = model.names();
    assert_eq!(
        weights.len(),
        names.len(),
        "the chunks hold the model's parameters"
    );
    RunOut {
        losses: outs[0].0.clone(),
        weights: names
            .into_iter()
            .map(|n| {
                let w = weights
                    .remove(&n)
                    .unwrap_or_else(|| panic!("no chunk holds {n}"));
                (n, w)
            })
            .collect(),
    }
}

fn check<M: Staged>(
    model: &M,
    want: &RunOut,
    kind: ScheduleKind,
    pp: usize,
    chunks: Option<usize>,
) {
    let s = Schedule::generate(kind, pp, MICRO, chunks).unwrap();
    let what = format!("pp={pp} {kind} chunks={}", s.chunks);
    assert_close(&what, &pipeline_run(model, &s), want, TOL);
}

/// `dp=2,pp=P` trained like the CLI's trainer: each stage wrapped in [`DataParallel`] (DDP
/// with small buckets) over its data-parallel group, the reduction switched on for each chunk's
/// last weight-gradient action of the schedule ([`Schedule::last_weight_gradients`]), the tied
/// table's copies added after their averages ([`DataParallel::finish_pipeline`]). Returns the
/// run (losses: the last stage's mean over the data-parallel ranks) and, per rank, how many steps
/// launched a bucket from a gradient-ready hook, i.e. during the backward.
fn dp_pipeline_run<M: Staged>(model: &M, schedule: &Schedule) -> (RunOut, Vec<usize>) {
    const DP: usize = 2;
    let pp = schedule.stages;
    let layout: ParallelLayout = format!("dp={DP},pp={pp}").parse().unwrap();
    let opts = RunOptions::with_timeout(Duration::from_secs(60)).rendezvous();
    let outs = run_ranks(DP * pp, &opts, |ctx| {
        let mesh = layout.mesh(ctx.comm.clone())?;
        let (p, d) = (mesh.pp_group().rank(), mesh.dp_rank());
        let stages = chunks(model, schedule, p)?;
        let grads = PipelineGrads::new(&stages, mesh.pp_group())?;
        let named: Vec<_> = stages
            .iter()
            .enumerate()
            .flat_map(|(c, s)| {
                s.named_parameters()
                    .into_iter()
                    .map(move |(n, v)| (format!("chunk{c}.{n}"), v))
            })
            .collect();
        let config = DdpConfig {
            bucket_bytes: 4 << 10,
            ..Default::default()
        };
        let wrapper = DataParallel::Ddp(Ddp::new(named.clone(), mesh.dp_group(), config)?);
        assert!(wrapper.reduces_during_backward(&grads));

        let mut opt = optimizer(named);
        let last = schedule.last_weight_gradients(p);
        let (mut losses, mut overlapped) = (Vec::new(), 0);
        for step in 0..STEPS {
            wrapper.zero_grad(&opt);
            // This rank's rows of the step: half of the global batch, in M / DP microbatches.
            let rows = (d * BATCH / DP) as u64..((d + 1) * BATCH / DP) as u64;
            let mbs = micro_rows(rows, MICRO / DP)?
                .into_iter()
                .map(|r| {
                    Ok(Microbatch {
                        first_row: r.start,
                        batch: model.batch(step, r)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let mut before = |mb: usize, chunk: usize| -> Result<()> {
                wrapper.set_sync(last[chunk] == Some(mb));
                Ok(())
            };
            let local = execute_with(
                &stages,
                schedule,
                mesh.pp_group().as_ref(),
                &mbs,
                step as u64,
                None,
                ExecuteOptions {
                    loss_scale: Some(1.0 / mbs.len() as f64),
                    on_grads: None,
                    before_grads: Some(&mut before),
                },
            )?;
            wrapper.finish_pipeline(&grads, true)?;
            let DataParallel::Ddp(ddp) = &wrapper else {
                unreachable!("built as DDP above")
            };
            overlapped += ddp.last_launches().iter().any(|e| e.during_backward) as usize;
            let norm = wrapper.grad_norm(&grads)?;
            wrapper.clip_grads_with_norm(&grads, CLIP, norm)?;
            wrapper.step(&mut opt, LR)?;
            losses.push(local.iter().sum::<f64>() / local.len() as f64);
        }
        let mut weights = Vec::new();
        for s in &stages {
            weights.extend(full_weights(s)?);
        }
        Ok((p, d, losses, weights, overlapped))
    })
    .unwrap();
    let last_stage: Vec<_> = outs.iter().filter(|o| o.0 + 1 == pp).collect();
    let losses = (0..STEPS)
        .map(|i| last_stage.iter().map(|o| o.2[i]).sum::<f64>() / DP as f64)
        .collect();
    let mut weights: HashMap<String, Vec<f32>> = HashMap::new();
    for (_, d, _, ws, _) in &outs {
        for (name, w) in ws {
            if let Some(first) = weights.get(name) {
                // The replicas, and the tied table's two copies, hold the same bits.
                assert_eq!(first, w, "{name} on data-parallel rank {d}");
            } else {
                weights.insert(name.clone(), w.clone());
            }
        }
    }
    let weights = model
        .names()
        .into_iter()
        .map(|n| {
            let w = weights
                .remove(&n)
                .unwrap_or_else(|| panic!("no chunk holds {n}"));
            (n, w)
        })
        .collect();
    (
        RunOut { losses, weights },
        outs.iter().map(|o| o.4).collect(),
    )
}

#[test]
fn gpt_dp_pipeline_reduces_during_backward_in_lockstep() {
    for (kind, chunks) in [
        (ScheduleKind::OneFOneB, None),
        (ScheduleKind::ZeroBubble, None),
        (ScheduleKind::Interleaved, Some(2)),
    ] {
        let s = Schedule::generate(kind, 2, MICRO / 2, chunks).unwrap();
        let what = format!("dp=2,pp=2 {kind} chunks={}", s.chunks);
        let (run, overlapped) = dp_pipeline_run(&GptModel, &s);
        assert_close(&what, &run, gpt_single_device(), TOL);
        assert!(
            overlapped.iter().all(|&n| n == STEPS),
            "{what}: steps with a bucket reduced during the backward, per rank: {overlapped:?}"
        );
    }
}

#[test]
fn gpt_gpipe_and_1f1b_match_single_device() {
    for pp in [2, 4] {
        check(
            &GptModel,
            gpt_single_device(),
            ScheduleKind::GPipe,
            pp,
            None,
        );
        check(
            &GptModel,
            gpt_single_device(),
            ScheduleKind::OneFOneB,
            pp,
            None,
        );
    }
}

#[test]
fn gpt_interleaved_matches_single_device() {
    // pp=1: the two chunks hand activations and gradients to each other, and hold both copies
    // of the tied table.
    for pp in [1, 2, 4] {
        check(
            &GptModel,
            gpt_single_device(),
            ScheduleKind::Interleaved,
            pp,
            Some(2),
        );
    }
}

#[test]
fn gpt_zero_bubble_matches_single_device() {
    for pp in [2, 4] {
        check(
            &GptModel,
            gpt_single_device(),
            ScheduleKind::ZeroBubble,
            pp,
            None,
        );
    }
}

#[test]
fn bert_zero_bubble_and_interleaved_match_single_device() {
    check(
        &BertModel,
        bert_single_device(),
        ScheduleKind::ZeroBubble,
        2,
        None,
    );
    check(
        &BertModel,
        bert_single_device(),
        ScheduleKind::Interleaved,
        2,
        Some(2),
    );
}

/// Per microbatch, each parameter's gradient bits by name.
type PerMicrobatch = Vec<HashMap<String, Vec<u32>>>;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec_f32()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// [`execute_with`] (reference mode's executor): each microbatch's loss times `FACTOR`, the
/// callback once per (microbatch, chunk) as soon as that microbatch's gradients are complete
/// (after the zero-bubble weight pass too), so that taking them out there leaves each
/// microbatch's gradients alone: the single device's per-microbatch gradients bit for bit, the
/// tied table's as the head's plus the embedding's; the losses come back per microbatch on the
/// last rank.
#[test]
fn execute_with_hands_over_each_microbatchs_gradients_alone() {
    const FACTOR: f64 = 1.0 / 8.0;
    let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
    let mut want: PerMicrobatch = Vec::new();
    let mut want_losses = Vec::new();
    for rows in micro_rows(0..BATCH as u64, MICRO).unwrap() {
        let l = ForwardCtx::new(0, rows.start)
            .scope(|| {
                let b = gpt_batch(0, rows.clone())?;
                model.loss(&b.ids, &b.targets, None)
            })
            .unwrap();
        want_losses.push(l.tensor().item().unwrap());
        l.mul_scalar(FACTOR).unwrap().backward().unwrap();
        let mut g = HashMap::new();
        for (n, p) in model.named_parameters() {
            g.insert(n, bits(&p.grad().unwrap()));
            p.set_grad(None);
        }
        want.push(g);
    }
    let cases = [
        (ScheduleKind::ZeroBubble, 2, None),
        (ScheduleKind::Interleaved, 2, Some(2)),
        (ScheduleKind::OneFOneB, 4, None),
    ];
    for (kind, pp, chunks_per_rank) in cases {
        let schedule = Schedule::generate(kind, pp, MICRO, chunks_per_rank).unwrap();
        let opts = RunOptions::with_timeout(Duration::from_secs(60)).rendezvous();
        let outs = run_ranks(pp, &opts, |ctx| {
            let rank = ctx.comm.rank();
            let stages = chunks(&GptModel, &schedule, rank)?;
            let mbs = microbatches(&GptModel, 0)?;
            let mut got: Vec<HashMap<(usize, String), Vec<u32>>> = vec![HashMap::new(); MICRO];
            let mut on_grads = |m: usize, c: usize| -> Result<()> {
                let spec = stages[c].spec();
                for (n, p) in stages[c].named_parameters() {
                    let Some(g) = p.grad() else { continue };
                    p.set_grad(None);
                    // The tied copies: 0 the embedding's, 1 the head's.
                    let copy = usize::from(n == "wte.weight" && !spec.embedding);
                    let seen = got[m].insert((copy, n), bits(&g));
                    assert!(seen.is_none(), "rank {rank}: mb {m} chunk {c} handed twice");
                }
                Ok(())
            };
            let losses = execute_with(
                &stages,
                &schedule,
                ctx.comm.as_ref(),
                &mbs,
                0,
                None,
                ExecuteOptions {
                    loss_scale: Some(FACTOR),
                    on_grads: Some(&mut on_grads),
                    before_grads: None,
                },
            )?;
            Ok((losses, got))
        })
        .unwrap();
        let what = format!("pp={pp} {kind}");
        assert_eq!(
            outs[pp - 1].0,
            want_losses,
            "{what}: losses on the last rank"
        );
        assert!(outs[..pp - 1].iter().all(|(l, _)| l.is_empty()), "{what}");
        for (m, want) in want.iter().enumerate() {
            let mut got: HashMap<(usize, String), Vec<u32>> = HashMap::new();
            for (_, per) in &outs {
                got.extend(per[m].clone());
            }
            for (n, w) in want {
                if n == "wte.weight" {
                    let f = |copy: usize| -> Vec<f32> {
                        got[&(copy, n.clone())]
                            .iter()
                            .map(|&b| f32::from_bits(b))
                            .collect()
                    };
                    let sum: Vec<u32> = f(1)
                        .iter()
                        .zip(f(0))
                        .map(|(a, b)| (a + b).to_bits())
                        .collect();
                    assert_eq!(&sum, w, "{what}: mb {m}: head + embedding of {n}");
                } else {
                    assert_eq!(&got[&(0, n.clone())], w, "{what}: mb {m}: {n}");
                }
            }
            assert_eq!(got.len(), want.len() + 1, "{what}: mb {m}: every gradient");
        }
    }
}

fn fwd(m: usize) -> Action {
    Action::Forward {
        microbatch: m,
        chunk: 0,
    }
}

fn bwd(m: usize) -> Action {
    Action::Backward {
        microbatch: m,
        chunk: 0,
    }
}

fn send_a(m: usize, peer: usize) -> Action {
    Action::SendActivation {
        peer,
        microbatch: m,
        chunk: 0,
    }
}

fn recv_a(m: usize, peer: usize) -> Action {
    Action::RecvActivation {
        peer,
        microbatch: m,
        chunk: 0,
    }
}

fn send_g(m: usize, peer: usize) -> Action {
    Action::SendGradient {
        peer,
        microbatch: m,
        chunk: 0,
    }
}

fn recv_g(m: usize, peer: usize) -> Action {
    Action::RecvGradient {
        peer,
        microbatch: m,
        chunk: 0,
    }
}

fn custom(microbatches: usize, ranks: Vec<Vec<Action>>) -> Schedule {
    Schedule {
        kind: ScheduleKind::Custom,
        stages: ranks.len(),
        microbatches,
        chunks: 1,
        ranks,
    }
}

#[test]
fn crossing_transfers_in_one_group_do_not_deadlock() {
    // Rank 0 sends microbatch 1's activation while rank 1 sends microbatch 0's gradient back:
    // one by one, each rank's rendezvous send waits for the other's, a deadlock; as one group
    // (post both, wait for the receive, then the send) both go through. Same result as 1F1B.
    let s = custom(
        MICRO,
        vec![
            vec![
                fwd(0),
                send_a(0, 1),
                fwd(1),
                send_a(1, 1),
                recv_g(0, 1),
                bwd(0),
                fwd(2),
                send_a(2, 1),
                recv_g(1, 1),
                bwd(1),
                fwd(3),
                send_a(3, 1),
                recv_g(2, 1),
                bwd(2),
                recv_g(3, 1),
                bwd(3),
            ],
            vec![
                recv_a(0, 0),
                fwd(0),
                bwd(0),
                send_g(0, 0),
                recv_a(1, 0),
                fwd(1),
                bwd(1),
                send_g(1, 0),
                recv_a(2, 0),
                fwd(2),
                bwd(2),
                send_g(2, 0),
                recv_a(3, 0),
                fwd(3),
                bwd(3),
                send_g(3, 0),
            ],
        ],
    );
    assert_close(
        "pp=2 custom, crossing transfers",
        &pipeline_run(&GptModel, &s),
        gpt_single_device(),
        TOL,
    );
}

#[test]
fn a_deadlocking_schedule_fails_naming_ranks_and_actions() {
    // Rank 0 waits for the gradient before it runs the forward whose activation rank 1 waits
    // for: under rendezvous sends nothing moves; each rank fails after the timeout.
    let s = custom(
        1,
        vec![
            vec![recv_g(0, 1), fwd(0), send_a(0, 1), bwd(0)],
            vec![recv_a(0, 0), fwd(0), bwd(0), send_g(0, 0)],
        ],
    );
    let opts = RunOptions::with_timeout(Duration::from_millis(500)).rendezvous();
    let start = Instant::now();
    let results = run_ranks_each(2, &opts, |ctx| {
        let rank = ctx.comm.rank();
        let stages = chunks(&GptModel, &s, rank)?;
        let mbs = vec![Microbatch {
            first_row: 0,
            batch: gpt_batch(0, 0..2)?,
        }];
        execute(&stages, &s, ctx.comm.as_ref(), &mbs, 0, None)
    })
    .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "a hang, not an error"
    );
    let e0 = results[0].as_ref().unwrap_err().to_string();
    let e1 = results[1].as_ref().unwrap_err().to_string();
    println!("rank 0: {e0}\nrank 1: {e1}");
    assert!(
        e0.starts_with(
            "pipeline rank 0: transfer group [recv gradient(mb 0, chunk 0) from rank 1]: recv \
             gradient(mb 0, chunk 0) from rank 1: "
        ),
        "{e0}"
    );
    assert!(
        e1.starts_with(
            "pipeline rank 1: transfer group [recv activation(mb 0, chunk 0) from rank 0]: recv \
             activation(mb 0, chunk 0) from rank 0: "
        ),
        "{e1}"
    );
    for e in [&e0, &e1] {
        assert!(!e.contains('\n'), "{e}");
    }
    // At least the first rank to give up names the timeout (its peer may see that failure).
    assert!(
        e0.contains("did not send within") || e1.contains("did not send within"),
        "{e0} / {e1}"
    );
}

#[test]
fn bad_schedules_and_chunks_are_one_line_errors() {
    let opts = RunOptions::with_timeout(Duration::from_secs(20));
    let run = |s: &Schedule, n_chunks: usize| -> Vec<String> {
        run_ranks_each(s.stages, &opts, |ctx| {
            let rank = ctx.comm.rank();
            let specs = StageSpec::even(gpt_config().n_layer, s.stages * n_chunks)?;
            let stages: Vec<Gpt> = (0..n_chunks)
                .map(|c| GptModel.stage(specs[c * s.stages + rank].clone()))
                .collect::<Result<_>>()?;
            execute(
                &stages,
                s,
                ctx.comm.as_ref(),
                &microbatches(&GptModel, 0)?,
                0,
                None,
            )
        })
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap_err().to_string())
        .collect()
    };
    // An interleaved schedule given one chunk per rank.
    let s = Schedule::interleaved(2, MICRO, 2).unwrap();
    for e in run(&s, 1) {
        assert!(
            e.contains("runs 2 chunks per rank but pipeline rank"),
            "{e}"
        );
    }
    // A transfer to the wrong rank.
    let mut s = Schedule::one_f_one_b(2, MICRO).unwrap();
    s.ranks[0][1] = Action::SendActivation {
        peer: 0,
        microbatch: 0,
        chunk: 0,
    };
    for e in run(&s, 1) {
        assert!(
            e.starts_with(
                "pipeline executor: rank 0's action send activation(mb 0, chunk 0) to \
                           rank 0: virtual stage 1 is on rank 1"
            ),
            "{e}"
        );
    }
    // A split backward without its weight half.
    let mut s = Schedule::zero_bubble(2, MICRO).unwrap();
    s.ranks[1].retain(|a| !matches!(a, Action::BackwardWeight { microbatch: 3, .. }));
    let errs = run(&s, 1);
    assert!(
        errs[1].contains("pipeline rank 1: the schedule ran no backward-weight of microbatch 3"),
        "{}",
        errs[1]
    );
    for e in errs {
        assert!(!e.contains('\n'), "{e}");
    }
}
