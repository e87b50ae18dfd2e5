//! `meshgrad plan`: the model from `--model` and `--set` (as for `train`) or a Hugging Face
//! `config.json`; the rest is [`meshgrad_parallel::plan`]'s (devices, costs, search, report).

use std::path::PathBuf;

use anyhow::Result;
use meshgrad_nn::ModelShape;
use meshgrad_parallel::layout::ParallelLayout;
use meshgrad_parallel::pipeline::ScheduleKind;
use meshgrad_parallel::plan::bubble::BubbleCache;
use meshgrad_parallel::plan::cost::CpMode;
use meshgrad_parallel::plan::cost::{Candidate, Cluster, CostModel, Workload};
use meshgrad_parallel::plan::device::DeviceKind;
use meshgrad_parallel::plan::memory::Precision;
use meshgrad_parallel::plan::search::{self, SearchOptions};
use meshgrad_parallel::plan::{calibrate, hf, report};

use crate::config::TrainConfig;
use crate::run_setup::{ActivationCheckpointing, TrainOptions};

/// `meshgrad plan`'s arguments (see `meshgrad plan --help`).
#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// gpt, bert, llama or mixtral (sets model.kind; the rest of the model from --set).
    #[arg(long, default_value = "gpt", value_parser = ["gpt", "bert", "llama", "mixtral"])]
    pub model: String,
    /// A Hugging Face config.json (GPT-2, BERT, Llama, Mixtral) instead of --model and --set;
    /// its dropout probabilities count as set there (GPT-2's and BERT's 0.1 by default).
    #[arg(long, value_name = "FILE")]
    pub hf_config: Option<PathBuf>,
    /// Any model key, e.g. --set model.n_layer=24 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Devices in all.
    #[arg(long)]
    pub devices: usize,
    /// Devices per node (default: the device kind's).
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// h100, h200, a100-80gb, a100-40gb, cpu (this machine, calibrated and the model's layers
    /// profiled; cached in ~/.cache/meshgrad) or a FILE.toml.
    #[arg(long)]
    pub device_kind: String,
    /// Rows per optimizer step.
    #[arg(long)]
    pub global_batch: usize,
    /// Tokens per row (the context length).
    #[arg(long)]
    pub seq: usize,
    /// f32, bf16 or fp8.
    #[arg(long, default_value = "bf16", value_parser = ["f32", "bf16", "fp8"])]
    pub precision: String,
    /// Evaluate this layout only (e.g. dp=2,tp=2,pp=2) instead of searching.
    #[arg(long, value_name = "SPEC")]
    pub layout: Option<String>,
    /// With --layout: sequence parallelism.
    #[arg(long, requires = "layout")]
    pub sequence_parallel: bool,
    /// With --layout: ring attention (ring) or an all-gather of the keys and values
    /// (allgather) under cp.
    #[arg(long, requires = "layout", default_value = "ring", value_parser = ["ring", "allgather"])]
    pub cp_mode: String,
    /// With --layout: gpipe, 1f1b, interleaved or zb.
    #[arg(long, requires = "layout", value_parser = ["gpipe", "1f1b", "interleaved", "zb"])]
    pub schedule: Option<String>,
    /// With --layout: chunks per pipeline rank (interleaved; default 2).
    #[arg(long, requires = "layout")]
    pub chunks: Option<usize>,
    /// With --layout: rows per micro-batch (default 1).
    #[arg(long, requires = "layout")]
    pub microbatch_size: Option<usize>,
    /// With --layout: none or all.
    #[arg(long, requires = "layout", default_value = "none", value_parser = ["none", "all"])]
    pub activation_checkpointing: String,
    /// Layouts to list.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
    /// JSON instead of the table (the plan line still ends the output).
    #[arg(long)]
    pub json: bool,
}

/// The model's shape with `seq` positions, and its config when it comes from `--model` and
/// `--set` (the per-layer profile of `--device-kind cpu` builds the model from it).
fn model_shape(a: &PlanArgs) -> Result<(ModelShape, Option<TrainConfig>)> {
    if let Some(path) = &a.hf_config {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--hf-config {}: {e}", path.display()))?;
        let shape = hf::shape_from_config(&text, &path.display().to_string(), a.seq)
            .map_err(anyhow::Error::msg)?;
        return Ok((shape, None));
    }
    let mut cfg = TrainConfig::default();
    cfg.apply_override("model.kind", &a.model)?;
    cfg.apply_override("model.block_size", &a.seq.to_string())?;
    for s in &a.set {
        cfg.apply_assignment(s)?;
    }
    if a.precision != "fp8" {
        cfg.train.precision = a.precision.clone();
    }
    let mut shape = crate::model_configs::model_shape(&cfg);
    shape.positions = a.seq;
    Ok((shape, Some(cfg)))
}

/// The cluster: `--devices` of `--device-kind` in nodes of `--devices-per-node`; on `cpu`,
/// with the per-layer profile of the model `cfg` (when known) at one row per micro-batch.
fn cluster(a: &PlanArgs, cfg: Option<&TrainConfig>) -> Result<Cluster> {
    let cpu = a.device_kind == "cpu";
    let device = if cpu {
        calibrate::cpu_device(a.devices)?
    } else {
        DeviceKind::resolve(&a.device_kind)?
    };
    let mut cluster =
        Cluster::new(device, a.devices, a.devices_per_node, cpu).map_err(anyhow::Error::msg)?;
    if let (true, Some(cfg)) = (cpu, cfg) {
        cluster.compute_scale = crate::cpu_profile::compute_scale(cfg, 1)?;
        // Beside the table; with --json on stderr, so that stdout stays JSON and the plan line.
        let line = crate::cpu_profile::line(&cluster.compute_scale);
        match a.json {
            true => eprintln!("{line}"),
            false => println!("{line}"),
        }
    }
    Ok(cluster)
}

