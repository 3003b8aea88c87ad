//! Helpers shared by the end-to-end tests: the fence binary as child processes, a plain
//! upstream, raw HTTP/1.1 requests.
#![allow(dead_code, unreachable_pub)] // each test binary uses its own subset

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

pub const FENCE: &str = env!("CARGO_BIN_EXE_fence");

/// A child process killed and reaped when dropped, so a failing test leaves none behind.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // Reaped already if it was killed on purpose: then `kill` has nobody to wake.
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.id().to_string()])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `fence` with the white-space separated arguments of `line` (none of which has a space).
pub fn fence_line(line: &str) -> Output {
    fence(&line.split_whitespace().collect::<Vec<_>>())
}

pub fn fence(args: &[&str]) -> Output {
    Command::new(FENCE)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("fence runs")
}

/// Starts `fence server` on an ephemeral port and returns it with its URL.
pub fn start_server(dir: &Path) -> (Proc, String) {
    let (proc, addr) = start_ready(&server_args(dir.to_str().unwrap(), &[]));
    (proc, format!("http://{addr}"))
}

/// `fence server` arguments for an ephemeral port and sled in `data_dir`, then `extra`.
pub fn server_args<'a>(data_dir: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["server", "--listen", "127.0.0.1:0", "--data-dir", data_dir];
    args.extend_from_slice(extra);
    args
}

/// Polls `done` every 20 ms until it holds; fails, naming `what`, if it does not within
/// `within`. For a condition that becomes true at a time the test cannot know exactly (a
/// background pass, a process reacting to a signal): a fixed sleep would race it under load.
pub fn eventually(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + within;
    while !done() {
        assert!(
            std::time::Instant::now() < deadline,
            "not within {within:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (within 10 s) until the lease server at `addr` (no auth on `/metrics`) counts `n`
/// waiting claims.
pub fn waiting_claims(addr: &str, n: u32) {
    eventually(&format!("{n} claims wait"), Duration::from_secs(10), || {
        let (_, metrics) = bearer_call(addr, "GET", "/metrics", None, "");
        metrics
            .lines()
            .any(|l| l == format!("fence_lease_waiting_claims {n}"))
    });
}

/// Fails, showing what the command said, unless it exited 0.
pub fn assert_success(out: &Output) {
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

pub fn signal(p: &Proc, sig: &str) {
    assert!(
        Command::new("kill")
            .args([sig, &p.0.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
}

/// One HTTP/1.1 request over a fresh connection (`Connection: close`): the status code and
/// the whole answer, head and body (status 0 when nothing parseable came back).
pub fn exchange(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
) -> (u16, String) {
    read_answer(send_request(addr, method, path, headers, body))
}

/// The first half of [`exchange`]: the request is on the wire when this returns, and the
/// connection waits for [`read_answer`].
pub fn send_request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: &str,
) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).unwrap();
    stream
}

/// The second half of [`exchange`]: the whole answer and its status (0 when none came).
pub fn read_answer(mut stream: std::net::TcpStream) -> (u16, String) {
    use std::io::Read;
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, answer)
}

/// One HTTP/1.1 request over a fresh connection; returns the status code.
pub fn http_status(addr: &str, method: &str, path: &str, headers: &[(&str, String)]) -> u16 {
    let (status, answer) = exchange(addr, method, path, headers, "");
    assert_ne!(status, 0, "no status in {answer:?}");
    status
}

/// A JSON request with `Authorization: Bearer <bearer>` when given: (status, whole answer).
pub fn bearer_call(
    addr: &str,
    method: &str,
    path: &str,
    bearer: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut headers = vec![("content-type", "application/json".to_owned())];
    if let Some(b) = bearer {
        headers.push(("Authorization", format!("Bearer {b}")));
    }
    exchange(addr, method, path, &headers, body)
}

/// A plain upstream answering 200 to everything, in a thread of its own.
pub fn start_upstream() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                use std::io::{BufRead, Write};
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                loop {
                    let mut line = String::new();
                    let mut content_length = 0usize;
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        let mut h = String::new();
                        if reader.read_line(&mut h).unwrap_or(0) == 0 {
                            return;
                        }
                        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                            content_length = v.trim().parse().unwrap_or(0);
                        }
                        if h == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0; content_length];
                    if std::io::Read::read_exact(&mut reader, &mut body).is_err() {
                        return;
                    }
                    if stream
                        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                        .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// `fence proxy` on ephemeral ports (its admin listener too) in front of `upstream` (an
/// `http://` URL), with `extra` arguments; waits until it is ready.
pub fn start_proxy_with(upstream: &str, extra: &[&str]) -> (Proc, String) {
    start_ready(&proxy_args(upstream, extra))
}

/// `fence proxy` arguments for ephemeral ports in front of `upstream`, then `extra`.
pub fn proxy_args<'a>(upstream: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "proxy",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--upstream",
        upstream,
    ];
    args.extend_from_slice(extra);
    args
}

