//! Distributed checkpoints: a small GPT trained under layout A is saved (every rank its own
//! pieces), loaded under layout B, and the full state (parameters and AdamW's moments and step
//! counts, gathered through ZeRO's `full_state_dict` or the tensor-parallel placements) must be
//! the saved one bit for bit; training then continues and its losses are compared with the run
//! that never stopped (bitwise when B is A). Also: the atomic publish (`.tmp-*` leftovers are
//! ignored and cleaned, `keep`, the `latest` pointer), pipeline stages loading and saving the
//! parameters they hold (the tied table written once), and one-line errors for a missing piece,
//! a missing rank file, a missing tensor and a shape mismatch.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{DataParallel, OptKind};
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{param_groups_for_decay, StateKind};
use meshgrad_nn::{ForwardCtx, Gpt, GptConfig, Module, ParamBuilder, StageSpec};
use meshgrad_parallel::checkpoint::{
    self, pieces_of_module, pieces_of_optimizer, Checkpoint, Piece, Role, SaveOptions,
};
use meshgrad_parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_parallel::zero::FullStateDictOptions;
use meshgrad_parallel::{rank_rows, ParallelLayout, ReduceOp};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 7;
const BATCH: usize = 4;
const T: usize = 16;
const LR: f64 = 1e-3;
/// Steps before the save, and after it.
const BEFORE: usize = 2;
const AFTER: usize = 2;

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        dropout: 0.0,
        bias: false,
        layer_norm_eps: 1e-5,
    }
}

fn dataset() -> TokenDataset {
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
}

/// A fresh directory under the system's temporary directory.
fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("meshgrad-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Forward and backward of `rows` at `step`; the local mean loss.
fn forward_backward(
    model: &Gpt,
    data: &TokenDataset,
    step: usize,
    rows: std::ops::Range<u64>,
) -> Result<f64> {
    let n = (rows.end - rows.start) as usize;
    let b = data
        .batch(SEED, step as u64, rows.clone(), T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    let ids = Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?;
    let targets = Tensor::from_vec(b.targets, (n, T), Device::Cpu)?;
    let loss =
        ForwardCtx::new(step as u64, rows.start).scope(|| model.loss(&ids, &targets, None))?;
    loss.backward()?;
    loss.tensor().item()
}

/// Every tensor of the full (single-device) state by name, as the bits of its f64 values:
/// parameters, and the optimizer's state dict with elementwise state gathered over its
/// parameter's tensor-parallel group. A collective.
type State = Vec<(String, Vec<u64>)>;

fn full_state(model: &Gpt, dp: &DataParallel) -> Result<State> {
    let dict = match dp.sharded() {
        Some(z) => z.full_state_dict(FullStateDictOptions {
            optimizer: true,
            rank0_only: false,
        })?,
        None => {
            let mut d = meshgrad_nn::tp::full_state_dict(model)?;
            let vars: HashMap<String, _> = model.named_parameters().into_iter().collect();
            let opt = dp.optimizer().expect("an optimizer without ZeRO");
            for (k, t) in opt.state_dict()? {
                let t = match opt.state_kind(&k) {
                    Some(StateKind::Elementwise { param }) => match vars[&param].placement() {
                        Some(p) => p.gather(&t)?,
                        None => t,
                    },
                    _ => t,
                };
                d.push((k, t));
            }
            d
        }
    };
    let mut out: State = dict
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_vec_f64()?.iter().map(|v| v.to_bits()).collect())))
        .collect::<Result<_>>()?;
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// What a run returns (rank 0's view).
struct Run {
    /// Losses of the steps it trained, by step index.
    losses: Vec<(usize, f64)>,
    /// The full state right after saving, or right after loading.
    state: State,
}

/// Under `layout`: either trains `BEFORE` steps, saves into `dir` and trains `AFTER` more
/// (`load = false`), or loads the latest checkpoint of `dir` and trains the `AFTER` steps
/// (`load = true`).
fn run(layout: &str, dir: &Path, load: bool) -> Run {
    run_in(layout, dir, load, DType::F32)
}

