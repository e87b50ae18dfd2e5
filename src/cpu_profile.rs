//! The per-layer profile behind `--device-kind cpu`: forward + backward of every block, the
//! embedding and the head of the model kind's recipe on one microbatch (`profile_layers`, one
//! rank on all the cores), each divided by the cost model's prediction on the one-rank
//! calibrated CPU, as the cluster's `ComputeScale`. The calibration prices only matmuls and
//! memory traffic; the profile brings in what else the layers run (norms, softmax, attention's
//! loops, autograd), while the cost model's shapes still scale the time under every layout.
//! Cached beside the calibration under the machine's identity and a hash of the model config,
//! rows and precision; a model too large to profile in half the memory keeps scale 1.

use std::hash::{Hash, Hasher};

use anyhow::{Context, Result};
use meshgrad_nn::StageSpec;
use meshgrad_parallel::pipeline::partition::ModelCosts;
use meshgrad_parallel::pipeline::{profile_layers, ProfileOptions};
use meshgrad_parallel::plan::calibrate;
use meshgrad_parallel::plan::compute::{Attention, ComputeScale, MicroBatch};
use meshgrad_parallel::plan::memory::{num_parameters, Precision};

use crate::config::TrainConfig;
use crate::recipe::{Recipe, StageBuild};
use crate::train::{with_recipe, RecipeJob};

/// Profiles the layers of the model kind's recipe on one microbatch of `rows` rows.
struct ProfileJob<'a> {
    cfg: &'a TrainConfig,
    rows: usize,
}

impl RecipeJob for ProfileJob<'_> {
    type Output = ModelCosts;

    fn run<R: Recipe>(self) -> Result<ModelCosts> {
        let (cfg, tokenizer) = crate::run_setup::resolve_tokenizer(self.cfg)?;
        let data = crate::run_setup::run_data(&cfg, tokenizer)?;
        let recipe = R::new(cfg, data)?;
        let batch = recipe.profile_batch(self.rows)?;
        let build = |spec: StageSpec| {
            recipe
                .build_stage(StageBuild::plain(spec))
                .map_err(|e| meshgrad_tensor::Error::msg(format!("{e:#}")))
        };
        profile_layers(recipe.n_blocks(), build, &batch, &ProfileOptions::default())
            .with_context(|| format!("profiling the {}'s layers for the planner", R::NAME))
    }
}

/// The measured over modelled compute of `cfg`'s model on this machine for microbatches of
/// `rows` rows (see the [module docs](self)), from the cache when it holds it.
pub(crate) fn compute_scale(cfg: &TrainConfig, rows: usize) -> Result<ComputeScale> {
    let shape = crate::model_configs::model_shape(cfg);
    let precision = Precision::parse(&cfg.train.precision).unwrap_or_default();
    let params = num_parameters(&shape).unwrap_or(u64::MAX);
    let room = crate::preflight::memory_for_check().map_or(u64::MAX, |m| m.bytes / 2);
    // Parameters, gradients, AdamW's two moments, and the profile's extra blocks: 5 copies.
    if params.saturating_mul(5 * 4) > room {
        return Ok(ComputeScale::default());
    }
    let mut key = std::collections::hash_map::DefaultHasher::new();
    (toml::to_string(&cfg.model)?, rows, &cfg.train.precision).hash(&mut key);
    let file = calibrate::cache_path(&format!(
        "profile-{}-{:016x}.toml",
        calibrate::machine_id(),
        key.finish()
    ));
    if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        if let Some(scale) = parse(&text) {
            return Ok(scale);
        }
    }
    let costs = with_recipe(cfg.model.kind, ProfileJob { cfg, rows })?;
    let device = calibrate::cpu_device(1).map_err(|e| anyhow::anyhow!(e.0))?;
    let peak = device
        .peak_flops(precision)
        .map_err(|e| anyhow::anyhow!(e.0))?;
    let mb = MicroBatch {
        model: &shape,
        device: &device,
        precision,
        attention: Attention::Fused,
        rows,
        tp: 1,
        sequence_parallel: false,
        cp: 1,
    };
    let blocks = costs.blocks();
    let block_ms = blocks.iter().map(|l| l.time_ms).sum::<f64>() / blocks.len() as f64;
    let layers = costs.layers();
    let edge_ms = |on: bool, i: usize| if on { layers[i].time_ms } else { 0.0 };
    let embedding_ms = edge_ms(costs.has_embedding(), 0);
    let head_ms = edge_ms(costs.has_head(), layers.len() - 1);
    let scale = ComputeScale::measured(block_ms, embedding_ms, head_ms, &mb, peak);
    if let Some(f) = &file {
        let text = format!(
            "# measured over modelled compute, meshgrad's per-layer profile\nblock = {}\n\
             embedding = {}\nhead = {}\n",
            scale.block, scale.embedding, scale.head
        );
        calibrate::write_cache(f, &text);
    }
    Ok(scale)
}

/// A cached scale (`None` when the file is not one, so it is measured again).
fn parse(text: &str) -> Option<ComputeScale> {
    let table: toml::Table = text.parse().ok()?;
    let get = |k: &str| {
        table
            .get(k)?
            .as_float()
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    Some(ComputeScale {
        block: get("block")?,
        embedding: get("embedding")?,
        head: get("head")?,
    })
}

/// The scale as the line `meshgrad plan` and `train --dry-run` print before their plan.
pub(crate) fn line(s: &ComputeScale) -> String {
    format!(
        "cpu_profile: measured/modelled compute block={:.2} embedding={:.2} head={:.2}",
        s.block, s.embedding, s.head
    )
}