/// [`start_proxy_with`], returning also the admin listener's address (from the ready line).
pub fn start_proxy_admin(upstream: &str, extra: &[&str]) -> (Proc, String, String) {
    let (proc, addr, log) = start_logged(&proxy_args(upstream, extra), "info");
    let ready = log.wait_for("proxy ready");
    let admin = ready
        .split("admin=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the ready line names the admin address")
        .to_owned();
    (proc, addr, admin)
}

/// `fence proxy` with sled in `dir` in front of the upstream at `upstream` (`host:port`).
pub fn start_proxy(dir: &Path, upstream: &str) -> (Proc, String) {
    let upstream = format!("http://{upstream}");
    start_proxy_with(&upstream, &["--data-dir", dir.to_str().unwrap()])
}

/// A fenced `POST path` through `proxy` with job and token headers: the status.
pub fn fenced_post(proxy: &str, path: &str, job: &str, token: &str) -> u16 {
    http_status(
        proxy,
        "POST",
        path,
        &[
            ("X-Fencing-Job", job.to_owned()),
            ("X-Fencing-Token", token.to_owned()),
        ],
    )
}

/// `fence release` of the lease `fence claim` printed as `lease`.
pub fn release(server: &str, job: &str, lease: &serde_json::Value) -> Output {
    fence(&[
        "release",
        "--server",
        server,
        "--job",
        job,
        "--owner",
        lease["owner"].as_str().expect("an owner"),
        "--generation",
        &lease["generation"].to_string(),
        "--lease-key",
        lease["lease_key"].as_str().expect("a lease key"),
    ])
}

/// Starts `fence ARGS...` and waits for its "ready" log line; returns it with its address.
pub fn start_ready(args: &[&str]) -> (Proc, String) {
    let (proc, addr, _) = start_logged(args, "info");
    (proc, addr)
}

