//! Waiting claims (contract section 11): `claim?wait=D` holds the request while the job is
//! held and answers as soon as it can be claimed (released, completed elsewhere, expired),
//! first come, first served among waiters; 409 when the wait ends, 410 at once for a
//! completed job, 400 for a bad or too long wait.

mod common;

use std::{
    thread,
    time::{Duration, Instant},
};

use common::*;

fn claim_body(owner: &str) -> String {
    format!(r#"{{"owner":"{owner}","lease_key":"{owner}-0123456789abcdefghijk","ttl_ms":30000}}"#)
}

/// A claim by `owner`, waiting up to `wait`: (status, body, how long it took).
fn claim(addr: &str, job: &str, owner: &str, wait: &str) -> (u16, serde_json::Value, Duration) {
    let started = Instant::now();
    let path = if wait.is_empty() {
        format!("/v1/leases/{job}/claim")
    } else {
        format!("/v1/leases/{job}/claim?wait={wait}")
    };
    let (status, answer) = bearer_call(addr, "POST", &path, None, &claim_body(owner));
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (
        status,
        serde_json::from_str(body).unwrap_or_default(),
        started.elapsed(),
    )
}

/// A waiting claim (10 s) by `owner`, sent before this returns; the thread reads the answer:
/// (status, body).
fn wait_in_line(
    addr: &str,
    job: &str,
    owner: &str,
) -> thread::JoinHandle<(u16, serde_json::Value)> {
    let path = format!("/v1/leases/{job}/claim?wait=10s");
    let sent = send_request(addr, "POST", &path, &[], &claim_body(owner));
    thread::spawn(move || {
        let (status, answer) = read_answer(sent);
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        (status, serde_json::from_str(body).unwrap_or_default())
    })
}

fn release(addr: &str, job: &str, owner: &str, generation: u64) -> u16 {
    let body = format!(
        r#"{{"owner":"{owner}","generation":{generation},"lease_key":"{owner}-0123456789abcdefghijk"}}"#
    );
    bearer_call(
        addr,
        "POST",
        &format!("/v1/leases/{job}/release"),
        None,
        &body,
    )
    .0
}

#[test]
fn a_waiting_claim_gets_the_job_when_it_is_released_and_waiters_go_in_order() {
    let (_dir, _server, _url, addr) = server_with_a_holding("j");

    // b waits (the server counts it) before c is sent, and c before the holder comes back.
    let b = wait_in_line(&addr, "j", "b");
    waiting_claims(&addr, 1);
    let c = wait_in_line(&addr, "j", "c");
    waiting_claims(&addr, 2);
    // The holder retries its claim with its key (its answer was lost), with a wait: it gets
    // its lease back at once, not behind the strangers waiting for the job.
    let (status, lease, took) = claim(&addr, "j", "a", "10s");
    assert_eq!(
        (status, lease["generation"].as_u64()),
        (200, Some(1)),
        "{lease}"
    );
    assert!(took < Duration::from_secs(2), "the holder queued: {took:?}");
    let released = Instant::now();
    assert_eq!(release(&addr, "j", "a", 1), 200);
    let (status, lease) = b.join().unwrap();
    assert_eq!(
        (status, lease["generation"].as_u64()),
        (200, Some(2)),
        "{lease}"
    );
    assert_eq!(lease["owner"], "b", "the first waiter first");
    // Woken by the release (at worst by the 250 ms poll), not by the 30 s lease's expiry or
    // the 10 s wait's end; the slack is for a loaded machine.
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "granted soon after the release: {:?}",
        released.elapsed()
    );
    thread::sleep(Duration::from_millis(300));
    assert!(!c.is_finished(), "c still waits: b holds the job");
    assert_eq!(release(&addr, "j", "b", 2), 200);
    let (status, lease) = c.join().unwrap();
    assert_eq!(
        (status, lease["owner"].as_str()),
        (200, Some("c")),
        "{lease}"
    );
    assert_eq!(lease["generation"], 3);
}

