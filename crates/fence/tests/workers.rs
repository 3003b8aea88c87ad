//! The workers of other languages in `examples/` (Python with its standard library only, and
//! POSIX sh with curl), written from `docs/protocol.md` alone, against the real lease server
//! and `fence proxy`: a whole run, a stall past the lease that ends in a 409 at the
//! destination, and a successor redoing a committed write under the step's shared key.

mod common;

use std::{
    io::{BufRead, BufReader, Read, Write},
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::{Arc, Mutex},
    time::Duration,
};

use common::*;

fn example(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(path)
}

struct Setup {
    _dir: tempfile::TempDir,
    _server: Proc,
    _proxy: Proc,
    server: String,
    destination: String,
}

fn setup() -> Setup {
    setup_with(&start_upstream())
}

fn setup_with(upstream: &str) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (server, server_url) = start_server(&dir.path().join("leases"));
    let (proxy, addr) = start_proxy(&dir.path().join("proxy"), upstream);
    Setup {
        _dir: dir,
        _server: server,
        _proxy: proxy,
        server: server_url,
        destination: format!("http://{addr}/writes"),
    }
}

fn python(s: &Setup, job: &str, ttl_ms: u64, writes: u32, stall: f64) -> std::process::Child {
    Command::new("python3")
        .arg(example("python/worker.py"))
        .args([
            "--server",
            &s.server,
            "--destination",
            &s.destination,
            "--job",
            job,
        ])
        .args([
            "--ttl-ms",
            &ttl_ms.to_string(),
            "--writes",
            &writes.to_string(),
        ])
        .args(["--stall-before-send", &stall.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 is installed")
}

fn shell(
    s: &Setup,
    job: &str,
    ttl_ms: u64,
    writes: u32,
    stall: Option<&str>,
) -> std::process::Child {
    let mut cmd = Command::new("sh");
    cmd.arg(example("sh/worker.sh"))
        .env("SERVER", &s.server)
        .env("DESTINATION", &s.destination)
        .env("JOB", job)
        .env("TTL_MS", ttl_ms.to_string())
        .env("WRITES", writes.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(stall) = stall {
        cmd.env("STALL_BEFORE_SEND", stall);
    }
    cmd.spawn().expect("sh and curl are installed")
}

fn finished(child: std::process::Child) -> (Option<i32>, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = child.wait_with_output().unwrap();
    (
        status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&stdout),
            String::from_utf8_lossy(&stderr)
        ),
    )
}

#[test]
fn python_and_shell_workers_run_a_job_to_completion_through_the_proxy() {
    let s = setup();
    for (name, child) in [
        // 5 s leases: one renewal answered late on a loaded machine must not lose them.
        ("python", python(&s, "py-job", 5_000, 3, 0.0)),
        ("sh", shell(&s, "sh-job", 5_000, 3, None)),
    ] {
        let (code, said) = finished(child);
        assert_eq!(code, Some(0), "{name}: {said}");
        assert_eq!(
            said.matches(" 200\n").count(),
            3,
            "{name}: three writes: {said}"
        );
    }
    for job in ["py-job", "sh-job"] {
        let record = json(&fence(&["status", "--server", &s.server, "--job", job]));
        assert_eq!(record["state"], "completed", "{job}: {record}");
    }
}

/// Worker 1 decides to send its second write, then stalls (renewals included) past its
/// lease; worker 2 claims generation 2 and writes; worker 1's write then arrives with the
/// stale token and the destination refuses it: 409, and worker 1 stops with 75.
#[test]
fn a_worker_stalled_past_its_lease_is_refused_at_the_destination() {
    let s = setup();
    for lang in ["python", "sh"] {
        let job = format!("{lang}-stall");
        // A 3 s lease: a worker renews every third of it, and the sh one spawns some 15
        // processes per renewal; under a 600 ms lease one renewal late on a loaded machine
        // lost the lease before the second write was decided (75, no write 2 at all).
        let stalled = match lang {
            "python" => python(&s, &job, 3_000, 2, 8.0),
            _ => shell(&s, &job, 3_000, 2, Some("8")),
        };
        // Until its 3 s lease has expired at the server (however long the interpreter took
        // to start, and its first write and renewals); its 8 s stall outlasts the lease and
        // leaves the newer holder some 5 s to claim and write on a loaded machine.
        eventually(
            &format!("{lang}: the first worker's lease expires"),
            Duration::from_secs(30),
            || {
                let status = fence(&["status", "--server", &s.server, "--job", &job]);
                String::from_utf8_lossy(&status.stdout).contains(r#""state":"expired""#)
            },
        );
        let newer = match lang {
            "python" => python(&s, &job, 10_000, 1, 0.0),
            _ => shell(&s, &job, 10_000, 1, None),
        };
        let (code, said) = finished(newer);
        assert_eq!(code, Some(0), "{lang} newer holder: {said}");
        assert!(said.contains("generation 2"), "{lang}: {said}");
        let (code, said) = finished(stalled);
        assert!(
            said.contains("WRITE 2 409"),
            "{lang}: the stale write was refused: {said}"
        );
        assert_eq!(code, Some(75), "{lang}: {said}");
    }
}

/// An upstream answering 200 to everything that records each request's body.
fn recording_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&bodies);
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                loop {
                    let mut length = 0;
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    while line != "\r\n" {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if reader.read_exact(&mut body).is_err() {
                        return;
                    }
                    seen.lock()
                        .unwrap()
                        .push(String::from_utf8_lossy(&body).into_owned());
                    let ok = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n";
                    if stream.write_all(ok).is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, bodies)
}

/// Holder 1 sends `write 1` and it commits, but holder 1 never completes (its answer was
/// lost, it crashed). The Python worker, as holder 2, redoes write 1 under the step's key,
/// the same for every holder: the proxy answers with the stored result, and the upstream
/// runs the step once. (Until this version the key carried the generation, and it ran twice.)
#[test]
fn a_successor_redoing_a_committed_write_reaches_the_upstream_once() {
    let (upstream, bodies) = recording_upstream();
    let s = setup_with(&upstream);
    let job = "py-redo";
    let claim = fence(&["claim", "--server", &s.server, "--job", job, "--ttl", "10s"]);
    let first = json(&claim);
    let key = fence(&["idempotency-key", "--job", job, "--step", "write-1"]);
    let key = String::from_utf8(key.stdout).unwrap().trim().to_owned();
    let proxy = s.destination.trim_start_matches("http://");
    let (addr, path) = proxy.split_once('/').unwrap();
    let (status, answer) = exchange(
        addr,
        "POST",
        &format!("/{path}"),
        &[
            ("X-Fencing-Job", job.to_owned()),
            ("X-Fencing-Token", first["generation"].to_string()),
            ("Idempotency-Key", key),
        ],
        "write 1",
    );
    assert_eq!(status, 200, "{answer}");
    assert_success(&release(&s.server, job, &first));

    let (code, said) = finished(python(&s, job, 5_000, 1, 0.0));
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("generation 2"), "{said}");
    assert!(said.contains("WRITE 1 200"), "{said}");
    let seen = bodies.lock().unwrap().clone();
    assert_eq!(
        seen.iter().filter(|b| *b == "write 1").count(),
        1,
        "the upstream ran write 1 once: {seen:?}"
    );
}
