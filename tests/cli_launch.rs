//! `meshgrad launch` through the binary (issue 12, launcher): torchrun's variables reach every
//! rank, output lines carry the rank, the rendezvous store works across the processes, a failed
//! or killed rank stops the job within 30 s naming the rank with no process left behind,
//! `meshgrad train` in the launched processes trains over TCP bit for bit like the same layout
//! as threads (GPT dp=2, cp=2, pp=2,tp=2 with sequence parallelism, BERT fsdp=2), and a train that
//! cannot join its processes (no store, no layout, another world size, ranks as threads) fails in
//! one line. Uses the hidden `meshgrad launch-probe` subcommand as the child. With the `mpi`
//! feature and mpirun on PATH, the same failures under `--backend mpi` (ranks waiting in MPI
//! collectives): a killed rank and a panicking rank end the job within 30 s, named, with no rank
//! left running. `--backend nccl` without the `nccl` feature or a GPU fails in one line saying
//! why; with both, a world of one trains through the launcher like the threads backend.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, assert_one_line_error, bin, text};

/// A fresh launcher command without any rank variables inherited from the test's environment.
fn launcher() -> Command {
    let mut c = bin();
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "SLURM_PROCID",
        "MESHGRAD_BACKEND",
    ] {
        c.env_remove(v);
    }
    c
}

/// `rank -> (the probe's key=value fields)` from the launcher's stdout.
fn probes(stdout: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix("[rank ") else {
            panic!("line without a rank prefix: {line:?}");
        };
        let (rank, body) = rest.split_once("] ").unwrap();
        if !body.starts_with("rank=") {
            continue;
        }
        let fields: BTreeMap<String, String> = body
            .split(' ')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(fields["rank"], rank, "{line}");
        out.insert(rank.parse().unwrap(), fields);
    }
    out
}

fn gone(pid: &str) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn launch_sets_torchrun_variables_prefixes_lines_and_shares_a_store() {
    let o = launcher()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--",
            "launch-probe",
            "--store",
        ])
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, err) = text(&o);
    let p = probes(&out);
    assert_eq!(p.len(), 2, "{out}");
    let port = &p[&0]["master"];
    for r in 0..2 {
        let f = &p[&r];
        assert_eq!(f["world_size"], "2");
        assert_eq!(f["local_rank"], r.to_string());
        assert_eq!(f["local_world_size"], "2");
        assert_eq!(f["node_rank"], "0");
        assert_eq!(f["source"], "Torchrun");
        assert_eq!(&f["master"], port);
        assert!(port.starts_with("127.0.0.1:"), "{port}");
    }
    // Both ranks read both pids through rank 0's TCP store.
    let pids = format!("store pids={},{}", p[&0]["pid"], p[&1]["pid"]);
    for r in 0..2 {
        assert!(out.contains(&format!("[rank {r}] {pids}\n")), "{out}");
        assert!(err.contains(&format!("[rank {r}] probe stderr\n")), "{err}");
    }
}