/// [`run`] with the model's parameters in `dtype` (bf16: f32 master weights, in AdamW's state
/// on a replicated rank and as ZeRO's shards).
fn run_in(layout: &str, dir: &Path, load: bool, dtype: DType) -> Run {
    let data = dataset();
    let layout: ParallelLayout = layout.parse().unwrap();
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    let outs = run_ranks(layout.world_size(), &opts, |ctx| {
        let mesh = layout.mesh(ctx.comm.clone())?;
        let builder = ParamBuilder::new(SEED)
            .dtype(dtype)
            .tensor_parallel(tensor_parallel(mesh.tp_group(), false), Gpt::tp_plan());
        let model = Gpt::build(gpt_config(), builder)?;
        let groups = param_groups_for_decay(model.named_parameters(), 0.1);
        let mut wrapper = DataParallel::new(&model, &mesh, groups, OptKind::AdamW)?;
        let rows = rank_rows(BATCH, mesh.dp_degree(), mesh.dp_rank())?;
        let dp_group = mesh.dp_group();
        let mut losses = Vec::new();
        let mut train = |wrapper: &mut DataParallel, steps: std::ops::Range<usize>| {
            for step in steps {
                wrapper.zero_grad();
                let local = forward_backward(&model, &data, step, rows.clone())?;
                wrapper.step(&model.parameters(), Some(0.5), LR)?;
                losses.push((
                    step,
                    all_reduce_scalar(dp_group.as_ref(), local, ReduceOp::Avg)?,
                ));
            }
            Ok::<(), meshgrad_tensor::Error>(())
        };
        let state = if load {
            let ck = Checkpoint::open(dir)?;
            assert_eq!(ck.metadata()["step"], BEFORE as u64);
            match wrapper.sharded() {
                Some(z) => z.load_pieces(&ck, true)?,
                None => {
                    ck.load_into_module(&model, true)?;
                    let opt = wrapper.optimizer_mut().expect("an optimizer");
                    ck.load_optimizer(opt, true)?;
                }
            }
            let state = full_state(&model, &wrapper)?;
            train(&mut wrapper, BEFORE..BEFORE + AFTER)?;
            state
        } else {
            train(&mut wrapper, 0..BEFORE)?;
            let pieces: Vec<Piece> = match wrapper.sharded() {
                Some(z) => z.local_pieces()?,
                None => {
                    let mut p = pieces_of_module(&model)?;
                    p.extend(pieces_of_optimizer(
                        wrapper.optimizer().expect("optimizer"),
                    )?);
                    p
                }
            };
            let opts = SaveOptions {
                metadata: serde_json::json!({ "step": BEFORE, "layout": layout.to_string() }),
                files: vec![("config.json".into(), b"{\"n_layer\": 2}".to_vec())],
            };
            let name = checkpoint::checkpoint_name(BEFORE as u64);
            let path = checkpoint::save(dir, &name, pieces, ctx.comm.as_ref(), &opts)?;
            assert_eq!(path, dir.join(&name));
            let state = full_state(&model, &wrapper)?;
            train(&mut wrapper, BEFORE..BEFORE + AFTER)?;
            state
        };
        Ok(Run { losses, state })
    })
    .unwrap();
    outs.into_iter().next().unwrap()
}