/// The candidate `--layout` and its options describe.
fn fixed(a: &PlanArgs, spec: &str) -> Result<Candidate> {
    let layout = spec.parse().map_err(|e| anyhow::anyhow!("--layout: {e}"))?;
    let schedule: ScheduleKind = a.schedule.as_deref().unwrap_or("1f1b").parse().unwrap();
    let interleaved = schedule == ScheduleKind::Interleaved;
    Ok(Candidate {
        layout,
        sequence_parallel: a.sequence_parallel,
        cp_mode: CpMode::parse(&a.cp_mode)?,
        schedule,
        chunks: a.chunks.unwrap_or(if interleaved { 2 } else { 1 }),
        microbatch_size: a.microbatch_size.unwrap_or(1),
        recompute: a.activation_checkpointing == "all",
    })
}

/// Runs `meshgrad plan`: a table (or JSON), then the plan line.
pub fn run(a: &PlanArgs) -> Result<()> {
    let (shape, cfg) = model_shape(a)?;
    let workload = Workload {
        model: shape,
        global_batch: a.global_batch,
        precision: Precision::parse(&a.precision).expect("clap checked it"),
        attention: Default::default(),
        retention: Default::default(),
    };
    let cluster = cluster(a, cfg.as_ref())?;
    let model = CostModel {
        workload: &workload,
        cluster: &cluster,
    };
    let rows = match &a.layout {
        Some(spec) => vec![model
            .estimate(&fixed(a, spec)?, &mut BubbleCache::new())
            .map_err(anyhow::Error::msg)?],
        None => search::plan(&model, &SearchOptions::top(a.top)).map_err(anyhow::Error::msg)?,
    };
    let json = serde_json::to_string_pretty(&report::plan_json(&rows))?;
    print!(
        "{}",
        if a.json {
            json + "\n"
        } else {
            report::table(&rows)
        }
    );
    println!("{}", report::plan_line(&rows[0]));
    Ok(())
}

/// `meshgrad train ... --dry-run`: prints the predicted memory per rank in MiB
/// (`predicted_memory_per_rank_mib=`) and the plan line of the run `cfg` (resolved and checked)
/// would make on `layout` with `opts` on this machine (the calibrated CPU, with the memory the
/// preflight check compares with), then returns the preflight check's verdict: its one-line
/// error when the run does not fit. Both use the same estimate and the same memory, so the line's
/// `fits=` and the check agree.
pub fn dry_run(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
    over_tcp: bool,
) -> Result<()> {
    if cfg.train.device != "cpu" {
        anyhow::bail!(
            "--dry-run plans a run on this machine's CPU (train.device = {:?}); for GPUs use \
             meshgrad plan --device-kind h100|h200|a100-80gb|a100-40gb|FILE.toml",
            cfg.train.device
        );
    }
    if cfg.train.reference {
        anyhow::bail!("--dry-run: the planner does not model reference mode (--reference)");
    }
    let layout = layout.copied().unwrap_or_default();
    let schedule = match layout.pp() {
        1 => ScheduleKind::OneFOneB,
        _ => opts.pipeline.schedule,
    };
    let interleaved = schedule == ScheduleKind::Interleaved;
    let candidate = Candidate {
        layout,
        sequence_parallel: opts.sequence_parallel,
        cp_mode: opts.cp_mode,
        schedule,
        chunks: opts
            .pipeline
            .chunks
            .unwrap_or(if interleaved { 2 } else { 1 }),
        microbatch_size: cfg.train.batch_size / (layout.data_parallel_degree() * opts.microbatches),
        recompute: opts.activation_checkpointing == ActivationCheckpointing::All,
    };
    let workload = Workload {
        model: crate::model_configs::model_shape(cfg),
        global_batch: cfg.train.batch_size,
        precision: Precision::parse(&cfg.train.precision).unwrap_or_default(),
        attention: Default::default(),
        retention: Default::default(),
    };
    let mut device = calibrate::cpu_device(layout.world_size())?;
    if over_tcp {
        device = device.over_tcp()?;
    }
    let available = crate::preflight::memory_for_check();
    if let Some(a) = available {
        device.memory_gib = a.bytes as f64 / (1u64 << 30) as f64;
    }
    let mut cluster =
        Cluster::new(device, layout.world_size(), None, true).map_err(anyhow::Error::msg)?;
    cluster.compute_scale = crate::cpu_profile::compute_scale(cfg, candidate.microbatch_size)?;
    println!("{}", crate::cpu_profile::line(&cluster.compute_scale));
    let model = CostModel {
        workload: &workload,
        cluster: &cluster,
    };
    let estimate = model
        .estimate(&candidate, &mut BubbleCache::new())
        .map_err(anyhow::Error::msg)?;
    // The plan line's memory to the MiB, to set beside a run's `peak_memory_per_rank_mib=`.
    println!(
        "predicted_memory_per_rank_mib={:.1}",
        estimate.memory.per_rank as f64 / (1u64 << 20) as f64
    );
    println!("{}", report::plan_line(&estimate));
    crate::preflight::check_memory_against(
        &estimate.memory,
        available,
        "this run",
        crate::preflight::TRAIN_MEMORY_HINT,
    )
}
