//! Checks before work: `meshgrad train` makes sure that its output can be written and that the
//! run fits in memory before it reads data or builds a model; `eval` and `generate` check a
//! checkpoint's sizes against memory before they build its model. Each failure is one line.
//!
//! **Output.** [`check_output`] creates the `out` directory (and the metrics file's directory),
//! writes a probe file there and removes it; an existing metrics file must be a writable file.
//!
//! **Memory.** [`estimate_run`] gives the bytes a run needs, per rank and in all, from the
//! config and the layout alone (the formulas are [`meshgrad_parallel::plan::memory`]'s), and
//! [`check_memory`] compares the total over the ranks of this process (they are threads of one
//! process) with the memory the machine has available ([`available_memory`]: `MemAvailable` in
//! `/proc/meminfo`, lowered to a cgroup v2 limit when there is one; the comparison is skipped
//! where neither can be read, e.g. off Linux). Sizes whose products do not fit in 64 bits are
//! refused as needing more than 16 EiB, whatever the machine. `MESHGRAD_NO_MEMORY_CHECK=1` skips
//! the comparison with the machine (for a run the estimate wrongly refuses), not the overflow
//! check.
//!
//! For `eval` and `generate`, [`check_checkpoint`] reads a final model's `config.json` (and
//! [`check_model_memory`] takes a training checkpoint's config) and estimates its parameters
//! and the activations of one forward pass without gradients over [`INFERENCE_ROWS`] windows.

use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_nn::state::{hf_bert, hf_gpt2, hf_llama, hf_mixtral};
use meshgrad_nn::ModelShape;
use meshgrad_parallel::plan::memory::{
    estimate_inference, estimate_training, human, MemoryEstimate, Precision, TrainingRun,
};
use meshgrad_parallel::ParallelLayout;

use crate::config::TrainConfig;
use crate::run_setup::{ActivationCheckpointing, TrainOptions};

/// The environment variable that, set to anything but `0` or nothing, skips the comparison of
/// the memory estimate with the machine's available memory.
pub const SKIP_MEMORY_CHECK: &str = "MESHGRAD_NO_MEMORY_CHECK";

/// Rows of one forward pass that [`check_checkpoint`] assumes (`eval` evaluates 8 windows at a
/// time; `generate` runs one sequence).
pub const INFERENCE_ROWS: u64 = 8;

/// The memory a training run of `cfg` (resolved: its vocabulary is the tokenizer's) needs on
/// `layout` (one device when `None`) with `opts` (micro-batches, sequence parallelism, pipeline
/// schedule, activation checkpointing): [`estimate_training`] of the run.
pub fn estimate_run(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> MemoryEstimate {
    let one = ParallelLayout::default();
    estimate_training(&TrainingRun {
        model: crate::model_configs::model_shape(cfg),
        layout: layout.unwrap_or(&one),
        batch_size: cfg.train.batch_size,
        microbatches: opts.microbatches,
        schedule: opts.pipeline.schedule,
        sequence_parallel: opts.sequence_parallel,
        cp_mode: opts.cp_mode,
        checkpoint_blocks: matches!(opts.activation_checkpointing, ActivationCheckpointing::All),
        reference_row_group: cfg.train.reference.then_some(cfg.train.row_group),
        precision: Precision::parse(&cfg.train.precision).unwrap_or_default(),
        retention: Default::default(),
    })
}

/// Memory the machine can give this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    /// Bytes.
    pub bytes: u64,
    /// Where the figure comes from, for messages.
    pub source: &'static str,
}