/// Asserts the loaded state equals the saved one bit for bit and the continued losses are
/// within `tol` relative (0: bitwise) of the run that did not stop; prints the figures.
fn compare(what: &str, saved: &Run, loaded: &Run, tol: f64) {
    assert_eq!(
        saved.state.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        loaded.state.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        "{what}: state names"
    );
    assert!(saved.state.iter().any(|(k, _)| k == "adamw.m.wte.weight"));
    for ((k, a), (_, b)) in saved.state.iter().zip(&loaded.state) {
        assert!(a == b, "{what}: {k} differs after the load");
    }
    let mut worst = 0f64;
    for (step, got) in &loaded.losses {
        let (_, want) = saved.losses.iter().find(|(s, _)| s == step).unwrap();
        let rel = (got - want).abs() / want.abs();
        worst = worst.max(rel);
        assert!(
            rel <= tol,
            "{what}: step {step} loss {got} vs {want} uninterrupted (rel {rel:e})"
        );
    }
    println!(
        "{what}: {} tensors equal bit for bit; continued losses within {worst:.1e} relative \
         ({:?} vs {:?})",
        saved.state.len(),
        loaded.losses,
        &saved.losses[BEFORE..]
    );
}

/// Losses across layouts sum gradients in a different order: the continued run may differ by
/// rounding (measured below 1e-6; the layout tests allow 1e-5).
const ACROSS: f64 = 1e-6;