#[test]
fn a_waiting_claim_gets_an_expired_job_and_gives_up_at_the_end_of_its_wait() {
    let (_dir, _server, _url, addr) = server();
    let short = r#"{"owner":"a","lease_key":"a-0123456789abcdefghijk","ttl_ms":600}"#;
    assert_eq!(
        bearer_call(&addr, "POST", "/v1/leases/e/claim", None, short).0,
        200
    );
    let (status, lease, took) = claim(&addr, "e", "b", "5s");
    assert_eq!(status, 200, "{lease}");
    assert_eq!(lease["generation"], 2);
    assert!(
        took < Duration::from_millis(2_000),
        "granted at expiry: {took:?}"
    );

    let (status, problem, took) = claim(&addr, "e", "c", "700ms");
    assert_eq!(status, 409, "{problem}");
    assert_eq!(problem["type"], "urn:fence:lease-held");
    assert!(
        took >= Duration::from_millis(700) && took < Duration::from_millis(3_000),
        "{took:?}"
    );
}

#[test]
fn completed_jobs_and_bad_waits_answer_at_once() {
    let (_dir, _server, _url, addr) = server_with_a_holding("done");
    let body = r#"{"owner":"a","generation":1,"lease_key":"a-0123456789abcdefghijk"}"#;
    assert_eq!(
        bearer_call(&addr, "POST", "/v1/leases/done/complete", None, body).0,
        200
    );
    let (status, _, took) = claim(&addr, "done", "b", "30s");
    assert_eq!(status, 410);
    assert!(took < Duration::from_secs(2), "{took:?}");

    for (path, why) in [
        ("/v1/leases/x/claim?wait=61s", "60s"),
        ("/v1/leases/x/claim?wait=soon", "wait"),
        ("/v1/leases/x/claim?wait=1s&wait=2s", "once"),
        ("/v1/leases/x/claim?hold=1s", "hold"),
    ] {
        let (status, answer) = bearer_call(&addr, "POST", path, None, &claim_body("b"));
        assert_eq!(status, 400, "{path}: {answer}");
        assert!(answer.contains(why), "{path}: {answer}");
    }
    let renew = r#"{"owner":"a","generation":1,"lease_key":"a-0123456789abcdefghijk"}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/x/renew?wait=1s", None, renew);
    assert_eq!(status, 400, "{answer}");
    let never = bearer_call(&addr, "GET", "/v1/leases/x", None, "").0;
    assert_eq!(never, 404, "nothing was claimed by a bad request");
}