/// Everything a process wrote on stderr so far, line by line.
#[derive(Clone, Default)]
pub struct Log(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl Log {
    /// Keeps every line `from` writes, on a thread of its own.
    pub fn follow(&self, from: impl std::io::Read + Send + 'static) {
        self.follow_lines(BufReader::new(from).lines());
    }

    fn follow_lines(&self, lines: impl Iterator<Item = std::io::Result<String>> + Send + 'static) {
        let keep = self.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                keep.0.lock().unwrap().push(line);
            }
        });
    }

    pub fn text(&self) -> String {
        self.0.lock().unwrap().join("\n")
    }

    /// Waits up to 10 s for a line containing `needle`.
    pub fn wait_for(&self, needle: &str) -> String {
        self.wait_for_nth(needle, 1)
    }

    /// Waits up to 10 s for the `n`th line containing `needle`.
    pub fn wait_for_nth(&self, needle: &str, n: usize) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(line) = self
                .0
                .lock()
                .unwrap()
                .iter()
                .filter(|l| l.contains(needle))
                .nth(n - 1)
            {
                return line.clone();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no line with {needle:?} in:\n{}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// [`start_ready`] with `RUST_LOG=rust_log`, keeping every line of stderr.
pub fn start_logged(args: &[&str], rust_log: &str) -> (Proc, String, Log) {
    let mut command = Command::new(FENCE);
    command.args(args).env("RUST_LOG", rust_log);
    start_command(command)
}

/// Starts `command` (a fence listener, perhaps under a wrapper such as `prlimit`) and waits
/// for its "ready" line; returns it with its address and everything it writes on stderr.
pub fn start_command(mut command: Command) -> (Proc, String, Log) {
    let args = format!("{command:?}");
    let mut child = command.stderr(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let log = Log::default();
    let addr = loop {
        let line = lines
            .next()
            .unwrap_or_else(|| {
                panic!(
                    "fence {args:?} exited before it was ready; it said:\n{}",
                    log.text()
                )
            })
            .unwrap();
        log.0.lock().unwrap().push(line.clone());
        if line.contains("ready")
            && let Some(rest) = line.split("listen=").nth(1)
        {
            break rest.split_whitespace().next().unwrap().to_owned();
        }
        // The same line under --log-format json.
        if line.contains("ready")
            && let Some(rest) = line.split("\"listen\":\"").nth(1)
        {
            break rest.split('"').next().unwrap().to_owned();
        }
    };
    log.follow_lines(lines);
    (Proc(child), addr, log)
}

/// The test database (`DATABASE_URL`, else the local one); a test that cannot reach it
/// fails, it never passes unrun.
pub fn database_url() -> Option<String> {
    Some(fence_storage::postgres::test_database_url())
}

/// A schema name of its own for one test. The schema is dropped, with everything in it,
/// when this goes out of scope, the test passing or not: tests leave nothing in the test
/// database. Declare it before the servers that use it, so they stop first.
pub fn unique_schema(prefix: &str) -> Schema {
    use std::hash::{BuildHasher, RandomState};
    Schema(format!(
        "{prefix}_{:012x}",
        RandomState::new().hash_one(std::time::SystemTime::now()) & 0xffff_ffff_ffff
    ))
}

/// See [`unique_schema`].
#[derive(Debug)]
pub struct Schema(String);

impl std::ops::Deref for Schema {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Schema {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (fence_storage::postgres::test_database_url(), self.0.clone());
        // A thread and a runtime of its own: this may run inside a test's runtime.
        let dropped = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let drop_it = async {
                    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                        .await
                        .ok()?;
                    tokio::spawn(conn);
                    client
                        .batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                        .await
                        .ok()
                };
                let _ = tokio::time::timeout(Duration::from_secs(10), drop_it).await;
            });
        });
        let _ = dropped.join();
    }
}

/// `fence claim --job JOB --ttl 30s` from `racers` processes started at once, spread over
/// `servers` in turn, owners `p0`, `p1`, …; their outputs, in that order.
pub fn claim_race(servers: &[String], job: &str, racers: usize) -> Vec<Output> {
    let children: Vec<Child> = (0..racers)
        .map(|i| {
            Command::new(FENCE)
                .args([
                    "claim",
                    "--server",
                    &servers[i % servers.len()],
                    "--job",
                    job,
                    "--ttl",
                    "30s",
                    "--owner",
                    &format!("p{i}"),
                ])
                .env("RUST_LOG", "warn")
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// `fence server` on PostgreSQL at `url`, in `schema`, with `extra` arguments; waits until
/// it is ready and returns it with its address.
pub fn start_pg_server(url: &str, schema: &str, extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "server",
        "--listen",
        "127.0.0.1:0",
        "--store",
        url,
        "--pg-schema",
        schema,
    ];
    args.extend_from_slice(extra);
    start_ready(&args)
}

/// A certificate authority made for one test, and a server certificate it issued for
/// `127.0.0.1` and `localhost`; all written as PEM files into a directory of their own.
pub struct TestCa {
    _dir: tempfile::TempDir,
    /// The CA certificate, for `--ca-cert`.
    pub ca: std::path::PathBuf,
    /// The server's certificate, for `--tls-cert`.
    pub cert: std::path::PathBuf,
    /// The server's private key, for `--tls-key`.
    pub key: std::path::PathBuf,
}

impl TestCa {
    pub fn new() -> Self {
        Self::for_names(&["127.0.0.1", "localhost"])
    }

    /// A CA and a server certificate for `names` only.
    pub fn for_names(names: &[&str]) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "fence test CA");
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let names = names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>();
        let params = CertificateParams::new(names).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        let write = |name: &str, text: String| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        Self {
            ca: write("ca.pem", ca_cert.pem()),
            cert: write("server.pem", cert.pem()),
            key: write("server-key.pem", key.serialize_pem()),
            _dir: dir,
        }
    }

    /// `--tls-cert CERT --tls-key KEY`.
    pub fn server_args(&self) -> Vec<String> {
        vec![
            "--tls-cert".into(),
            self.cert.display().to_string(),
            "--tls-key".into(),
            self.key.display().to_string(),
        ]
    }
}

