//! Checkpoints through `fence server` and `fence run` (contract section 14): the holder saves
//! progress with its lease, the next claim gets it back with the generation that saved it, a
//! stale holder's save is refused, and the size limit is the server's.

mod common;

use std::time::Duration;

use common::*;

fn body(answer: &str) -> serde_json::Value {
    serde_json::from_str(answer.split("\r\n\r\n").nth(1).unwrap_or_default()).unwrap_or_default()
}

fn claim(addr: &str, job: &str, owner: &str, ttl_ms: u64) -> (u16, serde_json::Value) {
    let req = format!(
        r#"{{"owner":"{owner}","lease_key":"{owner}-0123456789abcdefghijk","ttl_ms":{ttl_ms}}}"#
    );
    let (status, answer) =
        bearer_call(addr, "POST", &format!("/v1/leases/{job}/claim"), None, &req);
    (status, body(&answer))
}

fn save(
    addr: &str,
    job: &str,
    owner: &str,
    generation: u64,
    data: &str,
) -> (u16, serde_json::Value) {
    let req = serde_json::json!({
        "owner": owner,
        "generation": generation,
        "lease_key": format!("{owner}-0123456789abcdefghijk"),
        "checkpoint": data,
    });
    let path = format!("/v1/leases/{job}/checkpoint");
    let (status, answer) = bearer_call(addr, "POST", &path, None, &req.to_string());
    (status, body(&answer))
}

#[test]
fn a_checkpoint_goes_to_the_next_holder_and_a_stale_holders_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let (_server, addr) = start_ready(&server_args(&data, &["--max-checkpoint-bytes", "8192"]));
    // 3 s: the saves that follow must find a's lease held, on a loaded machine too.
    let (status, a) = claim(&addr, "export", "a", 3000);
    assert_eq!(status, 200, "{a}");
    assert!(a.get("checkpoint").is_none(), "{a}");

    // 8,000 bytes of control characters: 48 KB of JSON, past the 16 KiB of other calls.
    let escaped = "\u{1}".repeat(8000);
    let (status, saved) = save(&addr, "export", "a", 1, &escaped);
    assert_eq!(status, 200, "{saved}");
    let (status, saved) = save(&addr, "export", "a", 1, "rows 0-999 done");
    assert_eq!(status, 200, "{saved}");
    assert_eq!(saved["generation"], 1, "{saved}");
    let (status, big) = save(&addr, "export", "a", 1, &"x".repeat(8193));
    assert_eq!(status, 413, "{big}");
    // A body past what a checkpoint of 8,192 bytes can need escaped (50,176 bytes) is not
    // read on: 413 from its length, whatever it holds.
    let (status, huge) = save(&addr, "export", "a", 1, &"x".repeat(60_000));
    assert_eq!(status, 413, "{huge}");
    assert!(
        huge["detail"]
            .as_str()
            .is_some_and(|d| d.contains("larger than 50176 bytes")),
        "{huge}"
    );
    assert_eq!(big["type"], "urn:fence:payload-too-large", "{big}");
    assert!(
        big["detail"]
            .as_str()
            .unwrap()
            .contains("--max-checkpoint-bytes"),
        "{big}"
    );

    std::thread::sleep(Duration::from_millis(3200)); // a's lease expires
    let (status, b) = claim(&addr, "export", "b", 30_000);
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["generation"], 2, "{b}");
    assert_eq!(
        b["checkpoint"],
        serde_json::json!({"generation": 1, "data": "rows 0-999 done"}),
        "{b}"
    );
    // a wakes up and saves: refused like a renewal, naming b.
    let (status, stale) = save(&addr, "export", "a", 1, "rows 0-1999 done");
    assert_eq!(status, 409, "{stale}");
    assert_eq!(stale["type"], "urn:fence:lease-lost", "{stale}");
    assert_eq!(stale["owner"], "b", "{stale}");
    let (status, again) = claim(&addr, "export", "b", 30_000);
    assert_eq!(
        (status, &again["checkpoint"]["data"]),
        (200, &"rows 0-999 done".into())
    );

    let (status, bad) = save(&addr, "export", "b", 2, "");
    assert_eq!(status, 200, "an empty checkpoint is one: {bad}");
    let missing = r#"{"owner":"b","generation":2,"lease_key":"b-0123456789abcdefghijk"}"#;
    let (status, answer) =
        bearer_call(&addr, "POST", "/v1/leases/export/checkpoint", None, missing);
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("checkpoint: missing"), "{answer}");
}

