//! The `meshgrad` command line: train, evaluate and sample GPT models; train and run tokenizers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use meshgrad::config::TrainConfig;
use meshgrad::nn::tokenizer::{Tokenizer, TokenizerKind};
use meshgrad::run_setup::Verbosity;

#[derive(Parser)]
#[command(
    name = "meshgrad",
    version,
    about = "Train, evaluate and sample GPT, Llama and BERT models with meshgrad, on one device or a mesh of ranks; plan layouts; train and run tokenizers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Time the GPT training step on random tokens; prints `params=... step_median_s=...
    /// tokens_per_s=... gflops=... peak_bytes=...` (with `mfu=` on a GPU) last, or with
    /// --pytorch the PyTorch reference runs, that line again and `ratio_vs_pytorch_<mode>=...`
    /// last (see benches/README.md).
    Bench {
        /// tiny-gpt, small-gpt or gpt2-124m (vocab 50304, 12 layers, n_embd 768, seq 1024).
        #[arg(long, default_value = "tiny-gpt")]
        model: String,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Sequences per step (default 8).
        #[arg(long)]
        batch: Option<usize>,
        /// f32, or bf16 (bf16 parameters and activations, f32 master weights and AdamW state).
        #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
        precision: String,
        /// Also run the PyTorch reference (benches/pytorch_gpt.py: eager, and torch.compile on a
        /// GPU) with the same model, device, batch and steps, and print the ratios last.
        #[arg(long)]
        pytorch: bool,
        /// The Python interpreter with PyTorch, for --pytorch.
        #[arg(long, default_value = "python3")]
        python: String,
        /// The reference script, for --pytorch.
        #[arg(long, default_value = "benches/pytorch_gpt.py")]
        pytorch_script: PathBuf,
        /// Timed steps (after 2 warm-up steps).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Rayon threads.
        #[arg(long, default_value_t = 2)]
        threads: usize,
        /// Print a per-op time breakdown and the sgemm ceiling.
        #[arg(long)]
        profile: bool,
        /// Also time reference mode's step (one pass per row group, the row groups' tree, the
        /// exact gradient norm; CPU, f32) after the fast one, and print
        /// `reference_slowdown=... reference_memory_ratio=...` last.
        #[arg(long)]
        reference: bool,
        /// Sequences per row group for --reference.
        #[arg(long, default_value_t = 1)]
        row_group: usize,
        /// Chunks of the tensor-parallel sums for --reference (train.reference_chunks): 0 the
        /// model's, 1 none.
        #[arg(long, default_value_t = 0)]
        reference_chunks: usize,
    },
    /// Check every op on a device against the CPU in f64 (forward and backward, per dtype), then
    /// train the tiny GPT there beside the CPU; one line per check, a summary line last, non-zero
    /// exit when a check fails. A CUDA device that is not available is skipped (exit 0), or an
    /// error with MESHGRAD_REQUIRE_CUDA=1.
    Selftest {
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Steps of the tiny-GPT loss-curve check (0 skips it).
        #[arg(long, default_value_t = 50)]
        steps: usize,
        /// Run only the op checks whose name contains this (the loss-curve check is skipped).
        #[arg(long)]
        filter: Option<String>,
    },
    /// Predict the time and memory of a training step on a cluster (or this machine, with
    /// --device-kind cpu): every valid layout ranked, or one --layout; prints a table (or --json)
    /// and last `plan: layout=<spec> sequence_parallel=yes|no schedule=<kind> chunks=<v>
    /// microbatch_size=<m> step_s=<x> tokens_per_s_per_device=<x> mfu=<x>
    /// memory_per_device_gib=<x> fits=yes|no`.
    Plan(Box<meshgrad::plan_cmd::PlanArgs>),
    /// Train a GPT, or a Llama or a BERT with --model llama|bert (by default a small byte-level GPT
    /// on the built-in corpus, on CPU).
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint; prints `loss=<value>` last: a GPT's or a Hugging Face Llama folder's
    /// mean next-token cross-entropy over a token file, or a BERT's mean MLM cross-entropy over a
    /// JSONL file of labelled examples.
    Eval {
        /// Checkpoint directory: a run's --out (config.json + model.safetensors, and
        /// tokenizer.json when it was trained with a tokenizer), or a training checkpoint
        /// (OUT/checkpoints/step-N).
        #[arg(long)]
        checkpoint: PathBuf,
        /// Data, as for `train --data`: text and .jsonl go through the checkpoint's
        /// tokenizer.json (byte-level without one); a folder of shards is evaluated on its
        /// validation shards (*_val_*.bin) when it has any, on all of them otherwise.
        #[arg(long)]
        data: PathBuf,
    },
    /// Compare the metrics files (--metrics) of several runs: for each run after the first, the
    /// first step whose loss differs from the first run's and the largest relative difference
    /// (losses, validation losses, gradient norms); prints `compare: runs=... identical=...
    /// largest_relative_loss_difference=...` last.
    Compare {
        /// Metrics files (JSON lines); the first is the reference.
        #[arg(required = true, num_args = 2..)]
        files: Vec<PathBuf>,
        /// Draw every run's loss curve, and its relative difference from the first run, into
        /// this PNG.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Exit non-zero when a run's losses (or, with --weights, weights) differ from the first
        /// run's by more than this relative amount (0: they must be identical), or when the runs
        /// logged different steps.
        #[arg(long)]
        max_relative_difference: Option<f64>,
        /// Also compare the runs' final weights: one per metrics file, in the same order (a
        /// run's --out folder or a .safetensors file); prints each tensor's relative L2
        /// difference from the first run's, the largest and over all weights. A NaN or infinite
        /// weight where the first run's is finite exits non-zero.
        #[arg(long, num_args = 1..)]
        weights: Vec<PathBuf>,
    },
    /// Write the model of a training checkpoint (OUT/checkpoints/step-N, or a run's OUT: its
    /// latest) as a Hugging Face folder: config.json, model.safetensors, and the tokenizer.json
    /// and meshgrad.toml of the run.
    Export {
        /// A training checkpoint, a folder of them, or a run's --out folder.
        #[arg(long)]
        checkpoint: PathBuf,
        /// The Hugging Face folder to write. A folder that already holds a model (an earlier
        /// export, a run's final model) is refused unless --overwrite; one that holds a run's
        /// checkpoints, or in which a run or export is in progress, always is.
        #[arg(long)]
        out: PathBuf,
        /// Replace the model already in --out.
        #[arg(long)]
        overwrite: bool,
    },
    /// Continue a prompt with a checkpoint (a GPT, or a Hugging Face `LlamaForCausalLM` folder):
    /// the text is printed as each token is chosen, then `ids=<the generated ids>` last.
    Generate {
        /// Checkpoint directory.
        #[arg(long)]
        checkpoint: PathBuf,
        /// Prompt text: encoded by the checkpoint's tokenizer.json (without special tokens) when
        /// it has one, as bytes otherwise.
        #[arg(long)]
        prompt: Option<String>,
        /// Prompt as token ids, e.g. "12,7,99".
        #[arg(long)]
        prompt_tokens: Option<String>,
        /// Tokens to generate (at least 1). The text is printed as each token is chosen, then
        /// `ids=` with every generated id, last.
        #[arg(long, default_value_t = 100)]
        max_new_tokens: usize,
        /// Sampling temperature: a finite number >= 0; 0 is greedy (deterministic).
        #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
        temperature: f64,
        /// Sample only among the k most likely tokens (k >= 1; left out: among all tokens).
        #[arg(long)]
        top_k: Option<usize>,
        /// Sampling seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Print a pipeline-parallel schedule as a grid (time steps x ranks: F3 forward, B3 backward,
    /// W3 weight gradient, F3.1 chunk 1, . idle), simulated with unit costs; the last line is
    /// `bubble=<fraction, 4 decimals> peak_activations=<max over ranks> deadlock=no`. A
    /// simulation; `train --layout pp=P --schedule KIND` runs the same schedules.
    Schedule {
        /// gpipe, 1f1b, interleaved (Megatron's, needs the microbatches divisible by the stages)
        /// or zb (zero bubble, ZB-H1 style).
        #[arg(long, value_parser = ["gpipe", "1f1b", "interleaved", "zb"])]
        kind: String,
        /// Pipeline stages (ranks).
        #[arg(long)]
        stages: usize,
        /// Microbatches per step.
        #[arg(long)]
        microbatches: usize,
        /// Model chunks per rank, for --kind interleaved only (default 2).
        #[arg(long)]
        chunks: Option<usize>,
    },
    /// Start N copies of meshgrad as the ranks of one job, as torchrun does: each gets RANK,
    /// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT, its
    /// output lines are prefixed with `[rank R] `, and when one rank fails the others are stopped
    /// (SIGTERM, then SIGKILL) and the launcher exits non-zero naming the rank.
    Launch {
        /// Processes on this node.
        #[arg(long)]
        nproc_per_node: usize,
        /// Nodes in the job (run the same command on each, with its --node-rank).
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This node's index, 0..nnodes.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Address of node 0, where rank 0's rendezvous store listens (default 127.0.0.1).
        #[arg(long)]
        master_addr: Option<String>,
        /// Port of rank 0's store, 1 to 65535 (default: a free port on one node, 29500 across
        /// nodes).
        #[arg(long)]
        master_port: Option<u16>,
        /// tcp: start the processes directly (meshgrad train in them trains over TCP); mpi:
        /// through the system's mpirun -np N; nccl: directly, one per GPU, training over NCCL
        /// (needs a build with --features nccl).
        #[arg(long, default_value = "tcp", value_parser = ["tcp", "mpi", "nccl"])]
        backend: String,
        /// The meshgrad arguments every rank runs, after --, e.g. -- train --steps 10.
        #[arg(last = true, value_name = "ARGS")]
        args: Vec<String>,
    },
    /// Test helper (hidden): print the rank variables this process sees, as
    /// `rank=R world_size=W local_rank=L ... pid=P`, then optionally share the pids through the
    /// rendezvous store, exit with a status or sleep.
    #[command(hide = true)]
    LaunchProbe {
        /// Exit with --exit-code on this rank (after printing).
        #[arg(long)]
        exit_rank: Option<usize>,
        /// The exit status for --exit-rank.
        #[arg(long, default_value_t = 3)]
        exit_code: i32,
        /// Seconds --exit-rank waits before exiting.
        #[arg(long, default_value_t = 0.0)]
        exit_delay: f64,
        /// Ignore SIGTERM (only SIGKILL stops this process).
        #[arg(long)]
        ignore_sigterm: bool,
        /// Sleep this many seconds before exiting 0.
        #[arg(long, default_value_t = 0.0)]
        sleep: f64,
        /// Exchange pids through the TCP store at MASTER_ADDR:MASTER_PORT, print `store pids=...`.
        #[arg(long)]
        store: bool,
        /// Join the MPI world (needs --features mpi) and all-reduce every 20 ms for --sleep
        /// seconds; --exit-rank exits (or --panic-rank panics) after --exit-delay seconds while
        /// the others wait in the collective.
        #[arg(long)]
        mpi: bool,
        /// With --mpi: this rank panics after --exit-delay seconds.
        #[arg(long)]
        panic_rank: Option<usize>,
    },
    /// Read the flight recorder's dumps of a multi-rank run (OUT/flight/rank-R.json, written on a
    /// collective timeout, on SIGUSR1 and when a rank fails) and name the rank that is behind and
    /// the first call where the ranks disagree. Prints each rank's last completed and open calls,
    /// the disagreement, and last `flight: behind=<ranks> call=<kind>#<seq>` (`none` for either
    /// when there is nothing to name: `flight: behind=none call=none` when every rank agrees). A
    /// rank without a dump (stopped, killed) is named from the others' records.
    Flight {
        /// The run's --out folder, or its flight/ folder.
        dir: PathBuf,
    },
    /// Train tokenizers (Hugging Face tokenizer.json format).
    Tokenizer {
        #[command(subcommand)]
        command: TokenizerCommand,
    },
    /// Encode text with a tokenizer; prints `tokens=[...]` (JSON) and, last, `ids=1,2,3`.
    Tokenize {
        /// A tokenizer.json (from `meshgrad tokenizer train`, or Hugging Face).
        #[arg(long)]
        tokenizer: PathBuf,
        /// The text to encode.
        #[arg(long)]
        text: String,
        /// Leave out the special tokens the tokenizer adds ([CLS] ... [SEP] for WordPiece); by
        /// default they are added, as Hugging Face's `encode` does.
        #[arg(long)]
        no_special_tokens: bool,
    },
}

