//! Stopping a proxy of several workers keeps the hold after an unknown outcome: judged where
//! effects commit, a newer token waiting on another worker does not pass while the upstream
//! may still act on the older request.

mod common;

use std::{
    io::{BufRead, BufReader, Read, Write},
    net::{TcpListener, TcpStream},
    sync::{Arc, Mutex},
    time::Duration,
};

use common::*;

/// The upstream's commits, in order: (token, peer port of the proxy's connection).
type Commits = Arc<Mutex<Vec<String>>>;

/// An upstream that answers a GET with the port the proxy's connection came from, commits a
/// POST's token (from `X-Fencing-Token`) at once, except token 1's, which it commits after
/// 1.5 s (past the proxy's upstream timeout).
fn start_recording_upstream() -> (String, Commits) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let commits = Commits::default();
    let log = commits.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let log = log.clone();
            std::thread::spawn(move || serve(stream, &log));
        }
    });
    (addr, commits)
}

fn serve(mut stream: TcpStream, commits: &Commits) {
    let port = stream.peer_addr().unwrap().port();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    loop {
        let (mut line, mut length, mut token) = (String::new(), 0usize, None);
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let lower = h.to_ascii_lowercase();
            if let Some(v) = lower.strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if let Some(v) = lower.strip_prefix("x-fencing-token:") {
                token = Some(v.trim().to_owned());
            }
            if h == "\r\n" {
                break;
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if let Some(token) = token {
            if token == "1" {
                std::thread::sleep(Duration::from_millis(1_500));
            }
            commits.lock().unwrap().push(token);
        }
        let answer = port.to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if stream.write_all(head.as_bytes()).is_err() {
            return;
        }
    }
}

/// A kept-alive client connection to the proxy.
struct Conn(BufReader<TcpStream>);

impl Conn {
    fn open(proxy: &str) -> Self {
        let stream = TcpStream::connect(proxy).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(40)))
            .unwrap();
        Self(BufReader::new(stream))
    }

    /// Sends one request and reads its answer: (status, body).
    fn ask(&mut self, method: &str, headers: &str) -> (u16, String) {
        let req =
            format!("{method} /effects HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n{headers}\r\n");
        self.0.get_mut().write_all(req.as_bytes()).unwrap();
        let mut status_line = String::new();
        if self.0.read_line(&mut status_line).unwrap_or(0) == 0 {
            return (0, String::new());
        }
        let status = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if self.0.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        let _ = self.0.read_exact(&mut body);
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

/// Token 1's request times out at the proxy (504: it may still commit) and holds the job; a
/// request with token 2 waits for that hold on another worker. The proxy is then stopped
/// (SIGTERM): the worker of token 1, with nothing left in flight, finishes at once. Its hold
/// must outlive that: token 2 commits after token 1 at the upstream, or not at all.
#[test]
fn stopping_the_proxy_keeps_a_hold_for_a_newer_token_on_another_worker() {
    let (upstream, commits) = start_recording_upstream();
    let upstream = format!("http://{upstream}");
    let dir = tempfile::tempdir().unwrap();
    let (proxy, addr) = start_proxy_with(
        &upstream,
        &[
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--workers",
            "2",
            "--upstream-timeout",
            "500ms",
            "--unknown-outcome-hold",
            "3s",
        ],
    );
    // One kept-alive connection on each worker: a worker's upstream connection (its port, as
    // the upstream saw it) tells which worker serves a client connection.
    let mut by_worker: Vec<(String, Conn)> = Vec::new();
    for _ in 0..40 {
        let mut conn = Conn::open(&addr);
        let (status, port) = conn.ask("GET", "");
        assert_eq!(status, 200);
        if by_worker.iter().all(|(p, _)| *p != port) {
            by_worker.push((port, conn));
        }
        if by_worker.len() == 2 {
            break;
        }
    }
    assert_eq!(by_worker.len(), 2, "every connection landed on one worker");
    let (_, mut newer) = by_worker.pop().unwrap();
    let (_, mut older) = by_worker.pop().unwrap();
    let fenced = |token: u64| format!("X-Fencing-Job: j\r\nX-Fencing-Token: {token}\r\n");
    let (status, _) = older.ask("POST", &fenced(1));
    assert_eq!(status, 504, "token 1 timed out at the proxy");
    let waiting = std::thread::spawn(move || newer.ask("POST", &fenced(2)).0);
    std::thread::sleep(Duration::from_millis(200)); // token 2 waits behind the hold
    signal(&proxy, "-TERM");
    let status = waiting.join().unwrap();
    std::thread::sleep(Duration::from_millis(1_500)); // token 1's commit has landed
    let order = commits.lock().unwrap().clone();
    let at = |token: &str| order.iter().position(|t| t == token);
    assert!(
        at("2").is_none_or(|two| at("1").is_some_and(|one| one < two)),
        "token 2 committed before token 1 (answered {status}): {order:?}"
    );
}