#[test]
fn fence_run_passes_the_checkpoint_in_and_out_through_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    // The first run saves its progress, then fails: the job is released, not completed.
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "resumable",
        "--",
        "sh",
        "-c",
        r#"test -f "$FENCE_CHECKPOINT_FILE" && test ! -s "$FENCE_CHECKPOINT_FILE" || exit 9
           test -z "$FENCE_CHECKPOINT_GENERATION" || exit 8
           printf 'step 3 of 5' > "$FENCE_CHECKPOINT_FILE"; exit 1"#,
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    // The next run starts from it, and knows which generation wrote it.
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "resumable",
        "--",
        "sh",
        "-c",
        r#"test "$(cat "$FENCE_CHECKPOINT_FILE")" = 'step 3 of 5' || exit 9
           test "$FENCE_CHECKPOINT_GENERATION" = 1 || exit 8"#,
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// Under an outer `fence run` (its variables in the environment), a run that resumed no
/// checkpoint does not hand its command the outer job's checkpoint generation, which would be
/// read as this job's.
#[test]
fn fence_run_does_not_pass_on_an_outer_runs_checkpoint_generation() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let out = std::process::Command::new(FENCE)
        .args(["run", "--server", &url, "--job", "inner", "--", "sh", "-c"])
        .arg(r#"test -z "${FENCE_CHECKPOINT_GENERATION+set}" || exit 8"#)
        .env("RUST_LOG", "warn")
        .env("FENCE_CHECKPOINT_GENERATION", "7")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// One HTTP/1.1 message from `reader`: its head and body (by `content-length`), or `None`
/// at the end of the stream.
fn read_message(reader: &mut impl std::io::BufRead) -> Option<(String, Vec<u8>)> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let length = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((head, body))
}

/// A front for the lease server at `server` that answers the first `fail` checkpoint saves
/// 503, and passes everything else on (one upstream connection per request); its address,
/// and how many saves it has been sent.
fn failing_checkpoints(
    server: String,
    fail: usize,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    failing_checkpoints_with(server, fail, "503 Service Unavailable", "store-unavailable")
}