#[test]
fn launch_of_a_second_node_numbers_its_ranks_after_the_first() {
    let o = launcher()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "localhost",
            "--master-port",
            "29999",
            "--",
            "launch-probe",
        ])
        .output()
        .unwrap();
    assert_ok(&o);
    let p = probes(&text(&o).0);
    assert_eq!(p.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
    for (r, f) in &p {
        assert_eq!(f["world_size"], "4");
        assert_eq!(f["local_rank"], (r - 2).to_string());
        assert_eq!(f["node_rank"], "1");
        assert_eq!(f["master"], "localhost:29999");
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_is_named() {
    // Rank 1 exits 3 after a second; ranks 0 and 2 would sleep two minutes.
    let t0 = Instant::now();
    let o = launcher()
        .args(["launch", "--nproc-per-node", "3", "--", "launch-probe"])
        .args(["--exit-rank", "1", "--exit-delay", "1", "--sleep", "120"])
        .output()
        .unwrap();
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    let (out, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.ends_with("error: rank 1 exited with status 3; stopped the other 2 running rank(s)\n"),
        "{err}"
    );
    let p = probes(&out);
    assert_eq!(p.len(), 3, "{out}");
    for f in p.values() {
        assert!(
            gone(&f["pid"]),
            "rank {} (pid {}) still runs",
            f["rank"],
            f["pid"]
        );
    }
}

#[test]
fn a_rank_killed_by_a_signal_and_ranks_ignoring_sigterm_are_stopped() {
    // The ranks ignore SIGTERM, so the launcher has to escalate to SIGKILL after its grace period.
    let t0 = Instant::now();
    let mut child = launcher()
        .args(["launch", "--nproc-per-node", "2", "--", "launch-probe"])
        .args(["--ignore-sigterm", "--sleep", "120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pids = BTreeMap::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while pids.len() < 2 {
        let line = lines.next().expect("the launcher ended early").unwrap();
        for (r, f) in probes(&line) {
            pids.insert(r, f["pid"].clone());
        }
    }
    let k = Command::new("kill")
        .args(["-KILL", &pids[&1]])
        .status()
        .unwrap();
    assert!(k.success());
    let o = child.wait_with_output().unwrap();
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(
        err.ends_with(
            "error: rank 1 was killed by signal 9 (SIGKILL); stopped the other 1 running rank(s)\n"
        ),
        "{err}"
    );
    assert!(gone(&pids[&0]) && gone(&pids[&1]), "{pids:?}");
}

#[test]
fn train_over_several_processes_needs_a_store_a_layout_and_a_backend_that_joins_them() {
    // torchrun's variables default to the TCP backend, which needs rank 0's store.
    let o = launcher()
        .args(["train", "--steps", "1", "--layout", "dp=2"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--backend tcp: MASTER_PORT is not set"]);
    // Ranks as threads cannot join processes.
    let o = launcher()
        .args(["train", "--steps", "1", "--backend", "threads"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_one_line_error(
        &o,
        &[
            "WORLD_SIZE=2 (torchrun's variables, rank 1)",
            "--backend tcp",
            "--layout dp=2",
        ],
    );
    let o = launcher()
        .args(["train", "--steps", "1", "--backend", "tcp"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--backend tcp: this process was not started by"]);
    let o = launcher()
        .args(["train", "--steps", "1"])
        .env("SLURM_PROCID", "0")
        .env("SLURM_NTASKS", "4")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["SLURM_NTASKS=4 (Slurm's variables, rank 0)"]);
    let o = launcher()
        .args(["train", "--steps", "1"])
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["RANK=2 is not below WORLD_SIZE=2"]);
    // Through the launcher: without a layout, or with one of another size, every rank refuses
    // and the launcher names one.
    for (extra, needle) in [
        (
            &[][..],
            "] error: --backend tcp: give a --layout of 2 ranks (WORLD_SIZE)",
        ),
        (
            &["--layout", "dp=3"][..],
            "] error: --layout dp=3 needs 3 ranks, but this is one of 2 processes",
        ),
    ] {
        let o = launcher()
            .args(["launch", "--nproc-per-node", "2", "--"])
            .args(["train", "--steps", "1"])
            .args(extra)
            .output()
            .unwrap();
        let (_, err) = text(&o);
        assert!(!o.status.success());
        assert!(err.contains(needle), "{err}");
        assert!(
            err.lines().last().unwrap().starts_with("error: rank "),
            "{err}"
        );
    }
}

/// Trains `steps` steps into `dir/tag` through `meshgrad launch --nproc-per-node n` (over TCP)
/// when `n` is given, else as threads of one process; returns the metrics lines without their
/// timings and the exported weights' bytes.
fn train_run(
    dir: &Path,
    tag: &str,
    n: Option<usize>,
    steps: usize,
    args: &[&str],
) -> (Vec<serde_json::Value>, Vec<u8>) {
    let mut c = launcher();
    if let Some(n) = n {
        c.args(["launch", "--nproc-per-node", &n.to_string(), "--"]);
    }
    c.args(["train", "--steps", &steps.to_string()])
        .args(["--out", dir.join(tag).to_str().unwrap()])
        .args([
            "--metrics",
            dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
        ])
        .args(args);
    assert_ok(&c.output().unwrap());
    let lines = std::fs::read_to_string(dir.join(format!("{tag}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            m.retain(|k, _| !k.contains("time") && !k.contains("tok") && !k.ends_with("_s"));
            v
        })
        .collect();
    let weights = std::fs::read(dir.join(tag).join("model.safetensors")).unwrap();
    (lines, weights)
}

#[test]
fn processes_over_tcp_train_bit_for_bit_like_threads() {
    let dir = common::tmpdir("launch-tcp");
    let bert = [
        "--set",
        "model.kind=bert",
        "--set",
        "model.n_layer=2",
        "--set",
        "model.n_embd=64",
        "--set",
        "model.n_head=4",
        "--set",
        "model.block_size=64",
        "--set",
        "train.batch_size=8",
    ];
    let runs: [(&str, usize, Vec<&str>); 4] = [
        ("dp2", 2, vec!["--layout", "dp=2"]),
        // Ring attention's hops are the TCP communicator's sends and receives.
        (
            "cp2",
            2,
            vec![
                "--layout",
                "cp=2",
                "--set",
                "model.n_layer=2",
                "--set",
                "model.block_size=32",
            ],
        ),
        (
            "pp2tp2",
            4,
            vec!["--layout", "pp=2,tp=2", "--sequence-parallel"],
        ),
        (
            "bert_fsdp2",
            2,
            [&["--layout", "fsdp=2"][..], &bert[..]].concat(),
        ),
    ];
    for (tag, n, args) in &runs {
        let (threads, tw) = train_run(&dir, &format!("{tag}-threads"), None, 4, args);
        let (tcp, pw) = train_run(&dir, &format!("{tag}-tcp"), Some(*n), 4, args);
        assert_eq!(threads.len(), 4, "{tag}: {threads:?}");
        assert_eq!(tcp, threads, "{tag}: metrics over TCP vs threads");
        assert!(tw == pw, "{tag}: exported weights differ over TCP");
    }
}

#[test]
fn launch_arguments_are_checked() {
    let o = launcher()
        .args(["launch", "--nproc-per-node", "2"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["nothing to run"]);
    let o = launcher()
        .args([
            "launch",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "2",
        ])
        .args(["--", "launch-probe"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--node-rank 2 is not below --nnodes 2"]);
    // No mpirun on PATH.
    let o = launcher()
        .env("PATH", "")
        .args(["launch", "--backend", "mpi", "--nproc-per-node", "2", "--"])
        .arg("launch-probe")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--backend mpi needs mpirun on PATH"]);
}

#[test]
fn launch_through_mpirun_when_present() {
    let has_mpirun = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false);
    if !has_mpirun {
        eprintln!("skipped: no mpirun on PATH");
        return;
    }
    let o = launcher()
        .args(["launch", "--backend", "mpi", "--nproc-per-node", "2", "--"])
        .args(["launch-probe", "--store"])
        .output()
        .unwrap();
    assert_ok(&o);
    let (out, _) = text(&o);
    let p = probes(&out);
    assert_eq!(p.len(), 2, "{out}");
    for (r, f) in &p {
        assert_eq!(f["world_size"], "2");
        assert_eq!(f["local_rank"], r.to_string());
        assert_eq!(f["source"], "OpenMpi");
    }
    let o = launcher()
        .args(["launch", "--backend", "mpi", "--nproc-per-node", "2", "--"])
        .args([
            "launch-probe",
            "--exit-rank",
            "1",
            "--exit-delay",
            "0.5",
            "--sleep",
            "120",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let (_, err) = text(&o);
    assert!(
        err.lines()
            .last()
            .unwrap()
            .starts_with("error: rank 1 exited with status 3; mpirun stopped the other ranks"),
        "{err}"
    );
}

/// Whether mpirun is on PATH (the MPI tests below skip without it).
#[cfg(feature = "mpi")]
fn has_mpirun() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()))
        .unwrap_or(false)
}

/// Waits up to 10 s for every pid to be gone (a rank killed by mpirun may stay a zombie until
/// init reaps it: dead, but listed); returns the pids still running (listed and not zombies).
#[cfg(feature = "mpi")]
fn still_running(pids: &[String]) -> Vec<String> {
    let running = |pid: &String| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                // `pid (comm) S ...`: the state follows the command's closing parenthesis.
                let state = s.rsplit_once(')').map(|(_, r)| r.trim_start());
                !state.is_some_and(|r| r.starts_with('Z'))
            })
            .unwrap_or(false)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<String> = pids.iter().filter(|p| !gone(p)).cloned().collect();
        if left.is_empty() || Instant::now() >= deadline {
            return left.into_iter().filter(running).collect();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Starts `launch --backend mpi --nproc-per-node 4 -- launch-probe --mpi ARGS` (ranks waiting in
/// MPI all-reduces) and returns it with the ranks' pids once all four printed theirs.
#[cfg(feature = "mpi")]
fn mpi_probes(args: &[&str]) -> (std::process::Child, Vec<String>, Instant) {
    let t0 = Instant::now();
    let mut child = launcher()
        .args(["launch", "--backend", "mpi", "--nproc-per-node", "4", "--"])
        .args(["launch-probe", "--mpi"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut pids = BTreeMap::new();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while pids.len() < 4 {
        let Some(Ok(line)) = lines.next() else {
            break;
        };
        for (r, f) in probes(&line) {
            pids.insert(r, f["pid"].clone());
        }
    }
    // Keep draining stdout so that no rank blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, pids.into_values().collect(), t0)
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_launch_names_a_killed_rank_and_leaves_no_process() {
    if !has_mpirun() {
        eprintln!("skipped: no mpirun on PATH");
        return;
    }
    // Four MPI ranks all-reduce for two minutes; rank 2 gets SIGKILL while the others wait in
    // a collective for it.
    let (child, pids, t0) = mpi_probes(&["--sleep", "120"]);
    assert_eq!(pids.len(), 4, "{pids:?}");
    std::thread::sleep(Duration::from_millis(500));
    let k = Command::new("kill")
        .args(["-KILL", &pids[2]])
        .status()
        .unwrap();
    assert!(k.success());
    let o = child.wait_with_output().unwrap();
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap()
            .starts_with("error: rank 2 was killed by signal 9 (SIGKILL); mpirun stopped"),
        "{err}"
    );
    let left = still_running(&pids);
    assert!(left.is_empty(), "ranks still running: {left:?} of {pids:?}");
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_launch_ends_the_job_when_a_rank_panics() {
    if !has_mpirun() {
        eprintln!("skipped: no mpirun on PATH");
        return;
    }
    // Rank 1 panics after half a second while the others wait for it in an all-reduce: the
    // panic hook's MPI_Abort ends the job (without it the others would wait for ever).
    let (child, pids, t0) =
        mpi_probes(&["--panic-rank", "1", "--exit-delay", "0.5", "--sleep", "120"]);
    let o = child.wait_with_output().unwrap();
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    let (_, err) = text(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("[rank 1] ") && err.contains("a deliberate panic on rank 1"),
        "{err}"
    );
    assert!(
        err.lines().last().unwrap().starts_with(
            "error: rank 1 aborted the MPI job (MPI_Abort with error code 101); mpirun stopped"
        ),
        "{err}"
    );
    let left = still_running(&pids);
    assert!(left.is_empty(), "ranks still running: {left:?} of {pids:?}");
}

/// Whether this test binary's meshgrad has NCCL and a GPU to run it on.
fn nccl_runs_here() -> bool {
    #[cfg(feature = "nccl")]
    {
        meshgrad::tensor::cuda_device_count() > 0
    }
    #[cfg(not(feature = "nccl"))]
    false
}

/// The reason `--backend nccl` cannot run in this build on this machine.
fn nccl_refusal() -> &'static str {
    if cfg!(feature = "nccl") {
        "--backend nccl: no CUDA device is visible"
    } else {
        "--backend nccl: meshgrad was built without NCCL support: rebuild with `cargo build --release --features nccl`"
    }
}

/// Without the `nccl` feature, or without a GPU, `--backend nccl` fails at once in one line
/// saying why, from the launcher and from `meshgrad train` (flag or MESHGRAD_BACKEND).
#[test]
fn nccl_backend_without_nccl_or_gpu_is_refused_in_one_line() {
    if nccl_runs_here() {
        println!("skipped: NCCL and a GPU are here (the GPU test covers this build)");
        return;
    }
    let o = launcher()
        .args(["launch", "--backend", "nccl", "--nproc-per-node", "1", "--"])
        .arg("launch-probe")
        .output()
        .unwrap();
    assert_one_line_error(&o, &[nccl_refusal()]);
    let o = launcher()
        .args([
            "train",
            "--steps",
            "1",
            "--layout",
            "dp=1",
            "--backend",
            "nccl",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&o, &[nccl_refusal()]);
    let o = launcher()
        .args(["train", "--steps", "1", "--layout", "dp=1"])
        .env("MESHGRAD_BACKEND", "nccl")
        .output()
        .unwrap();
    assert_one_line_error(&o, &[nccl_refusal()]);
    let o = launcher()
        .args(["train", "--steps", "1"])
        .env("MESHGRAD_BACKEND", "gloo")
        .output()
        .unwrap();
    assert_one_line_error(
        &o,
        &["unknown backend \"gloo\" (expected threads, tcp, mpi or nccl)"],
    );
    let o = launcher()
        .args(["train", "--steps", "1", "--backend", "mpi"])
        .output()
        .unwrap();
    assert_one_line_error(
        &o,
        &["--backend mpi: this process was not started by mpirun"],
    );
}

/// The GPU check through the launcher (world size 1; NCCL refuses two ranks on one GPU, so a
/// one-GPU machine cannot run more): `meshgrad launch --backend nccl --nproc-per-node 1 --
/// train --layout dp=1` trains over NCCL and logs the same losses as the same run with ranks
/// as threads, to rounding. Skips with the reason without the feature or a GPU, unless
/// MESHGRAD_REQUIRE_CUDA=1, which makes that a failure.
#[test]
fn nccl_launch_trains_like_threads_on_one_gpu() {
    if !nccl_runs_here() {
        let why = if cfg!(feature = "nccl") {
            "no CUDA device"
        } else {
            "built without --features nccl"
        };
        assert!(
            std::env::var("MESHGRAD_REQUIRE_CUDA").as_deref() != Ok("1"),
            "MESHGRAD_REQUIRE_CUDA=1 but NCCL cannot run here: {why}"
        );
        println!("skipped: {why}");
        return;
    }
    let dir = common::tmpdir("nccl-launch");
    let sets = [
        "model.n_layer=1",
        "model.n_embd=32",
        "model.n_head=2",
        "model.block_size=32",
        "train.batch_size=8",
        "train.eval_batches=1",
        "train.eval_interval=2",
        "train.sample_tokens=0",
    ];
    let run = |tag: &str, launch: bool| {
        let mut c = launcher();
        if launch {
            c.args(["launch", "--backend", "nccl", "--nproc-per-node", "1", "--"]);
        }
        c.args(["train", "--steps", "3", "--layout", "dp=1"]);
        c.args(["--out", dir.join(tag).to_str().unwrap()]);
        c.args([
            "--metrics",
            dir.join(format!("{tag}.jsonl")).to_str().unwrap(),
        ]);
        for s in sets {
            c.args(["--set", s]);
        }
        let o = c.output().unwrap();
        assert_ok(&o);
        common::metrics(&dir, tag)
    };
    let threads = run("threads", false);
    let nccl = run("nccl", true);
    common::assert_lockstep("nccl", &nccl, &threads, false);
}
