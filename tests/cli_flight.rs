//! The flight recorder through the binary (issue 8): a hang made on purpose (rank 2 of a 4-rank
//! TCP job stops itself with SIGSTOP through the `MESHGRAD_TEST_SIGSTOP` test hook) is reported
//! by the watchdog, the other ranks dump their records to OUT/flight/, and `meshgrad flight`
//! names the stopped rank and the call it did not join; SIGUSR1 dumps a running job's ranks;
//! bad input to `meshgrad flight` fails in one line.

use crate::common;

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{assert_ok, assert_one_line_error, bin, text};

/// A fresh command without rank variables inherited from the test's environment.
fn clean() -> Command {
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
        "MESHGRAD_TEST_SIGSTOP",
        "MESHGRAD_FLIGHT_RECORDER_SIZE",
    ] {
        c.env_remove(v);
    }
    c
}

/// Waits for `child` up to `limit`; kills it (SIGKILL) and reaps it when it runs longer.
/// Returns (finished in time, stdout, stderr).
fn wait_bounded(
    mut child: Child,
    limit: Duration,
) -> (bool, std::process::ExitStatus, String, String) {
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let mut in_time = true;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() >= deadline {
            in_time = false;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (in_time, status, o.join().unwrap(), e.join().unwrap())
}

/// SIGKILL to `pid` if it is still there (a stopped process ignores everything else).
fn kill_hard(pid: &str) {
    if Path::new(&format!("/proc/{pid}")).exists() {
        let _ = Command::new("kill").args(["-KILL", pid]).status();
    }
}

/// The (kind, sequence number) of the call the watchdog's error names: `[rank 0] error: rank
/// 0: all_reduce #17 on group [0,1,2,3]: rank 2 did not join within 5s`.
fn timed_out_call(text: &str) -> Option<(String, u64)> {
    let line = text.lines().find(|l| l.contains("did not join within"))?;
    let before = line.split(" on group ").next()?;
    let (prefix, seq) = before.rsplit_once(" #")?;
    let kind = prefix.rsplit(' ').next()?.to_string();
    Some((kind, seq.trim().parse().ok()?))
}

#[test]
fn a_rank_stopped_with_sigstop_is_named_with_the_call_it_did_not_join() {
    let dir = common::tmpdir("flight-sigstop");
    let out = dir.join("run");
    let child = clean()
        .args(["launch", "--nproc-per-node", "4", "--"])
        .args(["train", "--steps", "6", "--layout", "dp=4"])
        .args(["--collective-timeout", "5"])
        .args(["--out", out.to_str().unwrap()])
        // Rank 2 stops itself at the start of step 2 (0-based): the others wait for it in
        // that step's first collective.
        .env("MESHGRAD_TEST_SIGSTOP", "2:2")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (in_time, status, stdout, stderr) = wait_bounded(child, Duration::from_secs(240));
    let stopped_pid = stderr
        .lines()
        .find_map(|l| l.split_once("rank 2: test hook: stopping pid "))
        .and_then(|(_, rest)| rest.split(' ').next())
        .map(str::to_string);
    // Never leave the stopped rank behind (the launcher SIGKILLs and reaps it; this is the
    // safety net for a launcher that did not get that far).
    if let Some(pid) = &stopped_pid {
        kill_hard(pid);
    }
    assert!(
        in_time,
        "the job did not end within 240 s:\n{stdout}\n{stderr}"
    );
    assert!(
        !status.success(),
        "the job should fail:\n{stdout}\n{stderr}"
    );
    assert!(
        stopped_pid.is_some(),
        "the hook did not stop rank 2:\n{stderr}"
    );
    // The watchdog reports the timeout, naming the stopped rank.
    assert!(
        stderr.contains("rank 2 did not join within 5s"),
        "no watchdog report:\n{stderr}"
    );
    let (kind, seq) = timed_out_call(&stderr).expect("the watchdog's error names the call");
    // The other ranks dumped; the stopped one could not.
    let flight = out.join("flight");
    for r in [0, 1, 3] {
        let f = flight.join(format!("rank-{r}.json"));
        assert!(f.exists(), "{} missing:\n{stderr}", f.display());
        assert!(
            stderr.contains(&format!(
                "[rank {r}] flight recorder: wrote {}",
                f.display()
            )),
            "{stderr}"
        );
        let dump: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
        assert_eq!(dump["rank"], r);
        assert_eq!(dump["world_size"], 4);
        assert!(
            dump["reasons"][0]
                .as_str()
                .unwrap()
                .starts_with("watchdog: "),
            "{dump}"
        );
        let failed: Vec<&serde_json::Value> = dump["entries"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["state"] == "failed")
            .collect();
        assert_eq!(failed.len(), 1, "{dump}");
        assert_eq!(failed[0]["waiting_for"], serde_json::json!([2]));
        assert_eq!(failed[0]["kind"], kind.as_str());
        assert_eq!(failed[0]["seq"], seq);
    }
    assert!(!flight.join("rank-2.json").exists());

    let o = clean()
        .args(["flight", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_ok(&o);
    let (report, _) = text(&o);
    println!("{report}");
    let last = report.lines().last().unwrap();
    assert_eq!(
        last,
        format!("flight: behind=2 call={kind}#{seq}"),
        "{report}"
    );
    assert!(report.contains("rank 2: no dump"), "{report}");
    // The flight/ folder itself works too.
    let o = clean()
        .args(["flight", flight.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(text(&o).0.lines().last().unwrap(), last);
    if let Some(pid) = &stopped_pid {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "the stopped rank {pid} is still there"
        );
    }
}

#[test]
fn sigusr1_dumps_every_rank_of_a_running_job() {
    let dir = common::tmpdir("flight-sigusr1");
    let out = dir.join("run");
    let mut child = clean()
        .args(["train", "--steps", "100000", "--layout", "dp=2"])
        .args(["--out", out.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // Signal only once the run prints its header: the handler is installed by then (before it,
    // SIGUSR1 would end the process).
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines() {
            let _ = tx.send(line.unwrap_or_default());
        }
    });
    let started = rx.recv_timeout(Duration::from_secs(120));
    let flight = out.join("flight");
    let files = [flight.join("rank-0.json"), flight.join("rank-1.json")];
    let deadline = Instant::now() + Duration::from_secs(120);
    while started.is_ok() && !files.iter().all(|f| f.exists()) && Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        let _ = Command::new("kill").args(["-USR1", &pid]).status();
        std::thread::sleep(Duration::from_millis(500));
    }
    let _ = child.kill();
    let _ = child.wait();
    for f in &files {
        let dump: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display())),
        )
        .unwrap();
        assert!(
            dump["reasons"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r == "SIGUSR1"),
            "{dump}"
        );
    }
    let o = clean()
        .args(["flight", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert_ok(&o);
    let (report, _) = text(&o);
    assert!(
        report
            .lines()
            .last()
            .unwrap()
            .starts_with("flight: behind="),
        "{report}"
    );
}

#[test]
fn flight_fails_in_one_line_on_bad_input() {
    let dir = common::tmpdir("flight-bad");
    let o = clean()
        .args(["flight", dir.join("nope").to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["is not a folder"]);
    let o = clean()
        .args(["flight", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["no rank-R.json dumps in"]);
    std::fs::write(dir.join("rank-3.json"), "{ not json").unwrap();
    let o = clean()
        .args(["flight", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["rank-3.json", "malformed JSON"]);
}