/// The memory available to this process: `MemAvailable` in `/proc/meminfo`, or what is left
/// under the cgroup v2 limit (`/sys/fs/cgroup/memory.max` less `memory.current`) when that is
/// smaller. `None` where neither can be read.
pub fn available_memory() -> Option<Available> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| parse_meminfo(&t))
        .map(|bytes| Available {
            bytes,
            source: "MemAvailable in /proc/meminfo",
        });
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(current)) => {
            match (max.trim().parse::<u64>(), current.trim().parse::<u64>()) {
                (Ok(max), Ok(current)) => Some(Available {
                    bytes: max.saturating_sub(current),
                    source: "the cgroup limit in /sys/fs/cgroup/memory.max",
                }),
                _ => None,
            }
        }
        _ => None,
    };
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(if b.bytes < a.bytes { b } else { a }),
        (a, b) => a.or(b),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    let scale = match parts.next() {
        Some("kB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    value.checked_mul(scale)
}

/// Whether [`SKIP_MEMORY_CHECK`] is set.
fn skip_memory_check() -> bool {
    std::env::var_os(SKIP_MEMORY_CHECK).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Refuses `estimate` when it is above `available` (or overflowed), with one line naming both
/// figures; `what` says what needs the memory ("this run", "checkpoint DIR"), `hint` how to need
/// less (may be empty).
pub fn check_memory_against(
    estimate: &MemoryEstimate,
    available: Option<Available>,
    what: &str,
    hint: &str,
) -> Result<()> {
    let too_much = match available {
        _ if estimate.overflowed() => true,
        Some(a) => estimate.total > a.bytes,
        None => false,
    };
    if !too_much {
        return Ok(());
    }
    let have = match available {
        Some(a) => format!("only {} is available ({})", human(a.bytes), a.source),
        None => "no machine has that much".to_string(),
    };
    anyhow::bail!(
        "not enough memory for {what}: it needs {estimate} but {have}; {hint}set \
         {SKIP_MEMORY_CHECK}=1 to skip this check"
    )
}

/// [`check_memory_against`] the machine's [`available_memory`]; the comparison is skipped (an
/// overflow is still refused) when [`SKIP_MEMORY_CHECK`] is set or the memory cannot be read.
pub fn check_memory(estimate: &MemoryEstimate, what: &str, hint: &str) -> Result<()> {
    check_memory_against(estimate, memory_for_check(), what, hint)
}

/// The memory [`check_memory`] compares with: [`available_memory`], or `None` when
/// [`SKIP_MEMORY_CHECK`] is set.
pub fn memory_for_check() -> Option<Available> {
    if skip_memory_check() {
        None
    } else {
        available_memory()
    }
}

/// How a training run that does not fit can need less (the start of [`check_memory`]'s hint).
pub const TRAIN_MEMORY_HINT: &str = "use a smaller model or batch, more --microbatches, \
     --activation-checkpointing all or a sharded --layout, or ";

/// Creates `dir` (with its parents) and writes and removes a probe file in it; `what` names the
/// directory and `keys` the settings that give it, in the error.
fn check_writable_dir(dir: &Path, what: &str, keys: &str) -> Result<()> {
    let shown = dir.display();
    std::fs::create_dir_all(dir)
        .with_context(|| format!("cannot create the {what} directory {shown} ({keys})"))?;
    let probe = dir.join(format!(".meshgrad-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"meshgrad")
        .with_context(|| format!("the {what} directory {shown} ({keys}) is not writable"))?;
    std::fs::remove_file(&probe)
        .with_context(|| format!("cannot remove {} after writing it", probe.display()))?;
    Ok(())
}

/// Checks that the run's outputs can be written, before any work: the `out` directory is
/// created and a probe file written and removed in it; the metrics file's directory likewise,
/// and an existing metrics file must be a file that can be opened for writing (it is not
/// modified here). Errors are one line naming the path.
pub fn check_output(cfg: &TrainConfig) -> Result<()> {
    check_writable_dir(Path::new(&cfg.out), "output", "out, --out")?;
    if let Some(m) = &cfg.metrics {
        let path = Path::new(m);
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        check_writable_dir(dir, "metrics file's", "metrics, --metrics")?;
        if path.is_dir() {
            anyhow::bail!("the metrics file {m} (metrics, --metrics) is a directory");
        }
        if path.exists() {
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .with_context(|| format!("cannot write the metrics file {m}"))?;
        }
    }
    Ok(())
}

/// Checks, before any work, that the file `path` (`what`, given by `flag`) can be written when
/// the run ends: its directory is created and a probe file written and removed in it, and the
/// path is not a directory. The file itself is not touched.
pub fn check_file_writable(path: &Path, what: &str, flag: &str) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    check_writable_dir(dir, &format!("{what}'s"), flag)?;
    if path.is_dir() {
        anyhow::bail!("the {what} {} ({flag}) is a directory", path.display());
    }
    Ok(())
}

/// Every check before a training run's work: [`check_output`], the `--trace` file
/// ([`check_file_writable`]), then the memory the run needs
/// ([`estimate_run`]) against the machine's ([`check_memory`]). `cfg` is the resolved
/// config (validated, its vocabulary the tokenizer's).
pub fn check_train(
    cfg: &TrainConfig,
    layout: Option<&ParallelLayout>,
    opts: &TrainOptions,
) -> Result<()> {
    check_output(cfg)?;
    if let Some(trace) = &opts.pipeline.trace {
        check_file_writable(trace, "trace file", "--trace")?;
    }
    check_memory(
        &estimate_run(cfg, layout, opts),
        "this run",
        TRAIN_MEMORY_HINT,
    )
}

/// Checks the model a checkpoint's `config.json` describes against memory before it is built
/// (for `eval` and `generate`): [`estimate_inference`] over [`INFERENCE_ROWS`] rows. A missing
/// or invalid config is left to the loader, which reports it.
pub fn check_checkpoint(dir: &Path) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return Ok(());
    };
    let shape = if hf_bert::is_bert_checkpoint(dir) {
        match hf_bert::bert_config_from_hf_json(&text) {
            Ok(c) => c.shape(),
            Err(_) => return Ok(()),
        }
    } else if hf_llama::is_llama_folder(dir) || hf_mixtral::is_mixtral_folder(dir) {
        match hf_llama::llama_config_from_hf_json(&text) {
            Ok(c) => c.shape(),
            Err(_) => return Ok(()),
        }
    } else {
        match hf_gpt2::gpt_config_from_hf_json(&text) {
            Ok((c, _)) => c.shape(),
            Err(_) => return Ok(()),
        }
    };
    check_model_memory(&shape, &format!("checkpoint {}", dir.display()))
}

/// Checks the model `shape` describes against memory before it is built for `eval` or
/// `generate`: [`estimate_inference`] over [`INFERENCE_ROWS`] rows; `what` names it in the error
/// (`"checkpoint DIR"`).
pub fn check_model_memory(shape: &ModelShape, what: &str) -> Result<()> {
    check_memory(&estimate_inference(shape, INFERENCE_ROWS), what, "")
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_parallel::plan::memory::num_parameters;

    fn gib(x: u64) -> Available {
        Available {
            bytes: x << 30,
            source: "test",
        }
    }

    #[test]
    fn layouts_divide_the_model_states() {
        let cfg = TrainConfig::default();
        let opts = TrainOptions::default();
        let one = estimate_run(&cfg, None, &opts);
        let p = num_parameters(&crate::model_configs::model_shape(&cfg)).unwrap() * 4;
        assert_eq!((one.params, one.grads, one.optimizer), (p, 2 * p, 2 * p));
        assert_eq!(one.total, one.per_rank);
        assert!(!one.overflowed());
        let est = |spec: &str| estimate_run(&cfg, Some(&spec.parse().unwrap()), &opts);
        // Data parallelism: the same model states on every rank, half the rows each.
        let dp = est("dp=2");
        assert_eq!((dp.params, dp.optimizer), (one.params, one.optimizer));
        assert!(dp.activations < one.activations);
        assert_eq!(dp.total, 2 * dp.per_rank);
        // ZeRO-1 shards the moments; ZeRO-2 the gradients too; ZeRO-3 everything.
        let z1 = est("zero1=2");
        assert_eq!(z1.optimizer, one.optimizer.div_ceil(2));
        assert_eq!(z1.grads, one.grads);
        let z2 = est("zero2=2");
        assert!(z2.grads < one.grads / 2, "{z2:?}");
        assert_eq!(z2.optimizer, one.optimizer.div_ceil(2));
        let z3 = est("fsdp=4");
        assert!(z3.params < one.params / 2, "{z3:?}");
        // Tensor parallelism splits most parameters; rank 0 gathers the model at the end.
        let tp = est("tp=2");
        assert!(
            tp.params < one.params && tp.params > one.params / 2,
            "{tp:?}"
        );
        assert_eq!(tp.gather, p);
        // Pipeline stages hold fewer blocks.
        let pp = est("pp=2");
        assert!(pp.params < one.params, "{pp:?}");
        // Micro-batches and activation checkpointing lower the activations.
        let micro = estimate_run(
            &cfg,
            None,
            &TrainOptions {
                microbatches: 4,
                ..TrainOptions::default()
            },
        );
        assert!(micro.activations < one.activations / 3);
        let ckpt = estimate_run(
            &cfg,
            None,
            &TrainOptions {
                activation_checkpointing: ActivationCheckpointing::All,
                ..TrainOptions::default()
            },
        );
        assert!(ckpt.activations < one.activations);
    }

    #[test]
    fn reference_mode_counts_its_tree_and_one_row_group_of_activations() {
        let opts = TrainOptions::default();
        let mut cfg = TrainConfig::default();
        let p = num_parameters(&crate::model_configs::model_shape(&cfg)).unwrap() * 4;
        let fast = estimate_run(&cfg, None, &opts);
        cfg.train.reference = true;
        // 16 row groups of 1 sequence on one device: 5 tree levels, one contribution.
        let one = estimate_run(&cfg, None, &opts);
        assert_eq!(one.grads, fast.grads + 5 * p + p);
        assert_eq!(one.activations * 16, fast.activations);
        // dp=4: 4 row groups per rank (3 levels), 4 contributions per reduction.
        let dp4 = estimate_run(&cfg, Some(&"dp=4".parse().unwrap()), &opts);
        assert_eq!(dp4.grads, fast.grads + 3 * p + 4 * p);
        assert_eq!(dp4.activations * 16, fast.activations);
    }

    #[test]
    fn huge_sizes_are_refused_and_overflow_is_sticky() {
        let opts = TrainOptions::default();
        let mut cfg = TrainConfig::default();
        // The default run fits in 1 GiB.
        let est = estimate_run(&cfg, None, &opts);
        check_memory_against(&est, Some(gib(1)), "this run", "").unwrap();
        // A width of a million: tens of TiB of parameters.
        cfg.model.n_embd = 1_000_000;
        let est = estimate_run(&cfg, None, &opts);
        assert!(est.params > 1 << 40, "{est:?}");
        let msg = check_memory_against(&est, Some(gib(64)), "this run", "")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not enough memory for this run"), "{msg}");
        assert!(msg.contains("TiB") && msg.contains("only 64.0 GiB is available (test)"));
        assert!(!msg.contains('\n'), "{msg}");
        // Without a reading of the machine, a run that merely looks big passes...
        check_memory_against(&est, None, "this run", "").unwrap();
        // ...but one whose sizes overflow 64 bits never does.
        cfg.model.n_layer = usize::MAX / 2;
        let est = estimate_run(&cfg, None, &opts);
        assert!(est.overflowed());
        let msg = check_memory_against(&est, None, "this run", "")
            .unwrap_err()
            .to_string();
        assert!(msg.contains("more than 16 EiB"), "{msg}");
        let mut cfg = TrainConfig::default();
        cfg.train.batch_size = usize::MAX;
        assert!(estimate_run(&cfg, None, &opts).overflowed());
        // An overflow stays one through the divisions of sharding and tensor parallelism.
        let mut cfg = TrainConfig::default();
        cfg.model.n_embd = 1 << 33;
        for spec in ["fsdp=4", "tp=4", "pp=4", "hsdp=2x2,tp=2"] {
            let layout: ParallelLayout = spec.parse().unwrap();
            let est = estimate_run(&cfg, Some(&layout), &opts);
            assert!(est.overflowed(), "{spec}: {est:?}");
            assert_eq!(est.params, u64::MAX, "{spec}");
        }
    }

    #[test]
    fn meminfo_and_units() {
        let text = "MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   23263700 kB\n";
        assert_eq!(parse_meminfo(text), Some(23263700 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn inference_estimate_counts_the_checkpoint() {
        let cfg = TrainConfig::default();
        let shape = crate::model_configs::gpt_config(&cfg).shape();
        let est = estimate_inference(&shape, INFERENCE_ROWS);
        assert_eq!(est.params, num_parameters(&shape).unwrap() * 4);
        assert_eq!(est.grads + est.optimizer, 0);
        assert!(est.activations > 0 && est.total == est.params + est.activations);
    }
}
