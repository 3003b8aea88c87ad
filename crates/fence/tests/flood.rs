//! A connection flood from another address does not starve the lease server's clients
//! (issue 31). A flooder on 127.0.0.2 opens four times the server's connection cap, each
//! connection sending `GET /healthz` (no secret needed) now and then and reconnecting at
//! once when closed; meanwhile a worker on 127.0.0.1 holds a 2 s lease under `fence run` and
//! must renew throughout, and new clients on 127.0.0.1 must be answered. Once with the cap
//! and the per-address cap given, once with the defaults at their own scale (a file limit
//! that makes the cap 500). The proxy's listener the same way: a worker's fenced writes
//! through it, each on a new connection, are all answered while the flood holds four times
//! its cap. In its own test binary: it needs thousands of file descriptors.

mod common;

use std::{
    os::unix::fs::PermissionsExt,
    process::{Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WORKER: &str = "worker-0123456789abcdef-secret";
/// The server's connection cap in both runs; the flooder opens four times as many.
const CAP: usize = 500;

/// A lease server in `dir` with `extra` flags, logging how it seats connections.
fn seating_logged(dir: &std::path::Path, extra: &[&str]) -> (Proc, String, Log) {
    start_logged(&server_args(dir.to_str().unwrap(), extra), "fence=debug")
}

/// One flooding connection after another from `source`, until `stop`: each sends a health
/// check every second and reads the answer; `held` counts those open now.
async fn flood_one(target: std::net::SocketAddr, stop: Arc<AtomicBool>, held: Arc<AtomicU64>) {
    let source: std::net::SocketAddr = "127.0.0.2:0".parse().unwrap();
    while !stop.load(Ordering::Relaxed) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        if socket.bind(source).is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(5), socket.connect(target)).await
        else {
            continue;
        };
        held.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 1024];
        while !stop.load(Ordering::Relaxed) {
            let asked = stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: flood\r\n\r\n")
                .await;
            let answered = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf));
            match (asked, answered.await) {
                (Ok(()), Ok(Ok(n))) if n > 0 => {}
                _ => break, // closed by the server: open another at once
            }
            tokio::time::sleep(Duration::from_millis(1_000)).await;
        }
        held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Runs the flood against a server started with `extra` flags (and under `prlimit` when
/// `nofile` is given); asserts the worker kept its lease and honest newcomers got answers.
fn flood_against(extra: &[&str], nofile: Option<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let auth = dir.path().join("clients");
    std::fs::write(&auth, format!("worker {WORKER} *\n")).unwrap();
    std::fs::set_permissions(&auth, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.path().join("data");
    let mut args = server_args(
        data.to_str().unwrap(),
        &["--auth-file", auth.to_str().unwrap()],
    );
    args.extend_from_slice(extra);
    let mut command = match nofile {
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg(FENCE);
            c
        }
        None => Command::new(FENCE),
    };
    command.args(&args).env("RUST_LOG", "info"); // its "ready" line is at info
    let (_server, addr, _log) = start_command(command);
    let url = format!("http://{addr}");
    let target: std::net::SocketAddr = addr.parse().unwrap();

    // The flood takes what it can before the worker comes.
    let (rt, stop, held) = start_flood(target);
    std::thread::sleep(Duration::from_secs(2));

    // The worker: a 2 s lease around an 8 s command; a renewal that fails loses the lease
    // and fence run exits 75.
    let worker = Command::new(FENCE)
        .args([
            "run", "--server", &url, "--job", "nightly", "--ttl", "2s", "--",
        ])
        .args(["sleep", "8"])
        .env("FENCE_AUTH_TOKEN", WORKER)
        .env("RUST_LOG", "warn")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // New honest clients meanwhile, each on a connection of its own.
    let mut slowest = Duration::ZERO;
    let began = Instant::now();
    let mut asked = 0;
    while began.elapsed() < Duration::from_secs(7) {
        let t = Instant::now();
        let (status, answer) = bearer_call(&addr, "GET", "/v1/leases/nightly", Some(WORKER), "");
        assert!(
            status == 200 || status == 404,
            "an honest newcomer got {status}: {answer}"
        );
        slowest = slowest.max(t.elapsed());
        asked += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = worker.wait_with_output().unwrap();
    let flooding = held.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    rt.shutdown_timeout(Duration::from_secs(1));
    println!(
        "{extra:?}: flood held {flooding} connections; {asked} honest newcomers, slowest answered in {slowest:?}"
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "the worker lost its lease under the flood: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Quiet, the slowest is answered in milliseconds. But before the accept loop takes it, a
    // newcomer queues in the kernel's backlog with the flooder's reconnects, and when a
    // loaded machine slows that loop until the backlog is full, its SYN is dropped and sent
    // again after 1 s, then 3 s: a CI run saw 3.8 s (11 newcomers in 7 s, against 35 here
    // alone; that was before the lobby, which closes the flooder's surplus at accept speed).
    // Starvation is a newcomer never answered (before issue 31: reset, or waiting for the
    // flood to end); at most two dropped SYNs is the bound.
    assert!(
        slowest < Duration::from_secs(7),
        "an honest newcomer waited {slowest:?}"
    );
}

/// Starts a flood of four times [`CAP`] connections from 127.0.0.2 against `target`, on a
/// runtime of its own, and waits until it holds at least half the cap: the runtime (keep it
/// until the end), the flag that stops the flood, and its count.
fn start_flood(
    target: std::net::SocketAddr,
) -> (tokio::runtime::Runtime, Arc<AtomicBool>, Arc<AtomicU64>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let held = Arc::new(AtomicU64::new(0));
    for _ in 0..4 * CAP {
        rt.spawn(flood_one(target, stop.clone(), held.clone()));
    }
    eventually(
        "the flood holds connections",
        Duration::from_secs(20),
        || held.load(Ordering::Relaxed) as usize >= CAP / 2,
    );
    (rt, stop, held)
}

/// Held by each test for its whole run: two floods at once (cargo runs a binary's tests in
/// parallel) share this process's file descriptors and the machine's two cores, and a CI run
/// saw the proxy's worker wait 3.1 s behind both; one flood at a time is what each test
/// means to measure.
static ONE_FLOOD: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// One flood at a time in this process (see [`ONE_FLOOD`]); a test that failed while
/// holding it does not stop the other.
fn one_flood() -> std::sync::MutexGuard<'static, ()> {
    ONE_FLOOD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Enough file descriptors in this process for the flood (four times the cap, and more).
fn raise_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let want = (8 * CAP as u64 + 1_024).min(hard);
    setrlimit(Resource::RLIMIT_NOFILE, want, hard).unwrap();
    assert!(
        want >= 4 * CAP as u64 + 256,
        "the hard file limit ({hard}) is too low for the flood"
    );
}

#[test]
fn a_flood_from_one_address_starves_nobody() {
    let _one = one_flood();
    raise_file_limit();
    // The flooder may take every slot (its cap is the server's): the server makes room by
    // closing the idle connections of the address that holds the most.
    let cap = CAP.to_string();
    flood_against(
        &[
            "--max-connections",
            &cap,
            "--max-connections-per-peer",
            &cap,
        ],
        None,
    );
    // The defaults, at the scale a file limit of 2 × 500 + 64 gives them: a cap of 500, 250
    // from one address.
    flood_against(&[], Some(2 * CAP as u64 + 64));
}

/// The proxy at its cap: before issue 31 it reset 8 of 8 newcomers with cap - 1 connections
/// held. A flood of four times the cap from 127.0.0.2 (each connection's `GET /healthz`
/// goes through to the upstream, unfenced); a worker on 127.0.0.1 writes through the proxy
/// on a new connection every 100 ms for 7 s: every write is answered 200.
#[test]
fn a_flood_of_the_proxy_from_one_address_turns_no_worker_away() {
    let _one = one_flood();
    raise_file_limit();
    let dir = tempfile::tempdir().unwrap();
    let upstream = format!("http://{}", start_upstream());
    let cap = CAP.to_string();
    let data = dir.path().join("proxy");
    let (_proxy, proxy) = start_proxy_with(
        &upstream,
        &[
            "--data-dir",
            data.to_str().unwrap(),
            "--max-connections",
            &cap,
            "--max-connections-per-peer",
            &cap,
        ],
    );
    let target: std::net::SocketAddr = proxy.parse().unwrap();
    let (rt, stop, held) = start_flood(target);
    std::thread::sleep(Duration::from_secs(2));
    let began = Instant::now();
    let (mut written, mut slowest) = (0, Duration::ZERO);
    while began.elapsed() < Duration::from_secs(7) {
        let t = Instant::now();
        // A reset or a closed connection is status 0, which fenced_post refuses.
        assert_eq!(fenced_post(&proxy, "/w", "nightly", "1"), 200);
        slowest = slowest.max(t.elapsed());
        written += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    let flooding = held.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    rt.shutdown_timeout(Duration::from_secs(1));
    println!("proxy: flood held {flooding} connections; {written} writes, slowest {slowest:?}");
    assert!(
        flooding as usize >= CAP / 2,
        "the flood let go ({flooding} held): the test proved nothing"
    );
    // At most two dropped SYNs, as for the lease server (see `flood_against`).
    assert!(
        slowest < Duration::from_secs(7),
        "a write waited {slowest:?}"
    );
}

/// A waiting claim from `source` on the held job `busy` (it keeps its connection busy for
/// `wait`, such as `2s`): sent, not read; the stream is returned to keep the connection open.
fn waiting_claim(
    target: std::net::SocketAddr,
    source: &str,
    n: usize,
    wait: &str,
) -> std::net::TcpStream {
    use std::io::Write;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut stream = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        socket.connect(target).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    let body = format!(
        r#"{{"owner":"flood-{n}","lease_key":"flood-{n}-0123456789abcdefghijk","ttl_ms":60000}}"#
    );
    let head = format!(
        "POST /v1/leases/busy/claim?wait={wait} HTTP/1.1\r\nhost: flood\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// A claim from `source` whose body never comes (its head says 100 bytes): its connection is
/// busy until the server's body deadline (10 s). Unlike a waiting claim, of which the server
/// holds only so many, any number of these keep their connections busy.
fn stalled_claim(target: std::net::SocketAddr, source: &str) -> std::net::TcpStream {
    use std::io::Write;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut stream = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
        socket.connect(target).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    let head = "POST /v1/leases/busy/claim HTTP/1.1\r\nhost: stall\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{";
    stream.write_all(head.as_bytes()).unwrap();
    stream
}

/// At the cap, newcomers are seated lightest address first, not first come: a newcomer
/// from 127.0.0.1 queued behind 100 connections of 127.0.0.2 (each a 2 s waiting claim, on
/// four seats: two of them wait, the most the server holds at a cap of four, the others are
/// answered 429 and closed for room one by one; 127.0.0.2 may hold more, so its newcomers
/// wait too) is
/// answered at the first free seat, while 127.0.0.2 keeps reconnecting. In the kernel's
/// first-come backlog it waited for all 100: about 50 s; in a first-come lobby, until its
/// first-request deadline.
#[test]
fn at_the_cap_a_newcomer_is_not_queued_behind_another_address() {
    let _one = one_flood();
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, log) = seating_logged(
        dir.path(),
        &[
            "--max-connections",
            "4",
            "--max-connections-per-peer",
            "1000",
        ],
    );
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let held = r#"{"owner":"holder","lease_key":"holder-0123456789abcdefghijk","ttl_ms":120000}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/busy/claim", None, held);
    assert_eq!(status, 200, "{answer}");
    // Four seats busy for 2 s, then a hundred more waiting behind them.
    let mut flood: Vec<_> = (0..4)
        .map(|n| waiting_claim(target, "127.0.0.2", n, "2s"))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    flood.extend((4..104).map(|n| waiting_claim(target, "127.0.0.2", n, "2s")));
    // And 127.0.0.2 keeps reconnecting, every 20 ms, while the newcomer waits: the loop's
    // look for an idle connection must still come (a timer remade on every accept never
    // fired).
    let stop = Arc::new(AtomicBool::new(false));
    let reconnecting = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 1_000;
            while !stop.load(Ordering::Relaxed) {
                drop(waiting_claim(target, "127.0.0.2", n, "2s"));
                n += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let began = Instant::now();
    let (status, answer) = bearer_call(&addr, "GET", "/healthz", None, "");
    let waited = began.elapsed();
    stop.store(true, Ordering::Relaxed);
    reconnecting.join().unwrap();
    println!("a newcomer behind 100 busy connections of another address waited {waited:?}");
    assert_eq!(
        status,
        200,
        "answered {answer:?} after {waited:?}; the server's log:\n{}",
        log.text()
    );
    // The first seat frees about 1.4 s in (the first four claims' 2 s wait): one round of
    // waiting claims, not 25.
    assert!(
        waited < Duration::from_secs(6),
        "the newcomer waited {waited:?} behind the flood: {}",
        log.text()
    );
    drop(flood);
}

/// An address at its own cap with every connection busy gets its newcomers closed at once:
/// they never wait for room, so no other address's idle connection is closed for them. Two
/// idle kept-alive connections of 127.0.0.1 stay open while 127.0.0.2, at its cap of two
/// busy claims, sends twenty more (the listener at its cap of four).
#[test]
fn newcomers_that_could_never_be_seated_close_nobody_else() {
    use std::io::{Read, Write};
    let _one = one_flood();
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, log) = seating_logged(
        dir.path(),
        &["--max-connections", "4", "--max-connections-per-peer", "2"],
    );
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let held = r#"{"owner":"holder","lease_key":"holder-0123456789abcdefghijk","ttl_ms":120000}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/busy/claim", None, held);
    assert_eq!(status, 200, "{answer}");
    // Two idle connections of 127.0.0.1, each answered once and kept alive.
    let ask = b"GET /healthz HTTP/1.1\r\nhost: idle\r\n\r\n";
    let answered = |stream: &mut std::net::TcpStream| {
        stream.write_all(ask).unwrap();
        let mut buf = [0u8; 1024];
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let n = stream.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200")
    };
    let mut idle: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(target).unwrap())
        .collect();
    for stream in &mut idle {
        assert!(answered(stream));
    }
    // 127.0.0.2 at its cap, both busy (claims whose bodies never come: the server holds only
    // one waiting claim per client here, half the per-address cap); then twenty more of its
    // newcomers.
    let mut flood: Vec<_> = (0..2).map(|_| stalled_claim(target, "127.0.0.2")).collect();
    // Both claims begun before the newcomers come: a loaded machine may take a while to read
    // them.
    std::thread::sleep(Duration::from_millis(1_000));
    flood.extend((2..22).map(|_| stalled_claim(target, "127.0.0.2")));
    std::thread::sleep(Duration::from_millis(800));
    for (n, stream) in idle.iter_mut().enumerate() {
        assert!(
            answered(stream),
            "idle connection {n} of 127.0.0.1 was closed for newcomers that could not be seated: {}",
            log.text()
        );
    }
    drop(flood);
}

/// A client that never reads its answers cannot keep its seats from newcomers: four
/// connections of 127.0.0.2 fill the cap, each with 400 pipelined `GET /openapi.json` (no
/// secret needed) whose answers it never reads, so the server is stuck writing to each with
/// no request running. A newcomer of 127.0.0.1 must be answered: the connection picked to
/// make room for it closes once its writes have waited half the newcomer's first-request
/// deadline (8 s here), not after the 30 s of shutdown grace, by which time that deadline
/// had closed the newcomer unanswered.
#[test]
fn a_client_that_does_not_read_its_answers_keeps_no_seat_from_a_newcomer() {
    use std::io::Write;
    let _one = one_flood();
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, log) = seating_logged(
        dir.path(),
        &[
            "--max-connections",
            "4",
            "--max-connections-per-peer",
            "1000",
            "--header-timeout",
            "8s",
        ],
    );
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let asks = "GET /openapi.json HTTP/1.1\r\nhost: stuck\r\n\r\n".repeat(400);
    let stuck: Vec<std::net::TcpStream> = (0..4)
        .map(|_| {
            let mut stream = rt.block_on(async {
                let socket = tokio::net::TcpSocket::new_v4().unwrap();
                socket.set_recv_buffer_size(4096).unwrap();
                socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
                socket.connect(target).await.unwrap().into_std().unwrap()
            });
            stream.set_nonblocking(false).unwrap();
            stream.write_all(asks.as_bytes()).unwrap();
            stream
        })
        .collect();
    // Time for the server to fill every socket's buffers and stall on each.
    std::thread::sleep(Duration::from_millis(1_500));
    let began = Instant::now();
    let (status, answer) = bearer_call(&addr, "GET", "/healthz", None, "");
    let waited = began.elapsed();
    assert_eq!(
        status,
        200,
        "answered {answer:?} after {waited:?}; the server's log:\n{}",
        log.text()
    );
    assert!(
        waited < Duration::from_secs(7),
        "the newcomer waited {waited:?} for a seat held by a client that does not read"
    );
    drop(stuck);
}

/// A connection picked to make room while it writes out a long answer to a client that reads
/// it, slowly, keeps writing until the answer is done: only a client that stops reading is
/// cut (after half the first-request deadline, 15 s here). At the proxy, one seat: a slow
/// reader downloads 8 MiB (at most 64 KiB every 20 ms) when a newcomer comes; the reader
/// gets it whole, then the newcomer is answered.
#[test]
fn a_slow_reader_picked_to_make_room_gets_its_whole_answer() {
    use std::io::{BufRead, Read, Write};
    let _one = one_flood();
    const BIG: usize = 8 << 20;
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream_addr = format!("http://{}", upstream.local_addr().unwrap());
    std::thread::spawn(move || {
        for stream in upstream.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let first = line.clone();
                    while line != "\r\n" {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                    }
                    let size = if first.starts_with("GET /big ") {
                        BIG
                    } else {
                        2
                    };
                    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n");
                    if stream.write_all(head.as_bytes()).is_err()
                        || stream.write_all(&vec![b'x'; size]).is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("proxy");
    let (_proxy, proxy, log) = start_logged(
        &proxy_args(
            &upstream_addr,
            &[
                "--data-dir",
                data.to_str().unwrap(),
                "--workers",
                "1",
                "--max-connections",
                "1",
                "--header-timeout",
                "20s",
            ],
        ),
        "fence=debug",
    );
    let target: std::net::SocketAddr = proxy.parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reader = rt.block_on(async {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(64 << 10).unwrap();
        socket.connect(target).await.unwrap().into_std().unwrap()
    });
    reader.set_nonblocking(false).unwrap();
    reader
        .write_all(b"GET /big HTTP/1.1\r\nhost: slow\r\n\r\n")
        .unwrap();
    let reading = std::thread::spawn(move || {
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 << 10];
        reader
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        loop {
            match reader.read(&mut buf) {
                Ok(0) | Err(_) => return got,
                Ok(n) => got += n,
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let (status, answer) = bearer_call(&proxy, "GET", "/small", None, "");
    let got = reading.join().unwrap();
    assert!(
        got > BIG,
        "the slow reader got {got} bytes of a {BIG}-byte answer before its connection was closed for room: {}",
        log.text()
    );
    assert_eq!(status, 200, "the newcomer: {answer}");
}

/// The same over HTTP/2, where the client's stack reads the socket but withholds its flow
/// control window: the server's socket never waits, the answer's body is never asked for a
/// frame. A lease server with one seat, held by an h2c client that asked for
/// `/openapi.json` with a stream window of 0; a newcomer is answered once half its
/// first-request deadline (8 s here) has passed, not after the 30 s grace.
#[test]
fn an_http2_client_that_gives_no_window_keeps_no_seat_from_a_newcomer() {
    let _one = one_flood();
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, log) = seating_logged(
        dir.path(),
        &["--max-connections", "1", "--header-timeout", "8s"],
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let target = addr.clone();
    let _held = rt.block_on(async move {
        let stream = tokio::net::TcpStream::connect(target.as_str())
            .await
            .unwrap();
        let (mut sender, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .initial_stream_window_size(0)
                .handshake::<_, http_body_util::Empty<bytes::Bytes>>(hyper_util::rt::TokioIo::new(
                    stream,
                ))
                .await
                .unwrap();
        tokio::spawn(conn);
        let request = http::Request::get(format!("http://{target}/openapi.json"))
            .body(http_body_util::Empty::new())
            .unwrap();
        let answer = sender.send_request(request).await.unwrap();
        assert_eq!(answer.status(), 200);
        (sender, answer) // kept, never read
    });
    let began = Instant::now();
    let (status, answer) = bearer_call(&addr, "GET", "/healthz", None, "");
    let waited = began.elapsed();
    assert_eq!(
        status,
        200,
        "answered {answer:?} after {waited:?}; the server's log:\n{}",
        log.text()
    );
    assert!(
        waited < Duration::from_secs(7),
        "the newcomer waited {waited:?} for a seat held by an HTTP/2 client that gives no window"
    );
}

/// One connection after another from `source`, each sending waiting claims on the held job
/// `busy`, one after the other (again at once after a 409, 20 ms after a 429), until `stop`;
/// `held` counts those open now.
async fn jam_one(
    target: std::net::SocketAddr,
    source: &'static str,
    stop: Arc<AtomicBool>,
    held: Arc<AtomicU64>,
) {
    let source: std::net::SocketAddr = format!("{source}:0").parse().unwrap();
    let body = r#"{"owner":"jammer","lease_key":"jammer-0123456789abcdefghijk","ttl_ms":60000}"#;
    let claim = format!(
        "POST /v1/leases/busy/claim?wait=20s HTTP/1.1\r\nhost: jam\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    while !stop.load(Ordering::Relaxed) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        if socket.bind(source).is_err() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        let Ok(Ok(mut stream)) =
            tokio::time::timeout(Duration::from_secs(5), socket.connect(target)).await
        else {
            continue;
        };
        held.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 4096];
        while !stop.load(Ordering::Relaxed) {
            if stream.write_all(claim.as_bytes()).await.is_err() {
                break;
            }
            let answered = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut buf));
            let n = match answered.await {
                Ok(Ok(n)) if n > 0 => n,
                _ => break, // closed by the server: open another at once
            };
            if buf[..n].starts_with(b"HTTP/1.1 429") {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Waiting claims cannot hold every seat: one client, from two addresses, opens as many
/// connections as the cap allows each of them (all of the server's eight seats) and keeps a
/// waiting claim of 20 s on each, sent again as soon as one is answered; a newcomer's health
/// check and claim from a third address are still answered. The server holds its waiting
/// claims to half the seats (here 4 in all, 2 per client), so the other connections get 429,
/// are idle between their claims, and are closed to make room. Until this version every seat
/// held a waiting claim (the default caps, 10,000 and 1,000, far above the seats), a busy
/// connection is never closed for room, and the newcomer waited in the lobby until its
/// header timeout closed it unanswered.
#[test]
fn waiting_claims_cannot_hold_every_seat() {
    jam_with_waiting_claims_then_probe(&["127.0.0.2", "127.0.0.3"]);
}

/// Without an auth file the waiting claims of one address are its own limit (half its
/// seats): waiting claims from the prober's own address cannot hold every seat it may have.
/// Until this version all callers without an auth file were one client, held only to half
/// the seats in all: one address's waiting claims held all of its seats, and a health check
/// from it (a container's own) was closed at once.
#[test]
fn waiting_claims_from_ones_own_address_cannot_hold_its_seats() {
    jam_with_waiting_claims_then_probe(&["127.0.0.1"]);
}

/// Four connections from each of `sources` keep a waiting claim on a held job; then a health
/// check and a claim from 127.0.0.1 must be answered.
fn jam_with_waiting_claims_then_probe(sources: &[&'static str]) {
    let _one = one_flood();
    let dir = tempfile::tempdir().unwrap();
    let (_server, addr, log) = seating_logged(
        dir.path(),
        &[
            "--max-connections",
            "8",
            "--max-connections-per-peer",
            "4",
            "--header-timeout",
            "2s",
        ],
    );
    assert!(
        log.text()
            .contains("waiting claims held to half the connection seats"),
        "the lowering is logged at start: {}",
        log.text()
    );
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let held = r#"{"owner":"holder","lease_key":"holder-0123456789abcdefghijk","ttl_ms":120000}"#;
    let (status, answer) = bearer_call(&addr, "POST", "/v1/leases/busy/claim", None, held);
    assert_eq!(status, 200, "{answer}");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let open = Arc::new(AtomicU64::new(0));
    for &source in sources {
        for _ in 0..4 {
            rt.spawn(jam_one(target, source, stop.clone(), open.clone()));
        }
    }
    eventually("the jam holds every seat", Duration::from_secs(10), || {
        open.load(Ordering::Relaxed) == 4 * sources.len() as u64
    });
    std::thread::sleep(Duration::from_millis(500));
    let began = Instant::now();
    let (health, answer) = bearer_call(&addr, "GET", "/healthz", None, "");
    let waited = began.elapsed();
    let claim =
        r#"{"owner":"newcomer","lease_key":"newcomer-0123456789abcdefghijk","ttl_ms":10000}"#;
    let (claimed, claim_answer) = bearer_call(&addr, "POST", "/v1/leases/other/claim", None, claim);
    stop.store(true, Ordering::Relaxed);
    rt.shutdown_timeout(Duration::from_secs(1));
    assert_eq!(
        health,
        200,
        "the health check was answered {answer:?} after {waited:?}; the server's log:\n{}",
        log.text()
    );
    assert_eq!(claimed, 200, "the newcomer's claim: {claim_answer:?}");
}