/// `fence run --wait` waits on the server (one waiting claim), not by polling: it starts
/// the moment the holder releases, and the server never answered it `lease-held`.
#[test]
fn fence_run_wait_uses_the_servers_waiting_claim() {
    let (_dir, _server, url, addr) = server_with_a_holding("r");
    let run = {
        let url = url.clone();
        thread::spawn(move || {
            let started = Instant::now();
            let out = fence(&[
                "run", "--server", &url, "--job", "r", "--wait", "20s", "--", "true",
            ]);
            (out, started.elapsed())
        })
    };
    thread::sleep(Duration::from_millis(1_500));
    assert!(!run.is_finished(), "fence run waits while a holds the job");
    let released = Instant::now();
    assert_eq!(release(&addr, "r", "a", 1), 200);
    let (out, _) = run.join().unwrap();
    assert_success(&out);
    // Soon after the release, not at the 20 s wait's end; that it was woken rather than
    // polling, the metrics below show.
    assert!(
        released.elapsed() < Duration::from_secs(5),
        "ran soon after the release: {:?}",
        released.elapsed()
    );
    let (_, metrics) = bearer_call(&addr, "GET", "/metrics", None, "");
    let held = metrics
        .lines()
        .find(|l| l.starts_with("fence_lease_requests_total") && l.contains(r#"outcome="held""#));
    assert_eq!(
        held, None,
        "no claim was refused as held: fence run did not poll"
    );
    let granted = metrics
        .lines()
        .find(|l| {
            l.starts_with("fence_lease_requests_total")
                && l.contains(r#"op="claim""#)
                && l.contains(r#"outcome="ok""#)
        })
        .unwrap_or_default();
    assert!(
        granted.ends_with(" 2"),
        "a's claim and fence run's: {granted}"
    );
}

/// [`server`], with owner `a` holding `job`.
fn server_with_a_holding(job: &str) -> (tempfile::TempDir, Proc, String, String) {
    let (dir, server, url, addr) = server();
    assert_eq!(claim(&addr, job, "a", "").0, 200, "a claims {job}");
    (dir, server, url, addr)
}

/// A lease server in a temporary directory: the directory, the process, its URL and its
/// address (`host:port`).
fn server() -> (tempfile::TempDir, Proc, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let (server, url) = start_server(dir.path());
    let addr = url.trim_start_matches("http://").to_owned();
    (dir, server, url, addr)
}

/// A server that is told to stop answers its waiting claims at once (409, the job still
/// held) and exits 0, rather than holding the stop for their whole wait and then closing
/// their connections unanswered.
#[test]
fn a_stopping_server_answers_its_waiting_claims_and_exits() {
    let (_dir, mut server, _url, addr) = server_with_a_holding("j");
    let b = wait_in_line(&addr, "j", "b");
    waiting_claims(&addr, 1);
    let stopped = Instant::now();
    signal(&server, "-TERM");
    let (status, body) = b.join().unwrap();
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["type"], "urn:fence:lease-held", "{body}");
    let exited = server.0.wait().unwrap();
    assert!(exited.success(), "{exited:?}");
    assert!(
        stopped.elapsed() < Duration::from_secs(5),
        "the stop took {:?} (the waiting claim asked for 10 s)",
        stopped.elapsed()
    );
}

/// Waiting claims are bounded: past `--max-waiting-claims` a claim that would wait is 429
/// `too-many-waiters` with `Retry-After`, at once, and a place is free again once a waiter
/// is answered (issue 31).
#[test]
fn past_the_most_waiting_claims_a_claim_is_429_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let (_server, addr) = start_ready(&server_args(&data, &["--max-waiting-claims", "2"]));
    assert_eq!(claim(&addr, "j", "a", "").0, 200);
    // b is in line before c is sent: two connections sent at once may arrive either way.
    let b = wait_in_line(&addr, "j", "b");
    waiting_claims(&addr, 1);
    let c = wait_in_line(&addr, "j", "c");
    waiting_claims(&addr, 2);
    let path = "/v1/leases/j/claim?wait=10s";
    let started = Instant::now();
    let (status, answer) = bearer_call(&addr, "POST", path, None, &claim_body("d"));
    assert_eq!(status, 429, "{answer}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(answer.contains("urn:fence:too-many-waiters"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    // A claim that need not wait is not refused: the holder's own retry gets its lease.
    assert_eq!(claim(&addr, "j", "a", "10s").0, 200);
    assert_eq!(release(&addr, "j", "a", 1), 200);
    assert_eq!(b.join().unwrap().0, 200, "the first waiter gets the job");
    assert_eq!(
        claim(&addr, "j", "d", "1s").0,
        409,
        "a place is free again: it waits"
    );
    drop(c);
}

/// A server whose waiting places are full (429 too-many-waiters) holds the job as surely as
/// a 409 says: `fence run --wait` asks again after the answer's Retry-After within its wait,
/// and then exits 3 (not obtained within --wait), saying the waiting places were full. Until
/// this version the 429 was an unexpected answer: retried with backoff as a failure, and the
/// run ended with exit 1, "fence itself failed".
#[test]
fn fence_run_exits_3_when_the_servers_waiting_places_stay_full() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap().to_owned();
    let (_server, addr) = start_ready(&server_args(&data, &["--max-waiting-claims", "1"]));
    assert_eq!(claim(&addr, "j", "a", "").0, 200);
    let b = wait_in_line(&addr, "j", "b");
    waiting_claims(&addr, 1);
    let started = Instant::now();
    let url = format!("http://{addr}");
    let out = fence(&[
        "run", "--server", &url, "--job", "j", "--wait", "2s", "--", "true",
    ]);
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("waiting places were full") && stderr.contains("--wait"),
        "{stderr}"
    );
    assert!(!stderr.contains("claim failed"), "not a failure: {stderr}");
    assert!(
        (Duration::from_secs(2)..Duration::from_secs(6)).contains(&took),
        "gave up after {took:?}"
    );
    // It asked again within its wait, after each Retry-After (1 s): more than once, and not
    // in a tight loop.
    let (_, metrics) = bearer_call(&addr, "GET", "/metrics", None, "");
    let crowded = metrics
        .lines()
        .find(|l| l.contains(r#"outcome="too_many_waiters""#))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        (2.0..=4.0).contains(&crowded),
        "{crowded} refused waiting claims"
    );
    drop(b);
}

/// Per client: with an auth file, one client's waiting claims past
/// --max-waiting-claims-per-client are 429 at once while another client's still wait; and a
/// revoke wakes the first waiter, as a release does (issue 31).
#[test]
fn one_clients_waiting_claims_are_capped_and_a_revoke_wakes_the_first_waiter() {
    use std::os::unix::fs::PermissionsExt;
    const ALPHA: &str = "alpha-0123456789abcdef";
    const BETA: &str = "beta-0123456789abcdefg";
    const OPS: &str = "ops-0123456789abcdefghi";
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    std::fs::write(
        &auth,
        format!("alpha {ALPHA} *\nbeta {BETA} *\nops {OPS} * +revoke\n"),
    )
    .unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("data");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &[
            "--auth-file",
            auth.to_str().unwrap(),
            "--max-waiting-claims-per-client",
            "2",
        ],
    ));
    let bearer = |secret: &str| vec![("Authorization", format!("Bearer {secret}"))];
    let waiting = |secret: &str, owner: &str| {
        let sent = send_request(
            &addr,
            "POST",
            "/v1/leases/j/claim?wait=10s",
            &bearer(secret),
            &claim_body(owner),
        );
        thread::spawn(move || read_answer(sent))
    };
    let gauge_is = |n: u32| {
        let (_, metrics) = bearer_call(&addr, "GET", "/metrics", Some(OPS), "");
        metrics
            .lines()
            .any(|l| l == format!("fence_lease_waiting_claims {n}"))
    };
    let (status, answer) = bearer_call(
        &addr,
        "POST",
        "/v1/leases/j/claim",
        Some(ALPHA),
        &claim_body("h"),
    );
    assert_eq!(status, 200, "{answer}");
    let first = waiting(ALPHA, "a1");
    eventually("alpha's first claim waits", Duration::from_secs(10), || {
        gauge_is(1)
    });
    let second = waiting(ALPHA, "a2");
    eventually("alpha's two claims wait", Duration::from_secs(10), || {
        gauge_is(2)
    });
    let (status, answer) = bearer_call(
        &addr,
        "POST",
        "/v1/leases/j/claim?wait=10s",
        Some(ALPHA),
        &claim_body("a3"),
    );
    assert_eq!(status, 429, "alpha's third waiting claim: {answer}");
    assert!(answer.contains("urn:fence:too-many-waiters"), "{answer}");
    let other = waiting(BETA, "b1");
    eventually(
        "beta's claim waits beside alpha's",
        Duration::from_secs(10),
        || gauge_is(3),
    );
    let (status, answer) = bearer_call(
        &addr,
        "POST",
        "/v1/leases/j/revoke",
        Some(OPS),
        r#"{"reason":"test"}"#,
    );
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = first.join().unwrap();
    assert_eq!(status, 200, "the revoke woke the first waiter: {answer}");
    assert!(answer.contains("\"owner\":\"a1\""), "{answer}");
    drop((second, other));
}