#[test]
fn fsdp4_resumes_under_dp2_tp2_and_single_device() {
    let dir = scratch("fsdp4");
    let saved = run("fsdp=4", &dir, false);
    compare(
        "fsdp=4 -> dp=2,tp=2",
        &saved,
        &run("dp=2,tp=2", &dir, true),
        ACROSS,
    );
    compare("fsdp=4 -> single", &saved, &run("dp=1", &dir, true), ACROSS);
    // The save wrote four rank files (one shard each), the index and the extra file.
    let ck = Checkpoint::open(&dir).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(ck.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    let want = [
        "config.json",
        "index.json",
        "rank-00000.safetensors",
        "rank-00001.safetensors",
        "rank-00002.safetensors",
        "rank-00003.safetensors",
    ];
    assert_eq!(files, want);
    assert_eq!(ck.read_file("config.json").unwrap(), b"{\"n_layer\": 2}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tp2_resumes_under_fsdp2() {
    let dir = scratch("tp2");
    let saved = run("tp=2", &dir, false);
    compare("tp=2 -> fsdp=2", &saved, &run("fsdp=2", &dir, true), ACROSS);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn dp2_tp2_resumes_under_zero1_4() {
    let dir = scratch("dp2tp2");
    let saved = run("dp=2,tp=2", &dir, false);
    // Data-parallel replicas offer identical pieces: each is written once, by one of them.
    let ck = Checkpoint::open(&dir).unwrap();
    for t in ck.tensors() {
        let parts = t.split_scheme().map_or(1, |s| s.degree);
        assert_eq!(t.pieces.len(), parts, "{} written once per part", t.name);
    }
    compare(
        "dp=2,tp=2 -> zero1=4",
        &saved,
        &run("zero1=4", &dir, true),
        ACROSS,
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn single_device_resumes_under_fsdp2_tp2_and_itself_bitwise() {
    let dir = scratch("single");
    let saved = run("dp=1", &dir, false);
    compare(
        "single -> fsdp=2,tp=2",
        &saved,
        &run("fsdp=2,tp=2", &dir, true),
        ACROSS,
    );
    compare("single -> single", &saved, &run("dp=1", &dir, true), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn same_layout_resume_is_bitwise() {
    let dir = scratch("fsdp2");
    let saved = run("fsdp=2", &dir, false);
    compare("fsdp=2 -> fsdp=2", &saved, &run("fsdp=2", &dir, true), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hsdp_resumes_under_tp2() {
    // Hybrid sharding: the two replicas offer identical segments, each written once.
    let dir = scratch("hsdp");
    let saved = run("hsdp=2x2", &dir, false);
    compare("hsdp=2x2 -> tp=2", &saved, &run("tp=2", &dir, true), ACROSS);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Each parameter's exact weights in a full state: AdamW's f32 master of a half-precision
/// parameter (`adamw.master.<name>`, a replicated rank's) when the state has one, else the
/// parameter (ZeRO's parameters are its f32 master shards).
fn exact_weights(state: &State) -> Vec<(String, Vec<u64>)> {
    let masters: HashMap<&str, &Vec<u64>> = state
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("adamw.master.")?, v)))
        .collect();
    state
        .iter()
        .filter(|(k, _)| !k.starts_with("adamw."))
        .map(|(k, v)| (k.clone(), masters.get(k.as_str()).map_or(v, |m| *m).clone()))
        .collect()
}

/// A bf16 run's f32 master weights survive a move between replicated and ZeRO layouts bit for
/// bit, both ways: a replicated checkpoint keeps them as optimizer state and ZeRO as its
/// parameters (rounding them to bf16 instead would change them by up to 2^-9 relative).
#[test]
fn bf16_master_weights_move_between_replicated_and_zero_layouts_exactly() {
    for (from, to) in [("dp=1", "fsdp=2"), ("fsdp=2", "dp=1"), ("tp=2", "zero1=2")] {
        let dir = scratch(&format!("bf16-{from}-{to}").replace([',', '='], ""));
        let saved = run_in(from, &dir, false, DType::BF16);
        let loaded = run_in(to, &dir, true, DType::BF16);
        let (want, got) = (exact_weights(&saved.state), exact_weights(&loaded.state));
        assert_eq!(want.len(), got.len(), "{from} -> {to}");
        assert!(want.iter().any(|(k, _)| k == "wte.weight"));
        for ((k, a), (gk, b)) in want.iter().zip(&got) {
            assert_eq!(k, gk, "{from} -> {to}");
            assert!(
                a == b,
                "{from} -> {to}: the master weights of {k} changed in the move"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A rank whose pieces are wrong, or pieces that do not cover a tensor, fail the save on every
/// rank with the same one-line error, before anything is written.
#[test]
fn a_failing_rank_fails_the_save_everywhere_and_nothing_is_published() {
    let dir = scratch("fail");
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    let errs = run_ranks(2, &opts, |ctx| {
        let t = Tensor::zeros(4, DType::F32, Device::Cpu)?;
        let piece = |range: std::ops::Range<usize>, data: Tensor| Piece {
            name: "w".into(),
            role: Role::Parameter,
            shape: vec![8],
            split: None,
            range: Some(range),
            data,
        };
        let save = |p: Piece| {
            checkpoint::save(
                &dir,
                "step-000001",
                vec![p],
                ctx.comm.as_ref(),
                &SaveOptions::default(),
            )
            .unwrap_err()
            .to_string()
        };
        // Rank 1 describes 4 elements but holds 3.
        let bad = if ctx.rank == 1 {
            t.narrow(0, 0, 3)?
        } else {
            t.clone()
        };
        let e1 = save(piece(4 * ctx.rank..4 * ctx.rank + 4, bad));
        // Both ranks offer elements 0..4: 4..8 are in no piece.
        let e2 = save(piece(0..4, t.clone()));
        Ok((e1, e2))
    })
    .unwrap();
    for (e1, e2) in &errs {
        assert!(
            e1.contains("rank 1") && e1.contains("holds 3 elements"),
            "{e1}"
        );
        assert!(
            e2.contains("tensor w") && e2.contains("elements 4..8"),
            "{e2}"
        );
        assert!(!e1.contains('\n') && !e2.contains('\n'));
    }
    assert_eq!(errs[0], errs[1], "every rank reports the same error");
    println!("{}\n{}", errs[0].0, errs[0].1);
    assert_eq!(checkpoint::latest(&dir).unwrap(), None);
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing written"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Pipeline stages (two, the tied table on both) load the parameters they hold by name from a
/// single-device checkpoint, and save them again: the tied table is written once and the
/// result loads into a single-device model bit for bit.
#[test]
fn pipeline_stages_load_and_save_what_they_hold() {
    let dir = scratch("pp");
    let cfg = gpt_config();
    let reference = Gpt::new(cfg, SEED + 1, DType::F32, Device::Cpu).unwrap();
    checkpoint::save_single(
        &dir,
        "step-000000",
        pieces_of_module(&reference).unwrap(),
        &SaveOptions::default(),
    )
    .unwrap();
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    run_ranks(2, &opts, |ctx| {
        let specs = StageSpec::split(cfg.n_layer, &[1, 1])?;
        let stage = Gpt::build_stage(cfg, specs[ctx.rank].clone(), ParamBuilder::new(SEED))?;
        let ck = Checkpoint::open(&dir)?;
        let e = ck.load_into_module(&stage, true).unwrap_err().to_string();
        assert!(e.contains("has parameters the model does not"), "{e}");
        ck.load_into_module(&stage, false)?;
        for (name, p) in stage.named_parameters() {
            let want = ck.read_full(&name)?;
            assert_eq!(p.tensor().to_vec::<f32>()?, want.to_vec::<f32>()?, "{name}");
        }
        let name = checkpoint::checkpoint_name(1);
        checkpoint::save(
            &dir,
            &name,
            pieces_of_module(&stage)?,
            ctx.comm.as_ref(),
            &SaveOptions::default(),
        )?;
        Ok(())
    })
    .unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.name(), "step-000001");
    let wte = ck.tensor("wte.weight").unwrap();
    assert_eq!(wte.pieces.len(), 1, "the tied table is written once");
    let model = Gpt::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    ck.load_into_module(&model, true).unwrap();
    for ((name, a), (_, b)) in model
        .named_parameters()
        .iter()
        .zip(reference.named_parameters())
    {
        assert_eq!(
            a.tensor().to_vec::<f32>().unwrap(),
            b.tensor().to_vec::<f32>().unwrap(),
            "{name}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A small checkpoint written by one process.
fn save_tiny(dir: &Path, step: u64) -> PathBuf {
    let t = Tensor::from_vec(vec![step as f32; 6], (2, 3), Device::Cpu).unwrap();
    let opts = SaveOptions {
        metadata: serde_json::json!({ "step": step }),
        files: Vec::new(),
    };
    checkpoint::save_single(
        dir,
        &checkpoint::checkpoint_name(step),
        vec![Piece::whole("w", Role::Parameter, t)],
        &opts,
    )
    .unwrap()
}

#[test]
fn publish_is_atomic_and_leftovers_are_cleaned() {
    let dir = scratch("atomic");
    assert_eq!(checkpoint::latest(&dir).unwrap(), None);
    for step in [1, 2, 3, 4] {
        save_tiny(&dir, step);
    }
    let name =
        |p: Option<PathBuf>| p.map(|p| p.file_name().unwrap().to_string_lossy().into_owned());
    assert_eq!(
        name(checkpoint::latest(&dir).unwrap()).as_deref(),
        Some("step-000004")
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("latest")).unwrap(),
        "step-000004\n"
    );
    // A save killed before its publish: a temporary directory with a partial file.
    let killed = dir.join(".tmp-step-000005");
    std::fs::create_dir(&killed).unwrap();
    std::fs::write(killed.join("rank-00000.safetensors"), b"partial").unwrap();
    std::fs::write(dir.join(".latest.tmp-99-0"), b"step-0000").unwrap();
    assert_eq!(
        name(checkpoint::latest(&dir).unwrap()).as_deref(),
        Some("step-000004")
    );
    assert_eq!(checkpoint::list(&dir).unwrap().len(), 4);
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.metadata()["step"], 4);
    assert_eq!(
        ck.read_full("w").unwrap().to_vec::<f32>().unwrap(),
        vec![4.0; 6]
    );
    let removed = checkpoint::cleanup(&dir).unwrap();
    assert_eq!(removed.len(), 2, "{removed:?}");
    assert!(!killed.exists());
    // A complete checkpoint is never modified: saving the same name again is refused.
    let before = std::fs::read(dir.join("step-000004/rank-00000.safetensors")).unwrap();
    let t = Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap();
    let e = checkpoint::save_single(
        &dir,
        "step-000004",
        vec![Piece::whole("w", Role::Parameter, t)],
        &SaveOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("already exists") && !e.contains('\n'), "{e}");
    assert_eq!(
        std::fs::read(dir.join("step-000004/rank-00000.safetensors")).unwrap(),
        before
    );
    // A save killed between its rename and the pointer switch: the newer complete checkpoint
    // is the latest.
    std::fs::write(dir.join("latest"), "step-000003\n").unwrap();
    assert_eq!(
        name(checkpoint::latest(&dir).unwrap()).as_deref(),
        Some("step-000004")
    );
    // keep: the newest two stay.
    let gone = checkpoint::keep(&dir, 2).unwrap();
    assert_eq!(gone, vec![dir.join("step-000001"), dir.join("step-000002")]);
    let left: Vec<_> = checkpoint::list(&dir).unwrap();
    assert_eq!(left, vec![dir.join("step-000003"), dir.join("step-000004")]);
    // ... and never the one `latest` names, even with k = 0.
    std::fs::write(dir.join("latest"), "step-000004\n").unwrap();
    checkpoint::keep(&dir, 0).unwrap();
    assert_eq!(
        checkpoint::list(&dir).unwrap(),
        vec![dir.join("step-000004")]
    );
    assert!(checkpoint::cleanup(&dir).unwrap().is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn missing_pieces_files_and_tensors_are_one_line_errors() {
    let dir = scratch("missing");
    let cfg = gpt_config();
    // Saved under fsdp=2: two rank files, each parameter in segments.
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    run_ranks(2, &opts, |ctx| {
        let layout: ParallelLayout = "fsdp=2".parse()?;
        let mesh = layout.mesh(ctx.comm.clone())?;
        let model = Gpt::new(cfg, SEED, DType::F32, Device::Cpu)?;
        let groups = param_groups_for_decay(model.named_parameters(), 0.1);
        let wrapper = DataParallel::new(&model, &mesh, groups, OptKind::AdamW)?;
        let z = wrapper.sharded().expect("sharded");
        checkpoint::save(
            &dir,
            "step-000000",
            z.local_pieces()?,
            ctx.comm.as_ref(),
            &SaveOptions::default(),
        )?;
        Ok(())
    })
    .unwrap();
    let ck_dir = dir.join("step-000000");
    let index_path = ck_dir.join("index.json");
    let index = std::fs::read_to_string(&index_path).unwrap();
    let model = Gpt::new(cfg, SEED + 1, DType::F32, Device::Cpu).unwrap();
    let one_line = |e: String, needles: &[&str]| {
        assert!(!e.contains('\n'), "{e}");
        for n in needles {
            assert!(e.contains(n), "{e} should name {n}");
        }
        println!("{e}");
    };
    // A piece removed from the index: opening fails naming the tensor.
    let mut v: serde_json::Value = serde_json::from_str(&index).unwrap();
    let t = v["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == "h.0.mlp.c_fc.weight")
        .unwrap();
    assert_eq!(t["pieces"].as_array().unwrap().len(), 2);
    t["pieces"].as_array_mut().unwrap().pop();
    std::fs::write(&index_path, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = Checkpoint::open(&ck_dir).unwrap_err().to_string();
    one_line(e, &["h.0.mlp.c_fc.weight", "in no piece", "index.json"]);
    // A tensor removed from the index: loading fails naming it.
    let mut v: serde_json::Value = serde_json::from_str(&index).unwrap();
    v["tensors"]
        .as_array_mut()
        .unwrap()
        .retain(|t| t["name"] != "ln_f.weight");
    std::fs::write(&index_path, serde_json::to_vec(&v).unwrap()).unwrap();
    let e = Checkpoint::open(&ck_dir)
        .unwrap()
        .load_into_module(&model, true)
        .unwrap_err()
        .to_string();
    one_line(e, &["ln_f.weight", "step-000000"]);
    // A rank file deleted: opening fails naming the file (every piece is checked against its
    // file's header when the checkpoint is opened).
    std::fs::write(&index_path, &index).unwrap();
    let rank1 = ck_dir.join("rank-00001.safetensors");
    let saved = std::fs::read(&rank1).unwrap();
    std::fs::remove_file(&rank1).unwrap();
    let e = Checkpoint::open(&ck_dir).unwrap_err().to_string();
    one_line(e, &["rank-00001.safetensors"]);
    // A truncated rank file: the same.
    std::fs::write(&rank1, &saved[..saved.len() / 2]).unwrap();
    let e = Checkpoint::open(&ck_dir).unwrap_err().to_string();
    one_line(e, &["rank-00001.safetensors"]);
    std::fs::write(&rank1, &saved).unwrap();
    // An index that claims more than its files hold (a tensor 10^12 times larger, with its
    // pieces' ranges to match) is refused when opened, before anything is allocated at the
    // size it claims; so is a shape whose size overflows, and a split whose chunks x degree
    // wraps around to 0.
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = serde_json::from_str(&index).unwrap();
        let t = v["tensors"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|t| t["name"] == "wte.weight")
            .unwrap();
        f(t);
        std::fs::write(&index_path, serde_json::to_vec(&v).unwrap()).unwrap();
        Checkpoint::open(&ck_dir).unwrap_err().to_string()
    };
    let e = edit(&|t| {
        let scale = 1_000_000_000_000u64;
        t["shape"][0] = serde_json::json!(t["shape"][0].as_u64().unwrap() * scale);
        for p in t["pieces"].as_array_mut().unwrap() {
            if let Some(r) = p["range"].as_array_mut() {
                let (a, b) = (r[0].as_u64().unwrap(), r[1].as_u64().unwrap());
                *r = vec![serde_json::json!(a * scale), serde_json::json!(b * scale)];
            }
        }
    });
    one_line(e, &["wte.weight", "the index says"]);
    let e = edit(&|t| t["shape"] = serde_json::json!([u64::MAX, 4]));
    one_line(e, &["wte.weight", "too large"]);
    let e = edit(&|t| {
        for p in t["pieces"].as_array_mut().unwrap() {
            p["split"] = serde_json::json!({
                "dim": 0, "chunks": (1u64 << 63), "degree": 2, "index": 0, "mesh_dim": "tp"
            });
        }
    });
    one_line(e, &["wte.weight", "overflows"]);
    std::fs::write(&index_path, &index).unwrap();
    // Another model size: the shape mismatch names the tensor and both shapes.
    let small = Gpt::new(
        GptConfig { n_embd: 16, ..cfg },
        SEED,
        DType::F32,
        Device::Cpu,
    )
    .unwrap();
    let ck = Checkpoint::open(&ck_dir).unwrap();
    let e = ck.load_into_module(&small, true).unwrap_err().to_string();
    one_line(e, &["wte.weight", "[64, 32]", "[64, 16]"]);
    // Intact, it loads: the parameters equal the saved model's.
    ck.load_into_module(&model, true).unwrap();
    let want = Gpt::new(cfg, SEED, DType::F32, Device::Cpu).unwrap();
    for ((n, a), (_, b)) in model.named_parameters().iter().zip(want.named_parameters()) {
        assert_eq!(
            a.tensor().to_vec::<f32>().unwrap(),
            b.tensor().to_vec::<f32>().unwrap(),
            "{n}"
        );
    }
    // No optimizer state was saved (no step yet beyond the empty state): AdamW's count is there.
    assert!(ck.tensor("optim/adamw.step_count").is_some());
    std::fs::remove_dir_all(&dir).unwrap();
}