/// `curl` with this CA: (status, body). For HTTPS checks of the listeners, as an operator
/// would make them.
pub fn curl(ca: &Path, args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(ca)
        .args(args)
        .output()
        .expect("curl is installed (apt install curl)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (
        code.trim().parse().unwrap_or(0),
        format!("{body}{}", String::from_utf8_lossy(&out.stderr)),
    )
}

/// A TCP relay in front of a server (the test database, a lease server) that can be cut, as
/// a network partition or a crash would.
pub struct Relay {
    pub url: String,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Bytes are taken in and dropped, not passed on: a peer that went away without a reset.
    silent: std::sync::Arc<std::sync::atomic::AtomicBool>,
    streams: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
}

impl Relay {
    pub fn to(url: &str) -> Self {
        use std::{
            io::{Read, Write},
            net::{TcpListener, TcpStream},
            sync::atomic::Ordering,
        };
        // host:port, after any scheme and user, before any path: postgres:// and http://.
        let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
        let rest = rest.split_once('@').map_or(rest, |(_, rest)| rest);
        let target = rest.split(['/', '?']).next().unwrap().to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let relayed = url.replacen(&target, &format!("127.0.0.1:{port}"), 1);
        let relay = Relay {
            url: relayed,
            open: std::sync::Arc::new(true.into()),
            silent: std::sync::Arc::default(),
            streams: std::sync::Arc::default(),
        };
        let (open, silent, streams) = (
            relay.open.clone(),
            relay.silent.clone(),
            relay.streams.clone(),
        );
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                if !open.load(Ordering::SeqCst) {
                    continue; // dropped: closed at once
                }
                let Ok(server) = TcpStream::connect(&target) else {
                    continue;
                };
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    let silent = silent.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n @ 1..) = from.read(&mut buf) {
                            if !silent.load(Ordering::SeqCst) && to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                };
                {
                    // `open` looked at again under the lock `cut` drains with: a cut since the
                    // look above has set it already (this connection is closed here), or
                    // waits for the lock and closes this connection with the others.
                    let mut kept = streams.lock().unwrap();
                    if !open.load(Ordering::SeqCst) {
                        let _ = client.shutdown(std::net::Shutdown::Both);
                        let _ = server.shutdown(std::net::Shutdown::Both);
                        continue;
                    }
                    kept.push(client.try_clone().unwrap());
                    kept.push(server.try_clone().unwrap());
                }
                pipe(client.try_clone().unwrap(), server.try_clone().unwrap());
                pipe(server, client);
            }
        });
        relay
    }

    /// Lets new connections through again (the database is back).
    pub fn reopen(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Stops passing bytes on, both ways, and closes nothing: a peer that went away without a
    /// reset (a host powered off, a partition), which a socket learns of only when TCP gives
    /// up, some 15 minutes later; here never.
    pub fn silence(&self) {
        self.silent.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Closes every connection through the relay and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, std::sync::atomic::Ordering::SeqCst);
        for s in self.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}