/// `--max-claim-wait`: the server holds a waiting claim no longer than it says, whatever
/// the claim asked (the protocol allows up to 60 s), and answers 409 lease-held then; a
/// claim asking less keeps its own wait. `1.5s`, `010s` and `1m` are not waits on the wire.
#[test]
fn the_server_holds_a_claim_no_longer_than_max_claim_wait() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("leases");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--max-claim-wait", "3s"],
    ));
    assert_eq!(claim(&addr, "held", "a", "").0, 200);
    let (status, body, took) = claim(&addr, "held", "b", "30s");
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["type"], "urn:fence:lease-held");
    assert!(
        (Duration::from_millis(2_900)..Duration::from_secs(8)).contains(&took),
        "held {took:?}"
    );
    // Its own shorter wait, told from the server's by 2.8 s: a loaded machine's slow round
    // trip cannot reach that.
    let (status, _, took) = claim(&addr, "held", "b", "200ms");
    assert_eq!(status, 409);
    assert!(
        took < Duration::from_millis(2_500),
        "its own shorter wait: {took:?}"
    );
    for wait in ["1.5s", "010s", "1m", "60001ms"] {
        let (status, body, _) = claim(&addr, "held", "b", wait);
        assert_eq!(status, 400, "{wait}: {body}");
    }
    for wait in ["0", "1", "60", "0ms", "60000ms", "1%30ms", "5s&"] {
        let (status, body, _) = claim(&addr, "free-now", "b", wait);
        assert!(status == 200, "{wait}: {body}");
    }
}

