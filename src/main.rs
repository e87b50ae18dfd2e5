//! The `meshgrad` command line: train, evaluate and sample GPT models.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};
use meshgrad::config::TrainConfig;
use meshgrad::train::Verbosity;

#[derive(Parser)]
#[command(
    name = "meshgrad",
    version,
    about = "Train, evaluate and sample GPT models with meshgrad"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time the GPT training step on random tokens; prints `params=... step_median_s=...
    /// tokens_per_s=... gflops=... peak_bytes=...` last (see benches/README.md).
    Bench {
        /// tiny-gpt or small-gpt.
        #[arg(long, default_value = "tiny-gpt")]
        model: String,
        /// Timed steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Rayon threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Print a per-op time breakdown and the sgemm ceiling.
        #[arg(long)]
        profile: bool,
    },
    /// Train a GPT (by default a small byte-level model on the built-in corpus, on CPU).
    Train(TrainArgs),
    /// Mean next-token cross-entropy of a checkpoint over a token file; prints `loss=<value>`.
    Eval {
        /// Checkpoint directory (config.json + model.safetensors).
        #[arg(long)]
        checkpoint: PathBuf,
        /// Token file: .bin (u16 ids) or text (bytes).
        #[arg(long)]
        data: PathBuf,
    },
    /// Continue a prompt with a checkpoint.
    Generate {
        /// Checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Prompt text (byte-level tokens).
        #[arg(long)]
        prompt: Option<String>,
        /// Prompt as token ids, e.g. "12,7,99".
        #[arg(long)]
        prompt_tokens: Option<String>,
        /// Tokens to generate.
        #[arg(long, default_value_t = 100)]
        max_new_tokens: usize,
        /// Sampling temperature; 0 is greedy (deterministic).
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Sample only among the k most likely tokens.
        #[arg(long)]
        top_k: Option<usize>,
        /// Sampling seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Model kind: gpt (next-token prediction) or bert (masked LM); sets model.kind.
    #[arg(long)]
    model: Option<String>,
    /// TOML config (see configs/tiny.toml); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Run seed (weights, dropout, data order).
    #[arg(long)]
    seed: Option<u64>,
    /// Training data: .bin (u16 ids) or a text file (bytes); default: the built-in corpus.
    #[arg(long)]
    data: Option<String>,
    /// Checkpoint directory.
    #[arg(long)]
    out: Option<String>,
    /// Write one JSON object per step to this file.
    #[arg(long)]
    metrics: Option<String>,
    /// Global batch size (sequences).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Any config key, e.g. --set model.n_layer=2 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Parallel layout, run as threads on the CPU: dp=N, zero1=N, zero2=N, fsdp=N (zero3=N) or
    /// hsdp=RxS (fully sharded over S ranks, replicated R times). The global batch is the same
    /// for every layout.
    #[arg(long, value_name = "SPEC")]
    layout: Option<String>,
    /// Gradient accumulation: split each rank's rows of a step into this many micro-batches.
    #[arg(long, default_value_t = 1)]
    microbatches: usize,
}

fn train_config(a: &TrainArgs) -> Result<TrainConfig> {
    let mut cfg = match &a.config {
        Some(p) => TrainConfig::from_toml_file(p)?,
        None => TrainConfig::default(),
    };
    let flags: [(&str, Option<String>); 8] = [
        ("model.kind", a.model.clone()),
        ("train.steps", a.steps.map(|v| v.to_string())),
        ("train.seed", a.seed.map(|v| v.to_string())),
        ("data.path", a.data.clone()),
        ("out", a.out.clone()),
        ("metrics", a.metrics.clone()),
        ("train.batch_size", a.batch_size.map(|v| v.to_string())),
        ("train.lr", a.lr.map(|v| v.to_string())),
    ];
    for (key, value) in flags {
        if let Some(v) = value {
            cfg.apply_override(key, &v)?;
        }
    }
    for s in &a.set {
        cfg.apply_assignment(s)?;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => {
            let cfg = train_config(&a)?;
            let opts = meshgrad::train::TrainOptions {
                microbatches: a.microbatches,
            };
            if cfg.model.kind == "bert" {
                let layout: Option<meshgrad::parallel::ParallelLayout> =
                    a.layout.as_deref().map(str::parse).transpose()?;
                meshgrad::train_bert::train_bert(&cfg, layout.as_ref(), &opts, Verbosity::Normal)?;
                return Ok(());
            }
            match &a.layout {
                None => {
                    meshgrad::train::train_with(&cfg, &opts, Verbosity::Normal)?;
                }
                Some(spec) => {
                    let layout: meshgrad::parallel::ParallelLayout = spec.parse()?;
                    meshgrad::train_parallel::train_parallel(
                        &cfg,
                        &layout,
                        &opts,
                        Verbosity::Normal,
                    )?;
                }
            }
        }
        Command::Bench {
            model,
            steps,
            threads,
            profile,
        } => {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .build_global()?;
            let r = meshgrad::bench::run_bench(&meshgrad::bench::BenchOptions {
                model,
                steps,
                threads,
                profile,
            })?;
            println!("{}", r.line());
        }
        Command::Eval { checkpoint, data } => {
            let loss = meshgrad::eval::eval_checkpoint(&checkpoint, &data)?;
            println!("loss={loss:.6}");
        }
        Command::Generate {
            checkpoint,
            prompt,
            prompt_tokens,
            max_new_tokens,
            temperature,
            top_k,
            seed,
        } => {
            let model = meshgrad::train::load_checkpoint(&checkpoint)?;
            let vocab = model.config.vocab_size;
            let tokens = meshgrad::generate::prompt_tokens(
                prompt.as_deref(),
                prompt_tokens.as_deref(),
                vocab,
            )?;
            let out = meshgrad::generate::generate(
                &model,
                &tokens,
                max_new_tokens,
                temperature,
                top_k,
                seed,
            )?;
            if vocab <= 256 {
                println!("{}", meshgrad::generate::detokenize(&out));
            }
            let ids: Vec<String> = out.iter().map(|t| t.to_string()).collect();
            println!("ids={}", ids.join(","));
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the outermost context and its causes, joined.
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", msg.join(": "));
            ExitCode::FAILURE
        }
    }
}