#[derive(Subcommand)]
enum TokenizerCommand {
    /// Train a tokenizer on text files and write it as tokenizer.json. Text files are read line
    /// by line, .jsonl files by their `text` fields.
    Train {
        /// bpe: byte-level BPE, GPT-2 style (special token <|endoftext|>); wordpiece: BERT style,
        /// uncased (special tokens [PAD] [UNK] [CLS] [SEP] [MASK]).
        #[arg(long, value_parser = ["bpe", "wordpiece"])]
        kind: String,
        /// Target vocabulary size, special tokens included (bpe: at least 257).
        #[arg(long)]
        vocab_size: usize,
        /// Training text: a text file or a .jsonl file (repeatable).
        #[arg(long, required = true)]
        data: Vec<PathBuf>,
        /// Where to write the tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Model kind: gpt (next-token prediction), llama (next-token prediction with a Llama
    /// decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU), mixtral (a Llama with
    /// mixture-of-experts feed-forwards) or bert (masked LM); sets model.kind.
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
    /// Training data (default: the built-in corpus): a folder of llm.c token shards (*.bin,
    /// memory-mapped; *_val_*.bin are the validation set, else the last data.val_fraction is
    /// held out), a .bin file (one llm.c shard, or raw little-endian u16 ids), a .jsonl file (a
    /// "text" field per line) or a text file. Text and .jsonl are byte-level unless --tokenizer
    /// is given.
    #[arg(long)]
    data: Option<String>,
    /// A tokenizer.json for text and .jsonl data; the model's vocab size becomes the
    /// tokenizer's and the checkpoint keeps a copy (tokenizer.json).
    #[arg(long)]
    tokenizer: Option<String>,
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
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    /// Device to train on: cpu (default), cuda (device 0) or cuda:N; sets train.device. CUDA
    /// needs a build with --features cuda and a GPU, and trains on one device only.
    #[arg(long, value_name = "DEVICE")]
    device: Option<String>,
    /// Training precision: f32 (default), bf16 (bf16 weights and activations, f32 master
    /// weights and AdamW state) or f16 (the same in f16 with dynamic loss scaling); sets
    /// train.precision.
    #[arg(long, value_name = "PRECISION")]
    precision: Option<String>,
    /// Reference mode: bit-identical losses, gradient norms and weights under every layout for
    /// the same seed, global batch and row group (sets train.reference; see README's "Reference
    /// mode"). Costs speed: each row group runs its own forward and backward pass. Under
    /// context parallelism (cp in --layout) pass --set train.reference_positions=folded, to the
    /// one-device run too: both then add over positions in the folded order.
    #[arg(long)]
    reference: bool,
    /// Reference mode: sequences per row group (sets train.row_group; default 1).
    #[arg(long, value_name = "N")]
    row_group: Option<usize>,
    /// Any config key, e.g. --set model.n_layer=2 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Parallel layout, run as threads on the CPU: comma-separated degrees whose product is the
    /// number of ranks. dp=R (data parallel), fsdp=S (= zero3=S), zero1=S or zero2=S (sharded
    /// over S ranks), hsdp=RxS (= dp=R,fsdp=S: sharded over S ranks, replicated R times), e.g.
    /// dp=4, fsdp=4, hsdp=2x2, dp=2,zero1=2. tp=T splits each GPT or BERT layer across T ranks
    /// (tensor parallelism; composes: dp=2,tp=2, fsdp=2,tp=2, hsdp=2x2,tp=2; T must divide the
    /// vocabulary, BERT's 261 by default: --set model.vocab_multiple=T pads it). pp=P cuts the
    /// model into P pipeline stages (see --schedule, --microbatches, --partition; composes:
    /// dp=2,tp=2,pp=2, fsdp=2,pp=2). cp=C splits every row's sequence over C ranks (context
    /// parallelism, GPT, Llama, Mixtral and BERT: chunks i and 2C-1-i of 2C per rank, ring
    /// attention; composes with dp, fsdp/zeroN, tp, pp and ep, e.g. dp=2,cp=2, cp=2,tp=2; the
    /// sequence must split into 2C chunks; no BERT dropout).
    /// ep=E shards a Mixtral's experts over E of the data-parallel ranks (expert parallelism;
    /// adds no ranks: ep=2 is dp=2,ep=2, dp=1,cp=2,ep=2 shards them over a cp pair; E must
    /// divide the experts and the data-parallel x cp ranks; with dp, zero1/zero2/fsdp/hsdp,
    /// cp, tp and pp; under zero1/zero2/fsdp/hsdp the experts get the same ZeRO stage over the
    /// ranks holding the same ones). The global batch is the same for every layout.
    #[arg(long, value_name = "SPEC")]
    layout: Option<String>,
    /// Gradient accumulation: split each rank's rows of a step into this many micro-batches
    /// (with pp>1, the pipeline's microbatches). In reference mode each row group is its own
    /// pass and a pipeline runs one microbatch per row group of a data-parallel rank (leave this
    /// at 1 or give that count; choose them with --row-group).
    #[arg(long, default_value_t = 1)]
    microbatches: usize,
    /// Sequence parallelism: split the activations outside the tensor-parallel layers along the
    /// sequence across the tensor-parallel ranks. Needs tp>1 in --layout.
    #[arg(long)]
    sequence_parallel: bool,
    /// Context parallelism's attention (with cp>1 in --layout): ring (keys and values pass
    /// around the group, C-1 hops) or allgather (every rank's keys and values gathered once,
    /// their gradients reduce-scattered home: fewer, larger transfers, and a rank keeps the keys
    /// and values up to its later chunk, up to the whole sequence's). Reference mode's folded
    /// order runs its own attention whatever the mode.
    #[arg(long, default_value = "ring", value_parser = ["ring", "allgather"])]
    cp_mode: String,
    /// Pipeline schedule (with pp>1 in --layout): gpipe, 1f1b, interleaved (Megatron's, V chunks
    /// per rank, microbatches divisible by pp) or zb (zero bubble, ZB-H1 style).
    #[arg(long, value_parser = ["gpipe", "1f1b", "interleaved", "zb"])]
    schedule: Option<String>,
    /// Model chunks per pipeline rank, for --schedule interleaved (default 2).
    #[arg(long)]
    chunks: Option<usize>,
    /// How to cut the model into pipeline stages: auto (= speed: minimise the slowest stage,
    /// from a profile of every layer on this device), memory (minimise the largest stage's
    /// memory), even (equal numbers of blocks) or the first block of each stage, e.g. 0,3,6,9.
    #[arg(long, value_name = "METHOD")]
    partition: Option<String>,
    /// Write a Chrome trace (JSON, for Perfetto or chrome://tracing) of every rank's forward,
    /// backward, send, receive, optimizer and idle time to FILE, with the ring attention hops
    /// (cp) and all-to-alls (ep) inside the passes.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// With --partition auto, speed or memory: the most memory one pipeline stage may hold
    /// (parameters, gradients, optimizer state and in-flight activations, as profiled), e.g.
    /// 512MiB; even and explicit splits are checked against it.
    #[arg(long, value_name = "SIZE")]
    max_stage_memory: Option<String>,
    /// Save a checkpoint of the whole training state (every rank's shards, optimizer state,
    /// step) every N steps and after the last into OUT/checkpoints/step-N;
    /// OUT/checkpoints/latest names the newest. SIGINT/SIGTERM always save one, then stop, and
    /// a resumed run always saves after its last step (latest is then its final state).
    /// Weights that are not finite are never saved: the run stops instead.
    #[arg(long, value_name = "N")]
    save_every: Option<usize>,
    /// Keep only the newest K periodic checkpoints (default: all).
    #[arg(long, value_name = "K")]
    keep: Option<usize>,
    /// Continue an earlier run from its latest checkpoint: its --out folder (or a checkpoint
    /// folder). Without --config the run's config is the checkpoint's (model, data,
    /// hyper-parameters, --out, --steps), so no flag needs repeating; flags and --set apply on
    /// top, and model, data, seed, batch size and precision must stay the checkpoint's. The
    /// layout may differ.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Fine-tune: start from the weights of a model folder (a Hugging Face GPT-2 or Llama
    /// folder, or a model or checkpoint written by meshgrad train) with a fresh optimizer and
    /// schedule. The folder fixes the model (its config.json or meshgrad.toml; the context length
    /// from n_positions / max_position_embeddings) and its tokenizer.json becomes the run's
    /// unless --tokenizer names another; a flag that changes the model's shape is refused.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    /// Train into an --out folder that already holds a run, starting over (its checkpoints are
    /// removed). Without it such a folder is refused.
    #[arg(long)]
    overwrite: bool,
    /// Print the planner's line for this run on this machine (`plan: ... fits=yes|no`; the CPU
    /// calibrated and the model's layers profiled as `meshgrad plan --device-kind cpu` does,
    /// over TCP under `meshgrad launch`) and stop before any work; a run that does not fit is
    /// refused in one line, as the preflight check would.
    #[arg(long)]
    dry_run: bool,
    /// Recompute activations in the backward pass instead of keeping them: none (default), all
    /// (every block) or, with pp>1, the pipeline stages whose blocks recompute, e.g. 0,1.
    #[arg(long, value_name = "WHICH", default_value = "none")]
    activation_checkpointing: String,
    /// With --layout: seconds a rank waits for its peers in a collective or receive before the
    /// run fails, naming the missing rank(s), the call and its sequence number (the watchdog).
    #[arg(long, value_name = "SECS", default_value_t = 300.0)]
    collective_timeout: f64,
    /// With --layout: how the ranks communicate: threads (ranks as threads of this process),
    /// tcp (one rank per process under `meshgrad launch` or torchrun), mpi (one rank per
    /// process under mpirun), nccl (one rank per process and GPU, under `meshgrad launch
    /// --backend nccl`; needs a build with --features nccl). Default: MESHGRAD_BACKEND when set
    /// (meshgrad launch --backend nccl sets it), else tcp under meshgrad launch or torchrun, mpi
    /// under mpirun, threads in a single process.
    #[arg(long, value_parser = ["threads", "tcp", "mpi", "nccl"])]
    backend: Option<String>,
}

fn train_config(a: &TrainArgs) -> Result<TrainConfig> {
    let mut cfg = match (&a.config, &a.resume) {
        (Some(p), _) => TrainConfig::from_toml_file(p)?,
        (None, Some(dir)) => meshgrad::run_checkpoint::resume_base_config(dir)?,
        (None, None) => TrainConfig::default(),
    };
    let folder = match &a.init_from {
        Some(dir) => Some(meshgrad::init_from::apply(&mut cfg, dir)?),
        None => None,
    };
    // A checkpoint's config names its own run's metrics file: a run resumed into another
    // --out must not append to (and cut back) that file unless --metrics says so.
    let saved =
        (a.config.is_none() && a.resume.is_some()).then(|| (cfg.out.clone(), cfg.metrics.clone()));
    let flags: [(&str, Option<String>); 13] = [
        ("model.kind", a.model.clone()),
        ("train.steps", a.steps.map(|v| v.to_string())),
        ("train.seed", a.seed.map(|v| v.to_string())),
        ("data.path", a.data.clone()),
        ("data.tokenizer", a.tokenizer.clone()),
        ("out", a.out.clone()),
        ("metrics", a.metrics.clone()),
        ("train.batch_size", a.batch_size.map(|v| v.to_string())),
        ("train.lr", a.lr.map(|v| v.to_string())),
        ("train.device", a.device.clone()),
        ("train.precision", a.precision.clone()),
        ("train.reference", a.reference.then(|| "true".to_string())),
        ("train.row_group", a.row_group.map(|v| v.to_string())),
    ];
    for (key, value) in flags {
        if let Some(v) = value {
            cfg.apply_override(key, &v)?;
        }
    }
    for s in &a.set {
        cfg.apply_assignment(s)?;
    }
    if saved.is_some_and(|(out, metrics)| out != cfg.out && metrics == cfg.metrics) {
        cfg.metrics = None;
    }
    if let (Some(folder), Some(dir)) = (&folder, &a.init_from) {
        meshgrad::init_from::check(&cfg, folder, dir)?;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => {
            let env = meshgrad::parallel::comm::RankEnv::detect()?;
            let backend = meshgrad::ranks::resolve_backend(a.backend.as_deref(), &env)?;
            use meshgrad::parallel::comm::Backend;
            if !matches!(backend, Backend::Nccl | Backend::Tcp) {
                meshgrad::launch::refuse_multi_process(&env)?;
            }
            let cfg = train_config(&a)?;
            meshgrad::stop::install_once()?;
            meshgrad::flight::install(std::path::Path::new(&cfg.out))?;
            let mut pipeline = meshgrad::run_setup::PipelineOptions::default();
            if let Some(k) = &a.schedule {
                pipeline.schedule = k.parse().map_err(anyhow::Error::msg)?;
            }
            pipeline.chunks = a.chunks;
            if let Some(p) = &a.partition {
                pipeline.partition = p.clone();
            }
            pipeline.trace = a.trace.clone();
            pipeline.max_stage_memory = a
                .max_stage_memory
                .as_deref()
                .map(meshgrad::run_setup::parse_bytes)
                .transpose()?;
            let opts = meshgrad::run_setup::TrainOptions {
                microbatches: a.microbatches,
                sequence_parallel: a.sequence_parallel,
                cp_mode: meshgrad_parallel::plan::cost::CpMode::parse(&a.cp_mode)?,
                pipeline,
                activation_checkpointing: a
                    .activation_checkpointing
                    .parse()
                    .map_err(anyhow::Error::msg)?,
                save_every: a.save_every,
                keep: a.keep,
                resume: a.resume.clone(),
                init_from: a.init_from.clone(),
                overwrite: a.overwrite,
                collective_timeout: std::time::Duration::try_from_secs_f64(a.collective_timeout)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "--collective-timeout {} must be a positive number of seconds",
                            a.collective_timeout
                        )
                    })?,
            };
            let layout: Option<meshgrad::parallel::ParallelLayout> =
                a.layout.as_deref().map(str::parse).transpose()?;
            meshgrad::ranks::check_mpi_world(layout.as_ref())?;
            meshgrad::ranks::check_process_layout(backend, &env, layout.as_ref())?;
            if a.dry_run {
                let over_tcp = backend == Backend::Tcp && env.world_size > 1;
                return meshgrad::train::dry_run(&cfg, layout.as_ref(), &opts, over_tcp);
            }
            let r = meshgrad::train::train(&cfg, layout.as_ref(), &opts, Verbosity::Normal);
            if let Err(e) = &r {
                // A failed run dumps its ranks' flight recorders (ranks as threads; a rank of a
                // job of processes has dumped already).
                meshgrad::flight::dump_on_error(e);
            }
            // Last, for the planner's predictions to be set beside (the largest rank's).
            println!(
                "peak_memory_per_rank_mib={:.1}",
                r?.peak_memory_per_rank as f64 / (1024.0 * 1024.0)
            );
        }
        Command::Plan(a) => meshgrad::plan_cmd::run(&a)?,
        Command::Flight { dir } => meshgrad::flight::run(&dir)?,
        Command::Launch {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr,
            master_port,
            backend,
            args,
        } => {
            meshgrad::parallel::launch::launch(&meshgrad::parallel::launch::LaunchOptions {
                nproc_per_node,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                backend: backend.parse().map_err(anyhow::Error::msg)?,
                program: None,
                args,
            })?;
        }
        Command::LaunchProbe {
            exit_rank,
            exit_code,
            exit_delay,
            ignore_sigterm,
            sleep,
            store,
            mpi,
            panic_rank,
        } => meshgrad::launch::probe(&meshgrad::launch::ProbeOptions {
            exit_rank,
            exit_code,
            exit_delay,
            sleep,
            store,
            ignore_sigterm,
            mpi,
            panic_rank,
        })?,
        Command::Bench {
            model,
            device,
            batch,
            precision,
            pytorch,
            python,
            pytorch_script,
            steps,
            threads,
            profile,
            reference,
            row_group,
            reference_chunks,
        } => {
            if reference && pytorch {
                anyhow::bail!("bench: --reference and --pytorch are separate comparisons; run one");
            }
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads.max(1))
                .build_global()?;
            // Reference mode's step: the row groups' gradient tree (meshgrad-parallel).
            let reference_step: meshgrad::nn::bench::ReferenceStep =
                |p, g, f, l| meshgrad::parallel::grad_tree::reference_step(p, g, f, l);
            let opts = meshgrad::nn::bench::BenchOptions {
                model,
                device: device.parse()?,
                batch,
                precision: if precision == "bf16" {
                    meshgrad::prelude::DType::BF16
                } else {
                    meshgrad::prelude::DType::F32
                },
                steps,
                threads,
                profile,
                reference: None,
                reference_chunks,
                grad_norm: reference,
            };
            let r = meshgrad::nn::bench::run_bench(&opts, reference_step)?;
            println!("{}", r.line());
            if reference {
                let opts = meshgrad::nn::bench::BenchOptions {
                    reference: Some(row_group),
                    ..opts.clone()
                };
                let rr = meshgrad::nn::bench::run_bench(&opts, reference_step)?;
                println!("{}", rr.line());
                println!("{}", meshgrad::nn::bench::reference_cost_line(&r, &rr));
            }
            if pytorch {
                let refs = meshgrad::bench_pytorch::run_pytorch_reference(
                    &opts,
                    &python,
                    &pytorch_script,
                )?;
                println!("{}", r.line());
                println!("{}", meshgrad::nn::bench::ratio_line(r.tokens_per_s, &refs));
            }
        }
        Command::Selftest {
            device,
            steps,
            filter,
        } => {
            use meshgrad::nn::selftest;
            let device: meshgrad::prelude::Device = device.parse()?;
            if let Some(why) = selftest::skip_reason(device) {
                // The GPU session sets this: there a missing device is a failure, not a skip.
                if std::env::var("MESHGRAD_REQUIRE_CUDA").as_deref() == Ok("1") {
                    anyhow::bail!("selftest: device={device}: {why} (MESHGRAD_REQUIRE_CUDA=1)");
                }
                println!("selftest: device={device} skipped: {why}");
                return Ok(());
            }
            let print = |r: &selftest::CheckResult| println!("{}", r.line());
            let mut results = selftest::run(device, filter.as_deref(), print);
            if steps > 0 && filter.is_none() {
                // bench's tiny-gpt shape on 64-token rows of the built-in corpus.
                let (mut cfg, _) = meshgrad::nn::bench::bench_config("tiny-gpt")?;
                cfg.block_size = 64;
                let data = meshgrad::corpus::builtin_dataset();
                results.push(selftest::loss_curve(device, steps, &cfg, &data));
                print(results.last().expect("just pushed"));
            }
            if results.is_empty() {
                anyhow::bail!("selftest: no case matches the filter");
            }
            let failed = results.iter().filter(|r| !r.ok()).count();
            println!(
                "selftest: device={device} checks={} failed={failed}",
                results.len()
            );
            if failed > 0 {
                anyhow::bail!(
                    "selftest: {failed} of {} checks failed on {device}",
                    results.len()
                );
            }
        }
        Command::Schedule {
            kind,
            stages,
            microbatches,
            chunks,
        } => {
            let out = meshgrad::schedule_cmd::schedule_output(&kind, stages, microbatches, chunks)?;
            print!("{}", out.text);
            if let Some(what) = out.deadlock {
                anyhow::bail!("the {kind} schedule deadlocks: {what}");
            }
        }
        Command::Compare {
            files,
            plot,
            max_relative_difference,
            weights,
        } => meshgrad::compare::run(&meshgrad::compare::CompareOptions {
            files,
            plot,
            weights,
            max_relative_difference,
        })?,
        Command::Export {
            checkpoint,
            out,
            overwrite,
        } => {
            let from = meshgrad::run_checkpoint::export(&checkpoint, &out, overwrite)?;
            println!("exported {} to {}", from.display(), out.display());
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
            meshgrad::generate::check_sampling(max_new_tokens, temperature, top_k)?;
            let model = meshgrad::train::load_causal_lm(&checkpoint)?;
            let tokenizer = meshgrad::train::load_checkpoint_tokenizer(&checkpoint)?;
            let vocab = model.sampled_vocab();
            let tokens = meshgrad::generate::prompt_tokens_with(
                prompt.as_deref(),
                prompt_tokens.as_deref(),
                vocab,
                tokenizer.as_ref(),
            )?;
            let out = meshgrad::generate::generate(
                model.as_ref(),
                &tokens,
                max_new_tokens,
                temperature,
                top_k,
                seed,
                tokenizer.as_ref(),
                &mut std::io::stdout().lock(),
            )?;
            println!("ids={}", id_list(&out));
        }
        Command::Tokenizer {
            command:
                TokenizerCommand::Train {
                    kind,
                    vocab_size,
                    data,
                    out,
                },
        } => {
            let kind: TokenizerKind = kind.parse()?;
            let started = std::time::Instant::now();
            let tok = Tokenizer::train(kind, vocab_size, &data)?;
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
            }
            tok.save(&out)?;
            println!(
                "trained a {kind} tokenizer on {} file(s) in {:.1}s: vocab_size={} (target {vocab_size})",
                data.len(),
                started.elapsed().as_secs_f64(),
                tok.vocab_size()
            );
            println!("wrote {}", out.display());
        }
        Command::Tokenize {
            tokenizer,
            text,
            no_special_tokens,
        } => {
            let tok = Tokenizer::from_file(&tokenizer)?;
            let (ids, pieces) = tok.encode_pieces(&text, !no_special_tokens)?;
            println!("tokens={}", serde_json::to_string(&pieces)?);
            println!("ids={}", id_list(&ids));
        }
    }
    Ok(())
}

/// Ids as `1,2,3`.
fn id_list(ids: &[u32]) -> String {
    ids.iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn main() -> ExitCode {
    meshgrad::parallel::launch::exit_with_launcher();
    let cli = Cli::parse();
    let result = run(cli);
    meshgrad::run_dir::release_locks();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the outermost context and its causes, joined.
            let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
            eprintln!("error: {}", msg.join(": "));
            ExitCode::FAILURE
        }
    }
}