/// A server that holds claims for less than a client asks (`--max-claim-wait`): the lease
/// client's one waiting claim asks again with what is left until its own wait ends, and
/// gets the job when the holder's lease runs out; `fence run --wait` too.
#[test]
fn a_client_keeps_waiting_past_the_servers_max_claim_wait() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("leases");
    let (_server, addr) = start_ready(&server_args(
        data.to_str().unwrap(),
        &["--max-claim-wait", "200ms"],
    ));
    let short = r#"{"owner":"a","lease_key":"a-0123456789abcdefghijk","ttl_ms":1500}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/handed/claim", None, short);
    assert_eq!(status, 200, "{answer}");
    // The lease client itself: one claim_waiting of 10 s.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let granted = rt.block_on(async {
        let store = fence_lease::HttpLeaseStore::new(&format!("http://{addr}")).unwrap();
        let client = fence_lease::LeaseClient::new(store).owner("b".parse().unwrap());
        let lease = client
            .claim_waiting("handed".parse().unwrap(), Duration::from_secs(10))
            .await;
        lease.map(|l| l.generation().get())
    });
    let took = started.elapsed();
    assert_eq!(granted.unwrap(), 2, "granted after {took:?}");
    assert!(
        (Duration::from_millis(1_000)..Duration::from_secs(6)).contains(&took),
        "granted after {took:?}"
    );
    // fence run --wait, on a job held again.
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/handed2/claim", None, short);
    assert_eq!(status, 200, "{answer}");
    let started = Instant::now();
    let out = fence(&[
        "run",
        "--server",
        &format!("http://{addr}"),
        "--job",
        "handed2",
        "--wait",
        "10s",
        "--",
        "true",
    ]);
    let took = started.elapsed();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        (Duration::from_millis(1_000)..Duration::from_secs(6)).contains(&took),
        "granted after {took:?}"
    );
}

/// A renewal for less time than is left does not bring the end of the lease forward (a
/// holder whose renewal's answer is lost keeps the deadline of its last grant, and the store
/// must not let the job go sooner): a waiting claim is not granted at the shorter end. Until
/// stop 66 such a renewal shortened the lease, and this test asserted the opposite.
#[test]
fn a_renewal_for_less_time_than_is_left_keeps_the_lease_end() {
    let (_dir, _server, _url, addr) = server_with_a_holding("shortened");
    let waiter = wait_in_line(&addr, "shortened", "b");
    thread::sleep(Duration::from_millis(300));
    let renewal =
        r#"{"owner":"a","generation":1,"lease_key":"a-0123456789abcdefghijk","ttl_ms":500}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/shortened/renew", None, renewal);
    assert_eq!(status, 200, "{answer}");
    // Three times the shorter TTL later: still a's, and b still waiting.
    thread::sleep(Duration::from_millis(1_500));
    let (status, record) = bearer_call(&addr, "GET", "/v1/leases/shortened", None, "");
    assert_eq!(status, 200, "{record}");
    let record: serde_json::Value =
        serde_json::from_str(record.split("\r\n\r\n").nth(1).unwrap_or_default()).unwrap();
    assert_eq!(
        (&record["state"], &record["owner"]),
        (&"held".into(), &"a".into()),
        "{record}"
    );
    assert!(
        !waiter.is_finished(),
        "the waiting claim was answered at the shorter end"
    );
}

/// A second SIGTERM while the stop waits for a request still under way (here one whose body
/// never comes) ends the server at once, with 143 (128 + 15), as a second Ctrl-C does with
/// 130: the operator asked twice.
#[test]
fn a_second_signal_ends_a_stopping_server_at_once_with_its_code() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let (mut server, addr, log) =
        start_logged(&server_args(dir.path().to_str().unwrap(), &[]), "info");
    let mut stalled = std::net::TcpStream::connect(&addr).unwrap();
    stalled
        .write_all(
            b"POST /v1/leases/s/claim HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
              content-length: 100\r\n\r\n{\"owner\":",
        )
        .unwrap();
    // The head is read and the body awaited (no signal of that to wait for: a pause).
    std::thread::sleep(Duration::from_secs(1));
    signal(&server, "-TERM");
    // The second signal is listened for once the first one's stop began.
    log.wait_for("a second signal stops at once");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        server.0.try_wait().unwrap().is_none(),
        "the first signal's stop did not wait for the request under way"
    );
    let again = Instant::now();
    signal(&server, "-TERM");
    let exited = server.0.wait().unwrap();
    assert_eq!(exited.code(), Some(143), "{exited:?}");
    assert!(
        again.elapsed() < Duration::from_secs(3),
        "{:?}",
        again.elapsed()
    );
}