/// [`failing_checkpoints`], answering `status` (code and reason) with a problem of `kind`.
fn failing_checkpoints_with(
    server: String,
    fail: usize,
    status: &'static str,
    kind: &'static str,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let saves = failed.clone();
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { continue };
            let (server, failed) = (server.clone(), failed.clone());
            std::thread::spawn(move || {
                let mut reader = BufReader::new(client.try_clone().unwrap());
                while let Some((head, body)) = read_message(&mut reader) {
                    let saving = head.contains("/checkpoint ");
                    if saving && failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < fail {
                        let code = &status[..3];
                        let problem = format!(
                            r#"{{"type":"urn:fence:{kind}","title":"t","status":{code},"detail":"a test front"}}"#
                        );
                        let answer = format!(
                            "HTTP/1.1 {status}\r\ncontent-type: application/problem+json\r\ncontent-length: {}\r\n\r\n{problem}",
                            problem.len()
                        );
                        if client.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                        continue;
                    }
                    let mut upstream = std::net::TcpStream::connect(&server).unwrap();
                    upstream.write_all(head.as_bytes()).unwrap();
                    upstream.write_all(&body).unwrap();
                    let mut answers = BufReader::new(upstream);
                    let Some((head, body)) = read_message(&mut answers) else {
                        return;
                    };
                    if client.write_all(head.as_bytes()).is_err()
                        || client.write_all(&body).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (addr, saves)
}

/// The command's last checkpoint, saved after it exited, is tried again when the server
/// fails to take it (here three 503s), before the job is released: the next run resumes
/// from it. Before, one failure lost it, and the next run repeated the steps.
#[test]
fn fence_runs_last_checkpoint_is_saved_through_a_passing_failure() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let (front, _) = failing_checkpoints(url.trim_start_matches("http://").to_owned(), 3);
    let out = fence(&[
        "run",
        "--server",
        &format!("http://{front}"),
        "--job",
        "resumable",
        "--",
        "sh",
        "-c",
        r#"printf 'step 4 of 5' > "$FENCE_CHECKPOINT_FILE"; exit 1"#,
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "resumable",
        "--",
        "sh",
        "-c",
        r#"test "$(cat "$FENCE_CHECKPOINT_FILE")" = 'step 4 of 5' || exit 9"#,
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// SIGTERM while the last checkpoint is retried (the server never takes it) ends `fence run`
/// at once, exit 143, the job left to expire: the signal is not used up by the retries and
/// then forgotten while the job is given up.
#[test]
fn sigterm_while_the_last_checkpoint_is_retried_ends_fence_run() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let (front, saves) =
        failing_checkpoints(url.trim_start_matches("http://").to_owned(), usize::MAX);
    let run = std::process::Command::new(FENCE)
        .args([
            "run",
            "--server",
            &format!("http://{front}"),
            "--job",
            "stuck",
        ])
        .args(["--", "sh", "-c"])
        .arg(r#"printf 'step 2 of 5' > "$FENCE_CHECKPOINT_FILE""#)
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The retries under way, and past their first 2 s, when signals count.
    eventually(
        "the last checkpoint is retried",
        Duration::from_secs(30),
        || saves.load(std::sync::atomic::Ordering::SeqCst) >= 1,
    );
    std::thread::sleep(Duration::from_millis(2_500));
    let pid = nix::unistd::Pid::from_raw(i32::try_from(run.id()).unwrap());
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let sent = std::time::Instant::now();
    let out = run.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{stderr}");
    assert!(sent.elapsed() < Duration::from_secs(2), "{stderr}");
    assert!(stderr.contains("left to expire"), "{stderr}");
    // Not completed: held until it expires.
    let (status, answer) = bearer_call(
        url.trim_start_matches("http://"),
        "GET",
        "/v1/leases/stuck",
        None,
        "",
    );
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains(r#""state":"held""#), "{answer}");
}

/// A checkpoint rewritten in place with text of the same length, its modification time as it
/// was (a rewrite within one tick of a coarse file system clock; `touch -r` here): the last
/// save, after the command exited, used to compare only the file's modification time and
/// length, found "no change", and left the store with the older text, from which the next
/// run then resumed.
#[test]
fn a_same_length_rewrite_within_one_clock_tick_is_still_saved_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let stamp = dir.path().join("stamp");
    // "step 1" is saved by the once-a-second look (2.5 s leaves two), then "step 2" is
    // written over it, and the file's time put back to what it was when "step 1" was saved.
    let script = format!(
        r#"printf 'step 1' > "$FENCE_CHECKPOINT_FILE"; touch -r "$FENCE_CHECKPOINT_FILE" {s}
           sleep 2.5
           printf 'step 2' > "$FENCE_CHECKPOINT_FILE"; touch -r {s} "$FENCE_CHECKPOINT_FILE"
           exit 1"#,
        s = stamp.display()
    );
    let run = |script: &str| {
        fence(&[
            "run",
            "--server",
            &url,
            "--job",
            "same-length",
            "--",
            "sh",
            "-c",
            script,
        ])
    };
    let out = run(&script);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let out = run(r#"test "$(cat "$FENCE_CHECKPOINT_FILE")" = 'step 2' || exit 9"#);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the next run did not resume from 'step 2' (exit 9: it got an older text): {out:?}"
    );
}

/// A 408 to a checkpoint save (a gateway, or a server whose body timeout cut the request)
/// means the request did not arrive whole and nothing was applied. It used to be taken as
/// an unexpected answer, final: the last checkpoint was dropped and the next run repeated
/// the steps. It is tried again like a 503 now.
#[test]
fn a_408_to_the_last_checkpoint_is_tried_again() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = start_server(&dir.path().join("leases"));
    let upstream = url.trim_start_matches("http://").to_owned();
    let (front, saves) =
        failing_checkpoints_with(upstream, 1, "408 Request Timeout", "body-timeout");
    let out = fence(&[
        "run",
        "--server",
        &format!("http://{front}"),
        "--job",
        "timed-out",
        "--",
        "sh",
        "-c",
        r#"printf 'step 4 of 5' > "$FENCE_CHECKPOINT_FILE"; exit 1"#,
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        saves.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "{out:?}"
    );
    let out = fence(&[
        "run",
        "--server",
        &url,
        "--job",
        "timed-out",
        "--",
        "sh",
        "-c",
        r#"test "$(cat "$FENCE_CHECKPOINT_FILE")" = 'step 4 of 5' || exit 9"#,
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}
