//! Fault-injection acceptance: real `fence server` and `fence proxy` processes, worker
//! processes using the library's `Lease` and `FencingLayer`, an upstream that logs every
//! effect it receives, and randomized faults from a printed seed: workers stopped (SIGSTOP)
//! past their lease, the proxy and the lease server killed (SIGKILL) and restarted, the
//! server's clock jumping, more workers than jobs, a slow upstream, requests held up
//! between being stamped and being sent, and clients that stall their body mid-request or
//! disconnect mid-body (the upstream logs a request as an effect the moment its head
//! arrives, the harshest reading of a partial request). A history checker then looks for any effect applied
//! after a newer token's effect, reused generations and acknowledged writes that never
//! landed. A negative control runs the same with fencing disabled and must find violations.
//! In the SQL mode the proxy keeps its fence in PostgreSQL, two of the workers write their
//! effects straight into the database inside transactions that call the SQL fence
//! (`require`), and the upstream writes the proxied effects the same way: one fence for both
//! kinds of writer, and the effects' commit order is what the checker reads. In the gRPC
//! mode the upstream is a tonic gRPC service and the workers call it through the proxy with
//! generated tonic clients on a `Channel` under `FencingLayer`. The multi-node mode runs two
//! lease servers (one with its clock 30 s ahead) and three proxies on one PostgreSQL with
//! the SQL mode's writers, and adds proxies stopped with requests in flight, PostgreSQL
//! restarted (`-m immediate`) and every database connection dropped; its negative control
//! writes the upstream's effects without the SQL fence and must find effects out of order
//! across proxies. The semaphore mode has six workers and a `fence run --slots` script claim
//! slots of one semaphore of two (stops, proxy and server kills, no clock jumps): per slot no
//! stale effect, and it counts the most leases writing with unexpired tokens at once (≤ 2).
//!
//! Quick mode runs in CI. Soak: `FENCE_SOAK_SECS=3600 FENCE_SOAK_SEED=42 cargo test -p fence
//! --features test-hooks --test fault_injection -- --nocapture --exact
//! fenced_run_has_no_violations` (or `several_servers_and_proxies_on_one_database_have_no_violations`).

mod common;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    convert::Infallible,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use fence_lease::{ClaimError, HttpLeaseStore, LeaseClient, Ttl};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::{
    client::legacy::Client,
    rt::{TokioExecutor, TokioIo},
};
use tower::{Service, ServiceBuilder, ServiceExt};

const WORKER_ENV: &str = "FENCE_FAULT_WORKER";
/// The file in which a worker says whether it holds a lease now (`1`) or not (`0`): the
/// harness counts a stop as a fault only when the worker it stopped held one.
const HOLDING_ENV: &str = "FENCE_FAULT_HOLDING";

/// The two runs take turns: on two cores, running them at once halves the faults each sees.
static ONE_RUN_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const TTL_MS: u64 = 600;

/// A small deterministic random number generator (xorshift64*).
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The resource of the semaphore mode; its slots are the jobs `sem#1` to `sem#N`.
const SEMAPHORE: &str = "sem";

/// The wall clock in ms since the Unix epoch: one clock for every process of a run (the
/// semaphore mode runs no worker under libfaketime and no server with a clock offset).
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The most leases of the semaphore that sent writes with unexpired tokens at one time: each
/// lease (slot job, generation) counts from its grant (`HOLD`) to its last write stamped
/// before its local deadline (`SEND`); ends sort before starts at the same millisecond.
fn most_writers_at_once(worker_logs: &[String]) -> usize {
    let mut spans: BTreeMap<(String, u64), (Option<u64>, Option<u64>)> = BTreeMap::new();
    for line in worker_logs.iter().flat_map(|l| l.lines()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if let ["HOLD" | "SEND", job, generation, at] = f.as_slice() {
            let (Ok(generation), Ok(at)) = (generation.parse(), at.parse::<u64>()) else {
                continue;
            };
            let span = spans.entry(((*job).to_owned(), generation)).or_default();
            if f[0] == "HOLD" {
                span.0 = Some(at);
            } else {
                span.1 = Some(span.1.map_or(at, |end: u64| end.max(at)));
            }
        }
    }
    let mut events: Vec<(u64, i32)> = Vec::new();
    for (start, end) in spans.values() {
        if let (Some(start), Some(end)) = (start, end) {
            events.push((*start, 1));
            events.push((*end, -1));
        }
    }
    events.sort_unstable(); // -1 before 1 at the same time
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in events {
        now += step;
        most = most.max(now);
    }
    most as usize
}

// ------------------------------------------------------------------------------------------
// The worker process
// ------------------------------------------------------------------------------------------

/// Entry point of a worker process; run by the harness only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "worker process of the fault-injection harness, not a test on its own"]
async fn fault_worker() {
    let spec = std::env::var(WORKER_ENV).expect("started by the harness");
    let parts: Vec<&str> = spec.split(' ').collect();
    let [server, proxy, id, jobs, secs, seed, window, sql @ ..] = parts.as_slice() else {
        panic!("bad spec {spec}")
    };
    // `<database url> <schema>`: this worker writes its effects with SQL, not through the
    // proxy.
    let sql = match sql {
        [url, schema] => Some(SqlWriter::connect(url, schema, false).await),
        [url, schema, "ignore-expiry"] => Some(SqlWriter::connect(url, schema, true).await),
        _ => None,
    };
    // `slots`: this worker claims a slot of the semaphore SEMAPHORE, of `jobs` slots.
    let slots = parts.last() == Some(&"slots");
    // `grpc`: this worker calls the ledger through the proxy with a tonic client.
    let grpc = match sql {
        None if parts.last() == Some(&"grpc") => Some(
            tonic::transport::Channel::from_shared(proxy.to_string())
                .unwrap()
                .connect_lazy(),
        ),
        _ => None,
    };
    let (id, jobs, secs, window): (u64, u64, u64, u64) = (
        id.parse().unwrap(),
        jobs.parse().unwrap(),
        secs.parse().unwrap(),
        window.parse().unwrap(),
    );
    let began = Instant::now();
    let holding = std::env::var_os(HOLDING_ENV);
    let hold = |on: bool| {
        if let Some(file) = &holding {
            let _ = std::fs::write(file, if on { "1" } else { "0" });
        }
    };
    let mut rng = Rng(seed.parse::<u64>().unwrap() ^ (id + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let store = HttpLeaseStore::new(server)
        .unwrap()
        .timeout(Duration::from_millis(500));
    let client = LeaseClient::new(store)
        .owner(format!("w{id}-{}", std::process::id()).parse().unwrap())
        .ttl(Ttl::from_millis(TTL_MS).unwrap());
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let until = Instant::now() + Duration::from_secs(secs);
    let mut seq = 0u64;
    while Instant::now() < until {
        // With a window, the jobs in use move on every `window` seconds, so older ones go
        // idle and are forgotten while stalled workers may still hold their tokens.
        let shift = began
            .elapsed()
            .as_secs()
            .checked_div(window)
            .map_or(0, |w| w * jobs);
        let job = format!("job-{}", shift + rng.below(jobs));
        let claimed = if slots {
            let resource = SEMAPHORE.parse().unwrap();
            client
                .claim_slot(resource, jobs as u32, Duration::ZERO)
                .await
        } else {
            client.claim(job.parse().unwrap()).await
        };
        let lease = match claimed {
            Ok(lease) => lease,
            Err(ClaimError::Held { .. }) => {
                tokio::time::sleep(Duration::from_millis(10 + rng.below(60))).await;
                continue;
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await; // server down: retry
                continue;
            }
        };
        let generation = lease.generation().get();
        let job = lease.job().to_string(); // a slot's job, in the semaphore mode
        println!("CLAIM {job} {generation} {}", client.owner_id());
        if slots {
            println!("HOLD {job} {generation} {}", wall_ms());
        }
        hold(true);
        // Between being stamped with the token and being sent, a request may be held up (a
        // pause, a slow network): the window a stale write slips through. Sent at the first
        // poll, as hyper's client sends, then on a task of its own, as bytes on the wire: the
        // layer giving up on it at the loss does not recall it.
        let delay = rng.below(50);
        let net = {
            let http = http.clone();
            tower::service_fn(move |req: Request<Full<Bytes>>| {
                let http = http.clone();
                async move {
                    let on_the_wire = tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(delay)).await;
                        // A deadline on the answer: a 75-minute soak ended with one worker
                        // waiting forever, no socket open and no timer set, and this was the
                        // worker's only wait without a deadline of its own.
                        match tokio::time::timeout(Duration::from_secs(10), http.request(req)).await
                        {
                            Ok(answer) => answer.map_err(fence_storage::BoxError::from),
                            Err(_) => Err("no answer within 10 s".into()),
                        }
                    });
                    on_the_wire.await?
                }
            })
        };
        let mut svc = ServiceBuilder::new()
            .layer(lease.fencing_layer())
            .service(net);
        // Now and then, a request whose body stalls mid-way, or that is cut mid-body: the
        // newer holder of this job must not wait on it for longer than the body deadline.
        if let (0, Some(token), None) = (rng.below(6), lease.token_string(), &grpc) {
            let cut = rng.below(2) == 0;
            let keyed = rng.below(2) == 0;
            let stall = Duration::from_millis(rng.below(3 * TTL_MS));
            misbehave(proxy, &job, &token, cut, keyed, stall);
            println!("MISBEHAVED {job} {generation}");
        }
        // With forgetting on, now and then a write with this token is held in the network
        // for longer than the proxy forgets by (4 s; on sled stretched by its timeouts), then delivered: by then a newer
        // holder may have written and the job been forgotten (contract section 8, proof b).
        if let (true, 0, Some(token)) = (window > 0, rng.below(4), lease.token_string()) {
            seq += 1;
            let hold = Duration::from_millis(PAST_FORGETTING_MS + rng.below(1_500));
            deliver_late(proxy, &job, &token, id, seq, hold, generation);
        }
        for i in 0..1 + rng.below(6) {
            seq += 1;
            if let Some(sql) = &sql {
                if lease.is_lost() {
                    println!("REFUSED {job} {generation}");
                    break;
                }
                // Held up between the check and the write, like a request in the network.
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let end = lease.token_string().as_deref().and_then(lease_end);
                match sql.write(&job, generation, end, id, seq).await {
                    Ok(_) => println!("ACK {job} {generation} {id} {seq}"),
                    Err(status) => println!("REJECTED {job} {generation} {status}"),
                }
                tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                continue;
            }
            if let Some(channel) = &grpc {
                let outcome = grpc_charge(channel, &lease, delay, id, seq).await;
                if i == 0 {
                    println!("FIRSTLAT {}", outcome.1);
                }
                match outcome.0 {
                    Ok(()) => println!("ACK {job} {generation} {id} {seq}"),
                    Err(status) => {
                        let lost = std::error::Error::source(&status)
                            .and_then(|e| e.downcast_ref::<fence_lease::LeaseLost>());
                        match status.metadata().get("fence-problem-type") {
                            _ if lost.is_some_and(|l| l.in_flight) => {
                                println!("CUT {job} {generation}")
                            }
                            _ if lost.is_some() => println!("REFUSED {job} {generation}"),
                            Some(_) => {
                                println!(
                                    "REJECTED {job} {generation} grpc-{}",
                                    status.code() as i32
                                )
                            }
                            None => println!("NETERR {job} {generation}"),
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                continue;
            }
            // Every write carries an Idempotency-Key and is retried, the same request, after
            // a network error or a 5xx while the lease holds: a retry whose first try did
            // land must be replayed (or refused as in flight), never applied twice, and a
            // replayed 2xx must stand for an effect the upstream really applied.
            let sent = Instant::now();
            // The first try's time at the proxy: its whole time less its time at the upstream.
            let mut first_try = None;
            let mut attempt = 0;
            let result = loop {
                attempt += 1;
                let req = Request::post(format!("{proxy}/effects"))
                    .header("x-worker", id)
                    .header("x-seq", seq)
                    .header("idempotency-key", format!("\"w{id}-s{seq}\""))
                    .body(Full::new(Bytes::from(format!("w{id} s{seq}"))))
                    .unwrap();
                if slots {
                    // The wall clock first, then the lease's local deadline: a write logged
                    // here was stamped with a token that was still good at that time.
                    let now = wall_ms();
                    if tokio::time::Instant::now() < lease.deadline() && !lease.is_lost() {
                        println!("SEND {job} {generation} {now}");
                    }
                }
                let result = svc.ready().await.unwrap().call(req).await;
                first_try.get_or_insert_with(|| {
                    let upstream = result.as_ref().ok().and_then(|r| {
                        let ms = r.headers().get(UPSTREAM_MS)?.to_str().ok()?.parse().ok()?;
                        Some(Duration::from_millis(ms))
                    });
                    sent.elapsed().saturating_sub(upstream.unwrap_or_default())
                });
                let again = match &result {
                    Ok(resp) => resp.status().is_server_error(),
                    Err(e) => !e.is::<fence_lease::LeaseLost>(),
                };
                // Up to 5 tries over about 1.5 s: long enough for a killed proxy to be back.
                if !again || attempt == 5 || lease.is_lost() {
                    break result;
                }
                println!("RETRIED {job} {generation}");
                tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
            };
            if let (0, Some(took)) = (i, first_try) {
                // The first write of a generation is the one that raises the job at the proxy
                // (its first try: retries wait on purpose).
                println!("FIRSTLAT {}", took.as_millis());
            }
            match result {
                Ok(resp) if resp.status().is_success() => {
                    if resp.headers().contains_key("idempotent-replayed") {
                        println!("REPLAYED {job} {generation}");
                    }
                    println!("ACK {job} {generation} {id} {seq}")
                }
                Ok(resp) => println!("REJECTED {job} {generation} {}", resp.status().as_u16()),
                Err(e) => match e.downcast_ref::<fence_lease::LeaseLost>() {
                    Some(lost) if lost.in_flight => println!("CUT {job} {generation}"),
                    Some(_) => println!("REFUSED {job} {generation}"),
                    None => println!("NETERR {job} {generation}"),
                },
            }
            tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
        }
        hold(false); // before the release: a stop from here on is not counted
        match rng.below(3) {
            0 => drop(lease), // let it expire
            _ => {
                let _ = lease.release().await;
            }
        }
    }
    if window > 0 {
        // Writes still held in the network arrive before the worker ends.
        tokio::time::sleep(Duration::from_millis(PAST_FORGETTING_MS + 1_500)).await;
    }
}

/// One charge through the proxy with a generated tonic client on `channel`, stamped by the
/// lease's `FencingLayer`, held up `delay_ms` between being stamped and being sent; the
/// account names the worker and the sequence number. Returns the outcome and its latency.
async fn grpc_charge(
    channel: &tonic::transport::Channel,
    lease: &fence_lease::Lease<HttpLeaseStore>,
    delay_ms: u64,
    id: u64,
    seq: u64,
) -> (Result<(), tonic::Status>, u128) {
    use fence_suite::ledger::proto::{ChargeRequest, ledger_client::LedgerClient};
    let net = {
        let channel = channel.clone();
        tower::service_fn(move |req: http::Request<tonic::body::Body>| {
            let mut channel = channel.clone();
            // Sent at the first poll, then on a task of its own, as bytes on the wire (see
            // `net` in `fault_worker`), with a deadline of its own.
            async move {
                let on_the_wire = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    let call = async {
                        // A channel must be ready before each call.
                        channel.ready().await?.call(req).await
                    };
                    match tokio::time::timeout(Duration::from_secs(10), call).await {
                        Ok(answer) => answer.map_err(fence_storage::BoxError::from),
                        Err(_) => Err(fence_storage::BoxError::from("no answer within 10 s")),
                    }
                });
                on_the_wire.await?
            }
        })
    };
    let svc = ServiceBuilder::new()
        .layer(lease.fencing_layer())
        .service(net);
    let mut ledger = LedgerClient::new(svc);
    let sent = Instant::now();
    let request = ChargeRequest {
        account: format!("{id}:{seq}"),
        amount_cents: 1,
    };
    let result = tokio::time::timeout(Duration::from_secs(10), ledger.charge(request)).await;
    let result = match result {
        Ok(r) => r.map(drop),
        Err(_) => Err(tonic::Status::deadline_exceeded("no answer in 10 s")),
    };
    (result, sent.elapsed().as_millis())
}

/// A lease client of the forced cases, at the lease server `server`: 2 s per request, the
/// run's TTL.
fn forced_client(server: &str) -> LeaseClient<HttpLeaseStore> {
    let store = HttpLeaseStore::new(server)
        .unwrap()
        .timeout(Duration::from_secs(2));
    LeaseClient::new(store).ttl(Ttl::from_millis(TTL_MS).unwrap())
}

/// Claims `job` with `client`, asking again every 50 ms for up to `within` (a server that
/// is restarting, a lease still held): the lease, or the last refusal.
async fn claim_within(
    client: &LeaseClient<HttpLeaseStore>,
    job: &str,
    within: Duration,
) -> Result<fence_lease::Lease<HttpLeaseStore>, ClaimError> {
    let began = Instant::now();
    loop {
        match client.claim(job.parse().unwrap()).await {
            Err(_) if began.elapsed() < within => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            answered => return answered,
        }
    }
}

/// Writes job `forced-forgotten` with SQL under two leases, one after the other; waits until
/// the proxy has forgotten the job (its fence row is gone); then writes once more with the
/// first lease's token, its lease long over. A writer that passes its token's lease end is
/// refused (expired); one that always claims a lease end a full TTL ahead (`ignore_expiry`)
/// is taken for a new job's first writer and commits after the newer generation: a stale
/// effect. Its lines, for the checker.
async fn stale_sql_write_after_forgetting(
    server: &str,
    url: &str,
    schema: &str,
    ignore_expiry: bool,
) -> String {
    const JOB: &str = "forced-forgotten";
    let writer = SqlWriter::connect(url, schema, ignore_expiry).await;
    let client = forced_client(server);
    let mut out = String::new();
    let write = async |generation: u64, end: Option<u64>, seq: u64| match writer
        .write(JOB, generation, end, 900, seq)
        .await
    {
        Ok(_) => format!("ACK {JOB} {generation} 900 {seq}\n"),
        Err(status) => format!("REJECTED {JOB} {generation} {status}\n"),
    };
    let mut first = None;
    for seq in 1..=2 {
        let lease = claim_within(&client, JOB, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("claiming {JOB}: {e}"));
        let generation = lease.generation().get();
        let end = lease.token_string().as_deref().and_then(lease_end);
        out += &format!("CLAIM {JOB} {generation} {}\n", client.owner_id());
        out += &write(generation, end, seq).await;
        first.get_or_insert((generation, end));
        let _ = lease.release().await;
    }
    let pg = connect(url).await.unwrap();
    let count = format!("SELECT count(*) FROM {schema}.sink_generations WHERE job = $1");
    let began = Instant::now();
    while pg
        .query_one(&count, &[&JOB])
        .await
        .unwrap()
        .get::<_, i64>(0)
        > 0
    {
        assert!(
            began.elapsed() < Duration::from_secs(40),
            "the proxy did not forget {JOB} within 40 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (generation, end) = first.expect("two leases");
    let last = write(generation, end, 3).await;
    // Told apart from the run's other refusals: the one the SQL mode asserts on.
    out += &last.replace(" 409\n", " 409-forgotten\n");
    out
}

/// One write to `{proxy}/effects` as job `job` with `token`, not numbered (sequence 0),
/// from worker 200: its status and whether it was refused as expired.
async fn write_once(proxy: &str, job: &str, token: &str) -> (u16, bool) {
    let (status, expired, _) = write_held(proxy, job, token, None).await;
    (status, expired)
}

/// [`write_once`], with `x-hold-ms` when given (see [`Asked::hold_ms`]); and whether the
/// answer came from the upstream (it carries `x-upstream-ms`) rather than the proxy.
async fn write_held(
    proxy: &str,
    job: &str,
    token: &str,
    hold_ms: Option<u64>,
) -> (u16, bool, bool) {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::post(format!("{proxy}/effects"))
        .header("x-fencing-job", job)
        .header("x-fencing-token", token)
        .header("x-worker", "200")
        .header("x-seq", "0");
    if let Some(ms) = hold_ms {
        req = req.header("x-hold-ms", ms.to_string());
    }
    let req = req.body(Full::new(Bytes::from_static(b"forced"))).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), http.request(req)).await {
        Ok(Ok(r)) => {
            let status = r.status().as_u16();
            let upstream = r.headers().contains_key(UPSTREAM_MS);
            let body = r.into_body().collect().await.map(|b| b.to_bytes());
            let expired =
                body.is_ok_and(|b| String::from_utf8_lossy(&b).contains("urn:fence:token-expired"));
            (status, expired, upstream)
        }
        _ => (0, false, false),
    }
}

/// How many held writes (`x-hold-ms` above 0) reached the SQL upstream: the forced reorder
/// sends the newer write once its older one is there.
static HELD_ARRIVED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The multi-node modes' case, made on purpose: job `forced-reorder` written through
/// `first` under one lease and held at the upstream, while the lease is released, the next
/// one claimed at `servers[1]` and its write sent through `second`; the held write goes on
/// once the newer one has committed (or after 2 s, inside the proxies' 3 s upstream
/// timeout). With the SQL fence in the effect's transaction it is refused where it commits
/// (`409-reordered`, the upstream's answer); without it, it commits after the newer one:
/// out of order.
async fn reorder_across_proxies(servers: &[String], first: &str, second: &str) -> String {
    const JOB: &str = "forced-reorder";
    for proxy in [first, second] {
        let addr = proxy.trim_start_matches("http://").to_owned();
        let began = Instant::now();
        while std::net::TcpStream::connect(&addr).is_err() {
            if began.elapsed() > Duration::from_secs(20) {
                return format!("REJECTED {JOB} 0 proxy-down\n");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Past the restart hold of a proxy restarted at the end of the run (2.5 s here), which
    // would hold the newer write back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let claim = async |server: &str| {
        let client = forced_client(server);
        let lease = claim_within(&client, JOB, Duration::from_secs(15))
            .await
            .ok()?;
        Some((lease, client.owner_id().to_string()))
    };
    let Some((older, owner)) = claim(&servers[0]).await else {
        return format!("REJECTED {JOB} 0 never-claimed\n");
    };
    let mut out = String::new();
    let generation = older.generation().get();
    out += &format!("CLAIM {JOB} {generation} {owner}\n");
    let token = older
        .token_string()
        .unwrap_or_else(|| generation.to_string());
    let arrived = HELD_ARRIVED.load(std::sync::atomic::Ordering::SeqCst);
    let held = {
        let (first, token) = (first.to_owned(), token.clone());
        tokio::spawn(async move { write_held(&first, JOB, &token, Some(2_000)).await })
    };
    // The held write is past the first proxy's gate once the upstream has it.
    let began = Instant::now();
    while HELD_ARRIVED.load(std::sync::atomic::Ordering::SeqCst) == arrived {
        if began.elapsed() > Duration::from_secs(10) {
            return out + &format!("REJECTED {JOB} {generation} held-never-arrived\n");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = older.release().await;
    let Some((newer, owner)) = claim(&servers[1]).await else {
        return out + &format!("REJECTED {JOB} 0 never-claimed-again\n");
    };
    let newer_generation = newer.generation().get();
    out += &format!("CLAIM {JOB} {newer_generation} {owner}\n");
    let newer_token = newer
        .token_string()
        .unwrap_or_else(|| newer_generation.to_string());
    out += &match write_held(second, JOB, &newer_token, Some(0)).await {
        (200, _, _) => format!("ACK {JOB} {newer_generation} 200 0\n"),
        (status, _, _) => format!("REJECTED {JOB} {newer_generation} {status}-newer\n"),
    };
    let _ = newer.release().await;
    out += &match held.await {
        Ok((200, _, _)) => format!("ACK {JOB} {generation} 200 0\n"),
        Ok((409, _, true)) => format!("REJECTED {JOB} {generation} 409-reordered\n"),
        Ok((status, _, upstream)) => {
            let whose = if upstream { "upstream" } else { "proxy" };
            format!("REJECTED {JOB} {generation} {status}-held-at-{whose}\n")
        }
        Err(_) => format!("REJECTED {JOB} {generation} held-write-panicked\n"),
    };
    out
}

/// The fenced mode's case, sent on purpose: job `forced-stale` raised to 5 through the
/// proxy, then a write with token 1. Its line for the checker (`409-forced` when refused).
async fn stale_http_write(proxy: &str) -> String {
    let (raised, _) = write_once(proxy, "forced-stale", "5").await;
    let (status, _) = write_once(proxy, "forced-stale", "1").await;
    let status = if raised == 200 && status == 409 {
        "409-forced".to_owned()
    } else {
        format!("{status}-forced-after-{raised}")
    };
    format!("REJECTED forced-stale 1 {status}\n")
}

/// The forgetting mode's case, made on purpose: a signed lease of job `forced-forgotten`
/// whose token wrote once at the start of the run. [`late_write_of_forgotten`] sends it
/// again once the proxy has forgotten the job.
async fn first_write_to_forget(server: &str, proxy: &str) -> Option<(String, u64)> {
    const JOB: &str = "forced-forgotten";
    let client = forced_client(server);
    let lease = client.claim(JOB.parse().unwrap()).await.ok()?;
    let token = lease.token_string()?;
    let generation = lease.generation().get();
    let _ = write_once(proxy, JOB, &token).await;
    let _ = lease.release().await;
    Some((token, generation))
}

/// Waits (up to 40 s) until the proxy's fence of `forced-forgotten` reads as never seen,
/// then writes with the old token: its line (`409-forgotten` when refused as expired).
async fn late_write_of_forgotten(proxy: &str, admin: &str, token: &str, generation: u64) -> String {
    let began = Instant::now();
    loop {
        let (status, body) = exchange(admin, "GET", "/v1/fence/forced-forgotten", &[], "");
        if status == 200 && body.contains("\"highest\":0") {
            break;
        }
        if began.elapsed() > Duration::from_secs(40) {
            return format!("REJECTED forced-forgotten {generation} never-forgotten\n");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    match write_once(proxy, "forced-forgotten", token).await {
        (409, true) => format!("REJECTED forced-forgotten {generation} 409-forgotten\n"),
        (200, _) => format!("ACK forced-forgotten {generation} 200 0\n"),
        (status, _) => format!("REJECTED forced-forgotten {generation} {status}\n"),
    }
}

/// Raises job `forced-stale` to 5 with one charge through the proxy at `proxy`, then sends
/// one with token 1: the gRPC status that second call got (10, ABORTED, when refused as
/// stale; -1 when it failed without one).
async fn stale_grpc_call(proxy: &str) -> i32 {
    use fence_suite::ledger::proto::{ChargeRequest, ledger_client::LedgerClient};
    let channel = tonic::transport::Channel::from_shared(proxy.to_owned())
        .unwrap()
        .connect_lazy();
    let mut ledger = LedgerClient::new(channel);
    let mut status = -1;
    for token in ["5", "1"] {
        let mut request = tonic::Request::new(ChargeRequest {
            account: "0:0".into(),
            amount_cents: 1,
        });
        let m = request.metadata_mut();
        m.insert("x-fencing-job", "forced-stale".parse().unwrap());
        m.insert("x-fencing-token", token.parse().unwrap());
        let call = tokio::time::timeout(Duration::from_secs(10), ledger.charge(request)).await;
        status = match call {
            Ok(Ok(_)) => 0,
            Ok(Err(s)) if s.metadata().get("fence-problem-type").is_some() => s.code() as i32,
            _ => -1,
        };
    }
    status
}

/// Sends one write with `token` after `hold`, straight to the proxy (the lease layer would
/// refuse it by then): a request the network held up. Prints its outcome like any write.
fn deliver_late(
    proxy: &str,
    job: &str,
    token: &str,
    id: u64,
    seq: u64,
    hold: Duration,
    generation: u64,
) {
    let (proxy, job, token) = (proxy.to_owned(), job.to_owned(), token.to_owned());
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let req = Request::post(format!("{proxy}/effects"))
            .header("x-fencing-job", &job)
            .header("x-fencing-token", &token)
            .header("x-worker", id)
            .header("x-seq", seq)
            .body(Full::new(Bytes::from_static(b"late")))
            .unwrap();
        match http.request(req).await {
            Ok(r) if r.status().is_success() => println!("ACK {job} {generation} {id} {seq}"),
            Ok(r) => {
                let status = r.status().as_u16();
                let body = r.into_body().collect().await.map(|b| b.to_bytes());
                let expired = body
                    .is_ok_and(|b| String::from_utf8_lossy(&b).contains("urn:fence:token-expired"));
                let kind = if expired { "-expired" } else { "" };
                println!("REJECTED {job} {generation} {status}{kind}");
            }
            Err(_) => println!("NETERR {job} {generation}"),
        }
    });
}

/// A client that sends a fenced request's head and 10 of its 100 body bytes, then either
/// closes at once (`cut`) or goes silent for `stall` before closing; in a task of its own, so
/// the worker goes on meanwhile.
fn misbehave(proxy: &str, job: &str, token: &str, cut: bool, keyed: bool, stall: Duration) {
    use tokio::io::AsyncWriteExt;
    let addr = proxy.trim_start_matches("http://").to_owned();
    let key = if keyed {
        format!("Idempotency-Key: stall-{}\r\n", std::process::id())
    } else {
        String::new()
    };
    let head = format!(
        "POST /effects HTTP/1.1\r\nHost: x\r\nX-Fencing-Job: {job}\r\nX-Fencing-Token: {token}\r\nx-worker: 0\r\nx-seq: 0\r\n{key}Content-Length: 100\r\n\r\n0123456789"
    );
    tokio::spawn(async move {
        let Ok(mut stream) = tokio::net::TcpStream::connect(&addr).await else {
            return;
        };
        if stream.write_all(head.as_bytes()).await.is_err() || cut {
            return;
        }
        tokio::time::sleep(stall).await;
    });
}

/// A writer of effects into PostgreSQL, each in a transaction that first calls the SQL
/// fence `schema.require(job, token)`, sharing the proxy's fence table. It connects again
/// when the database went away (a restart, a dropped connection).
struct SqlWriter {
    url: String,
    client: tokio::sync::Mutex<Option<tokio_postgres::Client>>,
    /// `None`: writes without the fence (the multi-node negative control's upstream).
    require: Option<String>,
    /// The same with the token's lease end, as writers must call it when sinks forget.
    require_expiring: String,
    /// Claims every lease ends a full TTL from now, the latest the sinks accept (the SQL
    /// forgetting mode's negative control: the database cannot tell it from a live lease).
    ignore_expiry: bool,
    insert: String,
}

impl SqlWriter {
    async fn connect(url: &str, schema: &str, ignore_expiry: bool) -> Self {
        let mut writer = Self::with_fence(url, schema, true).await;
        writer.ignore_expiry = ignore_expiry;
        writer
    }

    async fn with_fence(url: &str, schema: &str, fenced: bool) -> Self {
        let writer = Self {
            url: url.to_owned(),
            client: tokio::sync::Mutex::new(None),
            require: fenced.then(|| format!("SELECT {schema}.require($1, $2::text::numeric)")),
            require_expiring: format!("SELECT {schema}.require($1, $2::text::numeric, $3)"),
            ignore_expiry: false,
            insert: format!(
                // Idempotent by (worker, seq), as a destination that takes retries must be:
                // a commit whose answer a restart cut off, retried, is not applied twice. A
                // repeat is counted (`arrivals`), so the upstream can tell which it was.
                "INSERT INTO {schema}.effects (job, token, worker, seq) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (worker, seq) WHERE seq > 0
                 DO UPDATE SET arrivals = {schema}.effects.arrivals + 1 RETURNING arrivals"
            ),
        };
        *writer.client.lock().await = Some(writer.open().await.expect("the database answers"));
        writer
    }

    async fn open(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        connect(&self.url).await
    }

    /// One effect: how many times this (worker, seq) has arrived, counting this one;
    /// `Err(409)` when the fence refused it (SQLSTATE ZF409), `Err(503)` when the database
    /// failed (then it may or may not have committed). With a signed token's lease end, the
    /// fence checks it too (needed when sinks forget).
    async fn write(
        &self,
        job: &str,
        token: u64,
        expires_at_ms: Option<u64>,
        worker: u64,
        seq: u64,
    ) -> Result<i32, u16> {
        let fail = |e: tokio_postgres::Error| -> u16 {
            match e.code().map(|c| c.code()) {
                Some("ZF409") => 409,
                _ => 503,
            }
        };
        let mut slot = self.client.lock().await;
        if slot.as_ref().is_none_or(tokio_postgres::Client::is_closed) {
            *slot = Some(self.open().await.map_err(fail)?);
        }
        let client = slot.as_mut().expect("connected just now");
        let tx = client.transaction().await.map_err(fail)?;
        // The proxy's --max-lease-ttl here: a later end is refused as too long-lived (ZF403).
        let ttl_ahead = || {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
            now.map_or(0, |d| d.as_millis() as u64) + 1_000
        };
        let expires = match expires_at_ms {
            Some(_) if self.ignore_expiry => Some(ttl_ahead()),
            other => other,
        };
        let text = token.to_string();
        match (&self.require, expires) {
            (None, _) => {}
            (Some(_), Some(end)) => {
                let end = end as i64;
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&job, &text, &end];
                tx.execute(&self.require_expiring, &params)
                    .await
                    .map_err(fail)?;
            }
            (Some(require), None) => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&job, &text];
                tx.execute(require, &params).await.map_err(fail)?;
            }
        }
        let (token, worker, seq) = (token as i64, worker as i64, seq as i64);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&job, &token, &worker, &seq];
        let row = tx.query_one(&self.insert, &params).await.map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(row.get(0))
    }
}

/// What the SQL upstream answered each (worker, seq), arrival by arrival.
type Answered = BTreeMap<(u64, u64), Vec<u16>>;

/// The upstream of the SQL mode: writes every proxied effect like a SQL worker does (the
/// fence checked again in the effect's own transaction, unless `fenced` is off), after a
/// short pause so requests are in flight during generation bumps; 409 when the fence
/// refuses it. A write that arrives again is a violation (returned in the list) unless
/// every earlier arrival had finished with a 5xx: the proxy forgets those, and a retry may
/// run again (the idempotent insert absorbs it); after a 2xx or 4xx, or while the first is
/// still running, the proxy should have replayed or refused it.
async fn start_sql_upstream(
    url: &str,
    schema: &str,
    seed: u64,
    slowest_ms: u64,
    fenced: bool,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let mut writers: Vec<Arc<SqlWriter>> = Vec::new();
    for _ in 0..4 {
        writers.push(Arc::new(SqlWriter::with_fence(url, schema, fenced).await));
    }
    let (writers, next) = (
        Arc::new(writers),
        Arc::new(std::sync::atomic::AtomicUsize::new(0)),
    );
    let rng = Arc::new(Mutex::new(Rng(seed | 1)));
    let answered: Arc<Mutex<Answered>> = Arc::default();
    let repeats: Arc<Mutex<Vec<String>>> = Arc::default();
    let found = repeats.clone();
    // The newest token whose effect committed here, per job, for held writes to wait on.
    let newest: Arc<(Mutex<HashMap<String, u64>>, tokio::sync::Notify)> = Arc::default();
    let url = serve_effects(move |e: Asked| {
        let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let newest = newest.clone();
        let (writer, slow) = (
            writers[n % writers.len()].clone(),
            rng.lock().unwrap().below(slowest_ms),
        );
        let (answered, repeats) = (answered.clone(), repeats.clone());
        async move {
            match e.hold_ms {
                None => tokio::time::sleep(Duration::from_millis(slow)).await,
                Some(0) => {}
                Some(ms) => {
                    HELD_ARRIVED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let until = tokio::time::Instant::now() + Duration::from_millis(ms);
                    loop {
                        let (committed, notify) = &*newest;
                        let newer = notify.notified();
                        if committed.lock().unwrap().get(&e.job) > Some(&e.token) {
                            break;
                        }
                        if tokio::time::timeout_at(until, newer).await.is_err() {
                            break;
                        }
                    }
                }
            }
            let result = (writer.write(&e.job, e.token, e.expires_at_ms, e.worker, e.seq)).await;
            if result.is_ok() {
                let (committed, notify) = &*newest;
                let mut committed = committed.lock().unwrap();
                let token = committed.entry(e.job.clone()).or_default();
                *token = (*token).max(e.token);
                notify.notify_waiters();
            }
            let status = result.map_or_else(|status| status, |_| 200);
            let mut answered = answered.lock().unwrap();
            let earlier = answered.entry((e.worker, e.seq)).or_default();
            if let Ok(arrivals) = result
                && arrivals > 1
                && (earlier.len() + 1 != arrivals as usize
                    || earlier.iter().any(|s| *s < 500))
            {
                repeats.lock().unwrap().push(format!(
                    "worker {} seq {} reached the upstream again (arrival {arrivals}) after answers {earlier:?}",
                    e.worker, e.seq
                ));
            }
            earlier.push(status);
            status
        }
    })
    .await;
    (url, found)
}

/// What a request to an upstream asks for: the job, the token's generation, the worker and
/// its sequence number.
struct Asked {
    job: String,
    token: u64,
    /// A signed token's lease end.
    expires_at_ms: Option<u64>,
    worker: u64,
    seq: u64,
    /// `x-hold-ms`, for the forced reorder (`reorder_across_proxies`): 0 writes at once,
    /// without the upstream's random delay; more holds the write until a newer token's
    /// effect of the same job has committed here, or that many milliseconds have passed.
    hold_ms: Option<u64>,
}

/// The lease end a signed token carries (`<generation>.<expires_at_ms>.<signature>`).
fn lease_end(token: &str) -> Option<u64> {
    token.split('.').nth(1)?.parse().ok()
}

impl Asked {
    fn of(headers: &http::HeaderMap) -> Self {
        let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
        let number = |s: &str| s.parse().unwrap_or(0);
        Self {
            job: h("x-fencing-job").to_owned(),
            token: number(h("x-fencing-token").split('.').next().unwrap_or("0")),
            expires_at_ms: lease_end(h("x-fencing-token")),
            worker: number(h("x-worker")),
            seq: number(h("x-seq")),
            hold_ms: headers
                .contains_key("x-hold-ms")
                .then(|| number(h("x-hold-ms"))),
        }
    }
}

/// Serves HTTP/1.1 on a loopback port: each request whose body arrives whole is answered,
/// empty, with the status `handle` returns for what it asks; one whose body breaks off is
/// answered 400 and acts on nothing, as a handler that reads its request first does.
async fn serve_effects<F, Fut>(handle: F) -> String
where
    F: Fn(Asked) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = u16> + Send,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let handle = handle.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let handle = handle.clone();
                    async move {
                        let (head, body) = req.into_parts();
                        let began = Instant::now();
                        let status = match body.collect().await {
                            Ok(_) => handle(Asked::of(&head.headers)).await,
                            Err(_) => 400,
                        };
                        let mut response = Response::new(Full::new(Bytes::from_static(b"ok")));
                        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                        // How long the request was here (its work): the workers take it off
                        // what they measure of the proxy.
                        let here = began.elapsed().as_millis().to_string();
                        response
                            .headers_mut()
                            .insert(UPSTREAM_MS, here.parse().unwrap());
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// The effects log of the HTTP and gRPC upstreams: one line an effect (job, token, worker,
/// sequence, commit time in ms), synced before the effect is answered; one writer at a
/// time, so the file's order is the order in which effects committed.
struct EffectLog(Mutex<std::fs::File>);

impl EffectLog {
    fn open(path: &std::path::Path) -> Self {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        Self(Mutex::new(file))
    }

    fn append(&self, e: &Asked) {
        use std::io::Write;
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        let line = format!("{} {} {} {} {ms}\n", e.job, e.token, e.worker, e.seq);
        let mut file = self.0.lock().unwrap();
        file.write_all(line.as_bytes()).unwrap();
        file.sync_data().unwrap();
    }
}

// ------------------------------------------------------------------------------------------
// The harness
// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Effect {
    job: String,
    token: u64,
    worker: u64,
    seq: u64,
}

/// Long enough for the proxy to have forgotten a job idle since (its `--forget-after 4s`,
/// which it stretches to what a request of a crashed proxy may still run: the upstream
/// timeout, 3 s, plus a keyed request's wait for its record (the store timeout, 5 s), plus
/// what a keyed answer may stream on (the body timeout, 1 s), plus the hold,
/// [`SLOWEST_WORK`] + 500 ms; counted from a stamp up to
/// `STAMP_AHEAD_MS` ahead of the last admission, a pass every eighth of that, and a second of
/// slack): the stops and held writes meant to outlast it.
const PAST_FORGETTING_MS: u64 = {
    let forgets_after = 3_000 + 5_000 + 1_000 + SLOWEST_WORK.as_millis() as u64 + 500;
    forgets_after + fence_sink::STAMP_AHEAD_MS + forgets_after / 8 + 1_000
};

/// The header in which the HTTP upstream says how long a request was there, in ms.
const UPSTREAM_MS: &str = "x-upstream-ms";

/// How long an effect's work takes at the upstream before it commits: up to 15 ms, and one
/// time in ten 1 to 2 s, longer than a proxy takes to restart (a slow transaction).
fn work_ms(rng: &Mutex<Rng>) -> u64 {
    let mut rng = rng.lock().unwrap();
    if rng.below(10) == 0 {
        1_000 + rng.below(SLOWEST_WORK.as_millis() as u64 - 1_000)
    } else {
        rng.below(15)
    }
}

/// The longest an effect's work takes ([`work_ms`]): the proxies' unknown-outcome hold
/// must cover it, since the upstream goes on with a request whose proxy died.
const SLOWEST_WORK: Duration = Duration::from_millis(2_000);

/// Does an effect's work and then commits it to `log`, in a task of its own: a request whose
/// connection went away (its proxy was killed) still commits, as a database transaction
/// would. Resolves when it has committed.
fn commit_after_work(log: &Arc<EffectLog>, e: Asked, work: u64) -> tokio::task::JoinHandle<()> {
    let log = log.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(work)).await;
        log.append(&e);
    })
}

/// The upstream: commits every effect after its work (`commit_after_work`, so the log is in
/// commit order, not arrival order), then answers.
async fn start_logging_upstream(log_path: &std::path::Path, seed: u64) -> String {
    let log = Arc::new(EffectLog::open(log_path));
    let rng = Arc::new(Mutex::new(Rng(seed | 1)));
    serve_effects(move |e: Asked| {
        let committed = commit_after_work(&log, e, work_ms(&rng));
        async move {
            let _ = committed.await;
            200
        }
    })
    .await
}

/// The gRPC upstream: the ledger, logging every charge it receives like the HTTP upstream
/// (job, token, worker, sequence from the account `worker:seq`, receive time), synced
/// before it answers, then answering slowly.
async fn start_grpc_upstream(log_path: &std::path::Path, seed: u64) -> String {
    use fence_suite::ledger::proto::{
        ChargeReply, ChargeRequest,
        ledger_server::{Ledger, LedgerServer},
    };
    struct Logged {
        log: Arc<EffectLog>,
        rng: Mutex<Rng>,
    }
    impl Logged {
        /// A charge's effect (the account names the worker and sequence, `worker:seq`),
        /// committed after its work.
        fn book(
            &self,
            c: &ChargeRequest,
            m: &tonic::metadata::MetadataMap,
        ) -> tokio::task::JoinHandle<()> {
            let mut effect = Asked::of(&m.clone().into_headers());
            let (worker, seq) = c.account.split_once(':').unwrap_or(("0", "0"));
            (effect.worker, effect.seq) = (worker.parse().unwrap_or(0), seq.parse().unwrap_or(0));
            commit_after_work(&self.log, effect, work_ms(&self.rng))
        }
    }
    #[tonic::async_trait]
    impl Ledger for Logged {
        async fn charge(
            &self,
            request: tonic::Request<ChargeRequest>,
        ) -> Result<tonic::Response<ChargeReply>, tonic::Status> {
            let _ = self.book(request.get_ref(), request.metadata()).await;
            Ok(tonic::Response::new(ChargeReply {
                entry: 0,
                booked: 1,
            }))
        }
        async fn charge_many(
            &self,
            _: tonic::Request<tonic::Streaming<ChargeRequest>>,
        ) -> Result<tonic::Response<ChargeReply>, tonic::Status> {
            Err(tonic::Status::unimplemented(
                "the harness sends unary charges",
            ))
        }
    }
    let logged = Logged {
        log: Arc::new(EffectLog::open(log_path)),
        rng: Mutex::new(Rng(seed | 1)),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(LedgerServer::new(logged))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
    });
    format!("http://{addr}")
}

/// A port that is free now and stays ours across restarts of the server and the proxy.
///
/// Not one the kernel hands out by itself (`bind` to port 0, or the local end of an outgoing
/// connection, both drawn from `ip_local_port_range`, 32768–60999 by default): with workers
/// and a parallel test opening thousands of connections, such a port was once taken by an
/// outgoing connection between the check and the proxy's start. Below that range only an
/// explicit `bind` takes a port.
/// SIGKILL, and waits until the process is gone.
fn kill_and_reap(p: &mut Proc) {
    let _ = p.0.kill();
    let _ = p.0.wait();
}

/// Restarts the local PostgreSQL cluster at once (`-m immediate`: no checkpoint, crash
/// recovery on start); whether it came back.
fn restart_postgres() -> bool {
    // A throwaway cluster (no DATABASE_URL, no local server) restarts itself; the system's
    // clusters are never touched then.
    if let Some(restarted) = fence_storage::postgres::restart_throwaway_test_database() {
        return restarted;
    }
    let Some(version) = std::fs::read_dir("/etc/postgresql").ok().and_then(|d| {
        d.filter_map(|e| e.ok()?.file_name().into_string().ok())
            .max()
    }) else {
        return false;
    };
    // FENCE_SOAK_PG_CLUSTER: a soak on a cluster of its own (DATABASE_URL naming its port)
    // restarts that one, so other tests can use the main cluster meanwhile.
    let cluster = std::env::var("FENCE_SOAK_PG_CLUSTER").unwrap_or_else(|_| "main".into());
    Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            "-m",
            "immediate",
            &version,
            &cluster,
            "restart",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A connection to `url` of its own, driven in the background.
async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

/// Ends every other connection to the test database (the servers' and proxies' pools, the
/// writers'); how many.
async fn drop_connections(url: &str) -> u64 {
    let Ok(client) = connect(url).await else {
        return 0;
    };
    client
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .await
        .map(|rows| rows.len() as u64)
        .unwrap_or(0)
}

fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    let seed = RandomState::new();
    (0u64..)
        .map(|n| 20_000 + u16::try_from(seed.hash_one(n) % 12_000).unwrap())
        .find(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .unwrap()
}

#[derive(Debug, Default)]
struct Report {
    faults: BTreeMap<&'static str, u64>,
    effects: usize,
    outcomes: BTreeMap<String, u64>,
    stale_effects: Vec<String>,
    reused_generations: Vec<String>,
    lost_acks: Vec<String>,
    /// One write (worker, sequence number) applied more than once.
    duplicate_effects: Vec<String>,
    claims: usize,
    /// Effects written by the SQL workers (SQL mode).
    sql_effects: usize,
    /// How long the first write of each generation took, in ms (it waits for older
    /// requests of its job, stalled ones included); over HTTP without its time at the
    /// upstream.
    first_latencies: Vec<u64>,
    /// Claims per job (the semaphore mode's slots among them).
    claims_by_job: BTreeMap<String, usize>,
    /// The most leases that sent writes with unexpired tokens at one time (semaphore mode).
    most_writers: usize,
}

impl Report {
    /// Counts `n` more faults of `kind`.
    fn fault(&mut self, kind: &'static str, n: u64) {
        *self.faults.entry(kind).or_default() += n;
    }

    /// The 99th percentile of the first writes' latencies, in ms (0 without any).
    fn first_write_p99(&self) -> u64 {
        let mut v = self.first_latencies.clone();
        v.sort_unstable();
        v.get((v.len() * 99 / 100).min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    }

    fn violations(&self) -> usize {
        self.stale_effects.len() + self.reused_generations.len() + self.duplicate_effects.len()
    }

    fn print(&self, title: &str, seed: u64) {
        println!("\n== {title} (seed {seed}) ==");
        println!("{:<40} {:>8}", "faults injected", "");
        for (k, v) in &self.faults {
            println!("  {k:<38} {v:>8}");
        }
        println!("{:<40} {:>8}", "claims acknowledged", self.claims);
        println!(
            "{:<40} {:>8}",
            "effects applied (upstream log)", self.effects
        );
        for (k, v) in &self.outcomes {
            println!("  worker saw {k:<27} {v:>8}");
        }
        println!(
            "{:<40} {:>8}",
            "violations: stale effects",
            self.stale_effects.len()
        );
        println!(
            "{:<40} {:>8}",
            "violations: generation reused",
            self.reused_generations.len()
        );
        println!(
            "{:<40} {:>8}",
            "violations: a write applied twice",
            self.duplicate_effects.len()
        );
        println!(
            "{:<40} {:>8}",
            "lost acknowledgements",
            self.lost_acks.len()
        );
        println!(
            "{:<40} {:>8}",
            "newer holder's first write, p99 ms",
            self.first_write_p99()
        );
        if self.most_writers > 0 {
            println!(
                "{:<40} {:>8}",
                "most leases writing at once, unexpired", self.most_writers
            );
        }
        for v in self
            .stale_effects
            .iter()
            .chain(&self.reused_generations)
            .chain(&self.duplicate_effects)
            .chain(&self.lost_acks)
            .take(5)
        {
            println!("  e.g. {v}");
        }
    }
}

fn check(effects: &[Effect], worker_logs: &[String], report: &mut Report) {
    report.effects = effects.len();
    // No effect with token g after an effect of the same job with token g' > g.
    let mut highest: BTreeMap<&str, u64> = BTreeMap::new();
    for (i, e) in effects.iter().enumerate() {
        let h = highest.entry(&e.job).or_default();
        if e.token < *h {
            report.stale_effects.push(format!(
                "effect #{i}: job {} token {} after token {} (worker {} seq {})",
                e.job, e.token, h, e.worker, e.seq
            ));
        }
        *h = (*h).max(e.token);
    }
    // Each write is applied at most once, retried or not (sequence 0: requests that are not
    // numbered, such as the stalled bodies).
    let mut times: BTreeMap<(u64, u64), usize> = BTreeMap::new();
    for e in effects.iter().filter(|e| e.seq > 0) {
        *times.entry((e.worker, e.seq)).or_default() += 1;
    }
    for ((worker, seq), n) in times.into_iter().filter(|(_, n)| *n > 1) {
        report
            .duplicate_effects
            .push(format!("worker {worker} seq {seq} applied {n} times"));
    }
    let applied: HashSet<(u64, u64)> = effects.iter().map(|e| (e.worker, e.seq)).collect();
    let mut owners: BTreeMap<(String, u64), BTreeSet<String>> = BTreeMap::new();
    for line in worker_logs.iter().flat_map(|l| l.lines()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["CLAIM", job, generation, owner] => {
                report.claims += 1;
                *report.claims_by_job.entry((*job).to_owned()).or_default() += 1;
                owners
                    .entry(((*job).to_owned(), generation.parse().unwrap()))
                    .or_default()
                    .insert((*owner).to_owned());
            }
            ["ACK", job, token, worker, seq] => {
                *report.outcomes.entry("2xx".into()).or_default() += 1;
                if !applied.contains(&(worker.parse().unwrap(), seq.parse().unwrap())) {
                    report.lost_acks.push(format!("worker {worker} seq {seq} (job {job} token {token}) acknowledged but not applied"));
                }
            }
            ["REJECTED", _, _, status] => {
                let kind = match status.strip_prefix("grpc-") {
                    Some(code) => format!("gRPC status {code}"),
                    None => format!("HTTP {status}"),
                };
                *report.outcomes.entry(kind).or_default() += 1
            }
            ["REFUSED", ..] => {
                *report
                    .outcomes
                    .entry("refused by layer".into())
                    .or_default() += 1
            }
            ["CUT", ..] => {
                *report
                    .outcomes
                    .entry("cut in flight by layer (outcome unknown)".into())
                    .or_default() += 1
            }
            ["NETERR", ..] => *report.outcomes.entry("network error".into()).or_default() += 1,
            ["RETRIED", ..] => {
                *report
                    .outcomes
                    .entry("a retry (same Idempotency-Key)".into())
                    .or_default() += 1
            }
            ["REPLAYED", ..] => {
                *report
                    .outcomes
                    .entry("a 2xx replayed from its record".into())
                    .or_default() += 1
            }
            ["FIRSTLAT", ms] => report.first_latencies.push(ms.parse().unwrap_or(0)),
            ["MISBEHAVED", ..] => {
                *report
                    .outcomes
                    .entry("stalled or cut a body".into())
                    .or_default() += 1
            }
            _ => {}
        }
    }
    report.most_writers = most_writers_at_once(worker_logs);
    for ((job, generation), who) in owners {
        if who.len() > 1 {
            report.reused_generations.push(format!(
                "job {job} generation {generation} granted to {who:?}"
            ));
        }
    }
}

/// How the proxy fences in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// As shipped.
    Fenced,
    /// Signed tokens, and both the proxy and the server forgetting idle jobs after a few
    /// seconds (TTLs and skew scaled down to match).
    Forgetting,
    /// Fencing disabled: the negative control.
    Unfenced,
    /// Fenced, but a restarted proxy forgets what the process before left running at the
    /// upstream: the negative control of the restart hold.
    RestartHoldOff,
    /// The proxy's fence in PostgreSQL, shared with workers writing through the SQL fence
    /// (with their tokens' lease ends), signed tokens, and the proxy forgetting idle jobs.
    Sql,
    /// The same, with SQL writers that claim every lease ends a full TTL from now: the
    /// database cannot tell a stale token of a job the proxy forgot (the negative control of
    /// `Sql`).
    SqlIgnoresExpiry,
    /// A gRPC upstream, and workers calling it with tonic clients through the proxy.
    Grpc,
    /// Two lease servers and three proxies on one PostgreSQL, with the SQL mode's writers,
    /// and faults of the database too: a restart and dropped connections.
    MultiNode,
    /// The same, with an upstream that writes without the SQL fence: nothing orders effects
    /// across proxies then (the negative control of `MultiNode`).
    MultiNodeUnordered,
    /// Workers claim slots of one fenced semaphore of 2 slots, more workers than slots;
    /// every clock is the machine's (no skewed workers, no server clock jumps), so the
    /// writers with unexpired tokens at once can be counted.
    Semaphore,
}

impl Mode {
    fn multi_node(self) -> bool {
        matches!(self, Mode::MultiNode | Mode::MultiNodeUnordered)
    }

    /// Whether the fences and the effects live in PostgreSQL.
    fn on_postgres(self) -> bool {
        matches!(self, Mode::Sql | Mode::SqlIgnoresExpiry) || self.multi_node()
    }

    /// Whether tokens are signed and the proxy and the server forget idle jobs.
    fn forgets(self) -> bool {
        matches!(self, Mode::Forgetting | Mode::Sql | Mode::SqlIgnoresExpiry)
    }
}

async fn run(seed: u64, secs: u64, mode: Mode) -> Report {
    let fencing = mode != Mode::Unfenced;
    let _turn = ONE_RUN_AT_A_TIME.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    if mode.forgets() {
        assert!(
            fence(&["keygen", "--out", keys.to_str().unwrap()])
                .status
                .success()
        );
    }
    let log_path = dir.path().join("effects.log");
    // The SQL mode's database, schema and effects table.
    let sql = if mode.on_postgres() {
        let url =
            database_url().expect("DATABASE_URL names the test database (the SQL mode needs it)");
        let schema = unique_schema("fault_sql");
        let client = connect(&url).await.unwrap();
        client
            .batch_execute(&format!(
                "CREATE SCHEMA {schema}; CREATE TABLE {schema}.effects (
                   id bigserial PRIMARY KEY, job text NOT NULL, token bigint NOT NULL,
                   worker bigint NOT NULL, seq bigint NOT NULL, arrivals int NOT NULL DEFAULT 1);
                 CREATE UNIQUE INDEX ON {schema}.effects (worker, seq) WHERE seq > 0"
            ))
            .await
            .unwrap();
        Some((url, schema, client))
    } else {
        None
    };
    let mut upstream_repeats: Arc<Mutex<Vec<String>>> = Arc::default();
    let upstream = match &sql {
        Some((url, schema, _)) => {
            // The fence's table and functions exist before the upstream or a worker uses
            // them (the proxy would create them too).
            use fence_sink::postgres::{PgStore, PgTables};
            let tables = PgTables::new(schema, "sink").unwrap();
            PgStore::connect(url, tables)
                .await
                .unwrap()
                .migrate()
                .await
                .unwrap();
            // Several proxies: a slow upstream (up to 1.2 s, two leases), so a request one
            // proxy admitted is often still on its way when its worker has lost the lease
            // and another proxy passes the newer holder's token.
            let slowest = if mode.multi_node() { 1_200 } else { 15 };
            let ordered = mode != Mode::MultiNodeUnordered;
            let (url, repeats) = start_sql_upstream(url, schema, seed, slowest, ordered).await;
            upstream_repeats = repeats;
            url
        }
        None if mode == Mode::Grpc => start_grpc_upstream(&log_path, seed).await,
        None => start_logging_upstream(&log_path, seed).await,
    };
    let (servers_n, proxies_n) = if mode.multi_node() { (2, 3) } else { (1, 1) };
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < servers_n + proxies_n {
        let port = free_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    let (server_ports, proxy_ports) = ports.split_at(servers_n);
    // Each proxy's admin listener, on a port of its own across restarts.
    let admin_ports: Vec<u16> = (0..proxies_n)
        .map(|_| {
            loop {
                let port = free_port();
                if !ports.contains(&port) {
                    break port;
                }
            }
        })
        .collect();
    // The second server of a multi-node run has its system clock 30 s ahead (libfaketime):
    // the database's clock decides, so it must not matter.
    let libfaketime = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists());
    let faketime = std::env::var_os("FENCE_FAULT_NO_FAKETIME").is_none()
        && libfaketime.is_some()
        && mode != Mode::Semaphore;
    let leases = dir.path().join("leases");
    let sink = dir.path().join("sink");
    let start_server = |i: usize, offset: i64| {
        let listen = format!("127.0.0.1:{}", server_ports[i]);
        let offset = offset.to_string();
        let mut args = vec![
            "server",
            "--listen",
            &listen,
            "--data-dir",
            leases.to_str().unwrap(),
            "--clock-offset-ms",
            &offset,
        ];
        let key = keys.join("fence-signing.pem");
        if mode.forgets() {
            args.extend(["--signing-key", key.to_str().unwrap()]);
            args.extend(["--max-ttl", "1s", "--forget-after", "2s"]);
        }
        let mut command = Command::new(FENCE);
        if let Some((url, schema, _)) = sql.as_ref().filter(|_| mode.multi_node()) {
            // On the database, which decides with its own clock: no clock offset here.
            args.truncate(3); // no --data-dir, no --clock-offset-ms
            args.extend(["--store", url, "--pg-schema", schema]);
            if let (1, true, Some(lib)) = (i, faketime, libfaketime) {
                command.env("LD_PRELOAD", lib).env("FAKETIME", "+30s");
            }
        }
        command.args(&args).env("RUST_LOG", "info");
        start_command(command).0
    };
    let hold = format!("{}ms", SLOWEST_WORK.as_millis() + 500);
    let start_proxy = |i: usize| {
        let listen = format!("127.0.0.1:{}", proxy_ports[i]);
        let admin = format!("127.0.0.1:{}", admin_ports[i]);
        let mut args = vec!["proxy", "--listen", &listen, "--admin-listen", &admin];
        args.extend(["--upstream", &upstream]);
        args.extend(["--drain-timeout", "2s", "--body-timeout", "1s"]);
        // An effect's work ends at most SLOWEST_WORK after it arrived, even when its proxy
        // died meanwhile: the hold (here and after a restart) covers that.
        args.extend(["--upstream-timeout", "3s", "--unknown-outcome-hold", &hold]);
        if mode == Mode::RestartHoldOff {
            args.push("--unsafe-no-restart-hold");
        }
        match &sql {
            Some((url, schema, _)) => args.extend(["--store", url, "--pg-schema", schema]),
            None => args.extend(["--data-dir", sink.to_str().unwrap()]),
        }
        if !fencing {
            args.push("--unsafe-no-fence");
        }
        let key = keys.join("fence-verify.pem");
        if mode.forgets() {
            // The server's clock jumps by up to a TTL (600 ms): the skew covers it.
            args.extend(["--verify-key", key.to_str().unwrap(), "--clock-skew", "1s"]);
            args.extend(["--max-lease-ttl", "1s", "--forget-after", "4s"]);
        }
        start_ready(&args).0
    };
    let window: u64 = if mode.forgets() { 3 } else { 0 };
    let mut servers: Vec<Proc> = (0..servers_n).map(|i| start_server(i, 0)).collect();
    let mut proxies: Vec<Proc> = (0..proxies_n).map(start_proxy).collect();
    let mut report_faults: BTreeMap<&'static str, u64> = BTreeMap::new();
    // In the semaphore mode `jobs` is the number of slots.
    let (workers, jobs) = match mode {
        Mode::Semaphore => (6u64, 2u64),
        _ => (6u64, 3u64),
    };
    // Two workers run with their clocks shifted by 30 s and running 5% slow or fast
    // (libfaketime), when it is installed. The library is preloaded into the worker itself,
    // not run through the `faketime` wrapper, which forks: a SIGSTOP would stop the wrapper
    // and leave the worker running.
    if !faketime && mode != Mode::Semaphore {
        println!(
            "note: faketime not installed (apt-get install faketime): no worker runs with a skewed clock"
        );
    }
    let mut children: Vec<Child> = (0..workers)
        .map(|id| {
            let skew = match id {
                0 if faketime => Some("+30s x0.95"),
                1 if faketime => Some("-30s x1.05"),
                _ => None,
            };
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            if let (Some(spec), Some(lib)) = (skew, libfaketime) {
                cmd.env("LD_PRELOAD", lib).env("FAKETIME", spec);
            }
            // In the SQL mode the last two workers write with SQL.
            let sql = match &sql {
                Some((url, schema, _)) if id >= workers - 2 => {
                    let ignore = if mode == Mode::SqlIgnoresExpiry { " ignore-expiry" } else { "" };
                    format!(" {url} {schema}{ignore}")
                }
                _ if mode == Mode::Grpc => " grpc".to_owned(),
                _ if mode == Mode::Semaphore => " slots".to_owned(),
                _ => String::new(),
            };
            cmd.args(["fault_worker", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                .env(HOLDING_ENV, dir.path().join(format!("holding-{id}")))
                .env(WORKER_ENV, format!("http://127.0.0.1:{} http://127.0.0.1:{} {id} {jobs} {secs} {seed} {window}{sql}", server_ports[id as usize % servers_n], proxy_ports[id as usize % proxies_n]))
                .env("RUST_LOG", "off")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    if faketime {
        *report_faults
            .entry("worker clocks skewed (+30s x0.95, -30s x1.05)")
            .or_default() += 2;
        if mode.multi_node() {
            *report_faults
                .entry("a lease server's clock 30 s ahead")
                .or_default() += 1;
        }
    }
    let pids: Vec<u32> = children.iter().map(Child::id).collect();
    let skewed_pids: Vec<u32> = if faketime {
        pids[..2].to_vec()
    } else {
        Vec::new()
    };
    // One more worker is a shell script under `fence run`: it reads FENCE_TOKEN once and
    // writes with curl, as scripts do; fence run stops it when the lease is lost. It exits
    // non-zero so fence run releases the job (exit 0 would complete it, for good).
    let curl = Command::new("curl")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if curl && mode != Mode::Grpc {
        let script = r#"n=0; start=$(date +%s); end=$(( start + SECS )); while [ "$(date +%s)" -lt "$end" ]; do n=$((n + 1)); shift=0; if [ "$WINDOW" -gt 0 ]; then shift=$(( ( $(date +%s) - start ) / WINDOW * JOBS )); fi; SEQ0=$((n * 10)) "$FENCE_BIN" run --server "$SERVER" --job "${SEMAPHORE:-job-$((shift + n % JOBS))}" ${SEMAPHORE:+--slots "$JOBS"} --ttl 600ms --grace 300ms -- sh -c 'echo "CLAIM $FENCE_JOB ${FENCE_TOKEN%%.*} $FENCE_OWNER"; for i in 1 2 3; do s=$((SEQ0 + i)); code=$(curl -s -o /dev/null -w "%{http_code}" -X POST -H "X-Fencing-Job: $FENCE_JOB" -H "X-Fencing-Token: $FENCE_TOKEN" -H "x-worker: 100" -H "x-seq: $s" "$PROXY/effects"); if [ "$code" = 200 ]; then echo "ACK $FENCE_JOB ${FENCE_TOKEN%%.*} 100 $s"; else echo "REJECTED $FENCE_JOB ${FENCE_TOKEN%%.*} $code"; fi; sleep 0.05; done; exit 9'; sleep 0.05; done"#;
        children.push(
            Command::new("sh")
                .arg("-c")
                .arg(script)
                .env("SECS", secs.to_string())
                .env("JOBS", jobs.to_string())
                .env("WINDOW", window.to_string())
                .env(
                    "SEMAPHORE",
                    if mode == Mode::Semaphore {
                        SEMAPHORE
                    } else {
                        ""
                    },
                )
                .env("FENCE_BIN", FENCE)
                .env("SERVER", format!("http://127.0.0.1:{}", server_ports[0]))
                .env(
                    "PROXY",
                    format!("http://127.0.0.1:{}", proxy_ports[proxies_n - 1]),
                )
                .env("RUST_LOG", "off")
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        *report_faults
            .entry("a worker under fence run (curl script)")
            .or_default() += 1;
    } else if curl {
        println!("note: the gRPC mode has no worker under fence run (it writes HTTP/1.1)");
    } else {
        println!("note: curl not installed: no worker runs under fence run");
    }
    // Every worker's output is read while it runs: a pipe nobody reads fills up in a long
    // soak and blocks the worker.
    let readers: Vec<std::thread::JoinHandle<String>> = children
        .into_iter()
        .map(|mut child| {
            std::thread::spawn(move || {
                use std::io::Read;
                let mut out = String::new();
                if let Some(mut pipe) = child.stdout.take() {
                    let _ = pipe.read_to_string(&mut out);
                }
                let _ = child.wait();
                out
            })
        })
        .collect();
    let forced_forgotten = if mode == Mode::Forgetting {
        let server = format!("http://127.0.0.1:{}", server_ports[0]);
        let proxy = format!("http://127.0.0.1:{}", proxy_ports[0]);
        first_write_to_forget(&server, &proxy).await
    } else {
        None
    };
    let mut report = Report {
        faults: report_faults,
        ..Report::default()
    };
    let mut rng = Rng(seed | 1);
    let end = Instant::now() + Duration::from_secs(secs);
    let mut stoppers = Vec::new();
    let mut round = 0u64;
    let mut last_restart: Option<Instant> = None;
    // The mean time between faults: FENCE_SOAK_FAULT_MS asks for more faults in a soak.
    let gap = std::env::var("FENCE_SOAK_FAULT_MS")
        .ok()
        .and_then(|ms| ms.parse::<u64>().ok())
        .unwrap_or(325)
        .max(20);
    while Instant::now() + Duration::from_millis(1_500) < end {
        tokio::time::sleep(Duration::from_millis(gap / 2 + rng.below(gap))).await;
        // The first rounds take each kind of fault once, so a quick run has all of them;
        // then they are drawn at random. The first stop is of a skewed worker, when any.
        round += 1;
        // On PostgreSQL the database's own faults (a restart, dropped connections) and a
        // proxy's stop join in, so one soak of the SQL mode has every kind with forgetting on.
        let kind = match (mode.on_postgres(), round) {
            (_, 1) => 0,
            (_, 2) => 6,
            (_, 3) => 9,
            (true, 4) => 10,
            (true, 5) => 11,
            (true, 6) => 12,
            (true, _) => rng.below(13),
            (false, _) => rng.below(10),
        };
        match kind {
            0..=5 => {
                // Stop a worker past its lease, then let it go on.
                let pid = match skewed_pids.first() {
                    Some(&skewed) if round == 1 => skewed,
                    _ => pids[rng.below(workers) as usize],
                };
                let mut pause = TTL_MS * 3 / 2 + rng.below(TTL_MS);
                // Past the proxy's forgetting (4 s, on sled stretched by its timeouts), with forgetting on: the stale write then
                // meets a job the proxy no longer remembers.
                let past_forget = mode.forgets() && rng.below(3) == 0;
                if past_forget {
                    pause = PAST_FORGETTING_MS + rng.below(1_500);
                }
                // Counted only when it took effect: a worker whose time is up (one on a fast
                // clock ends early) cannot be stopped.
                let Some(stopper) = stop_for(pid, pause) else {
                    report.fault("(worker stop not done: the worker had ended)", 1);
                    continue;
                };
                stoppers.push(stopper);
                // Stopped now: what it says of its lease stays as it is until it goes on.
                let worker = pids.iter().position(|&p| p == pid).unwrap_or(0);
                let file = dir.path().join(format!("holding-{worker}"));
                if std::fs::read(&file).ok().as_deref() != Some(b"1".as_slice()) {
                    report.fault("(worker stop not counted: it held no lease)", 1);
                    continue;
                }
                if skewed_pids.contains(&pid) {
                    report.fault("of which a skewed-clock worker", 1);
                }
                if past_forget {
                    report.fault("worker SIGSTOP past forget-after", 1);
                }
                report.fault("worker SIGSTOP past its lease", 1);
            }
            6..=7 => {
                report.fault("proxy SIGKILL + restart", 1);
                let i = rng.below(proxies_n as u64) as usize;
                kill_and_reap(&mut proxies[i]); // its port is free again before the restart
                proxies[i] = start_proxy(i);
            }
            8..=9 if mode.multi_node() || mode == Mode::Semaphore => {
                report.fault("server SIGKILL + restart", 1);
                let i = rng.below(servers_n as u64) as usize;
                kill_and_reap(&mut servers[i]);
                servers[i] = start_server(i, 0);
            }
            8..=9 => {
                // The lease server dies and comes back with its clock jumped (either way).
                report.fault("server SIGKILL + restart, clock jump", 1);
                kill_and_reap(&mut servers[0]);
                let jump = rng.below(2 * TTL_MS) as i64 - TTL_MS as i64;
                servers[0] = start_server(0, jump);
            }
            10 => {
                // A proxy stops with whatever it admitted still to forward; the others go
                // on, and newer tokens pass there meanwhile.
                let pid = proxies[rng.below(proxies_n as u64) as usize].0.id();
                if let Some(stopper) = stop_for(pid, 500 + rng.below(1_000)) {
                    report.fault("proxy SIGSTOP for 0.5 to 1.5 s", 1);
                    stoppers.push(stopper);
                }
            }
            12 if last_restart.is_none_or(|at| at.elapsed() > Duration::from_secs(12)) => {
                report.fault("PostgreSQL restart (immediate)", 1);
                last_restart = Some(Instant::now());
                let restart = tokio::task::spawn_blocking(restart_postgres);
                let ok = tokio::time::timeout(Duration::from_secs(60), restart).await;
                assert!(
                    ok.is_ok_and(|done| done.unwrap()),
                    "pg_ctlcluster restart failed or took over 60 s"
                );
            }
            _ => {
                let url = &sql.as_ref().expect("kind 12 and up run on PostgreSQL").0;
                let dropped = drop_connections(url).await;
                report.fault("database connections dropped (pg_terminate_backend)", 1);
                report.fault("of which connections ended", dropped);
            }
        }
    }
    for s in stoppers {
        let _ = s.await;
    }
    let mut logs: Vec<String> = tokio::task::spawn_blocking(move || {
        readers.into_iter().map(|r| r.join().unwrap()).collect()
    })
    .await
    .unwrap();
    if mode == Mode::Fenced {
        // The case the fenced run asserts on, sent on purpose: a stale HTTP write refused.
        let proxy = format!("http://127.0.0.1:{}", proxy_ports[0]);
        logs.push(stale_http_write(&proxy).await);
    }
    if mode == Mode::Forgetting {
        // The forgetting run's case, made on purpose: a late write of a job the proxy forgot.
        let proxy = format!("http://127.0.0.1:{}", proxy_ports[0]);
        let admin = format!("127.0.0.1:{}", admin_ports[0]);
        logs.push(match &forced_forgotten {
            Some((token, generation)) => {
                late_write_of_forgotten(&proxy, &admin, token, *generation).await
            }
            None => "REJECTED forced-forgotten 0 never-claimed\n".to_owned(),
        });
    }
    if mode == Mode::Grpc {
        // The case the gRPC run asserts on, sent on purpose rather than hoped for from the
        // seed: a stale call through the proxy, refused the gRPC way.
        let proxy = format!("http://127.0.0.1:{}", proxy_ports[0]);
        let code = stale_grpc_call(&proxy).await;
        logs.push(format!("REJECTED forced-stale 1 grpc-{code}\n"));
    }
    if mode.multi_node() {
        // The case both multi-node runs assert on, made on purpose rather than hoped for
        // from the seed: a write held at the upstream while a newer holder's passes another
        // proxy.
        let servers: Vec<String> = server_ports
            .iter()
            .map(|port| format!("http://127.0.0.1:{port}"))
            .collect();
        let proxy = |i: usize| format!("http://127.0.0.1:{}", proxy_ports[i]);
        logs.push(reorder_across_proxies(&servers, &proxy(0), &proxy(1)).await);
    }
    if let (true, Some((url, schema, _))) = (mode.forgets(), &sql) {
        // The case the SQL modes assert on, made on purpose: a stale SQL write of a job the
        // proxy forgot.
        let server = format!("http://127.0.0.1:{}", server_ports[0]);
        let ignore = mode == Mode::SqlIgnoresExpiry;
        logs.push(stale_sql_write_after_forgetting(&server, url, schema, ignore).await);
    }
    if mode.forgets() {
        // job-0 was used in the first window only: by now the server has forgotten it.
        let status = http_status(
            &format!("127.0.0.1:{}", server_ports[0]),
            "GET",
            "/v1/leases/job-0",
            &[],
        );
        *report
            .faults
            .entry(if status == 404 {
                "jobs of the first window forgotten by the server"
            } else {
                "jobs of the first window NOT forgotten by the server"
            })
            .or_default() += 1;
        // And by the proxy: its fence of job-0 reads as never seen.
        let (status, body) = exchange(
            &format!("127.0.0.1:{}", admin_ports[0]),
            "GET",
            "/v1/fence/job-0",
            &[],
            "",
        );
        *report
            .faults
            .entry(if status == 200 && body.contains("\"highest\":0") {
                "jobs of the first window forgotten by the proxy"
            } else {
                "jobs of the first window NOT forgotten by the proxy"
            })
            .or_default() += 1;
    }
    drop((proxies, servers));
    report.fault(
        match mode {
            Mode::Semaphore => "more workers than slots (6 on 2)",
            _ => "more workers than jobs (6 on 3)",
        },
        1,
    );
    if let Some((url, schema, _)) = &sql {
        // A connection of its own: a restart or a dropped pool may have ended the first.
        let client = connect(url).await.unwrap();
        // Commit order per job: each effect's transaction held the job's fence row from its
        // check to its commit, so ids of one job rise in commit order.
        let rows = client
            .query(
                &format!("SELECT job, token, worker, seq FROM {schema}.effects ORDER BY id"),
                &[],
            )
            .await
            .unwrap();
        let effects: Vec<Effect> = rows
            .iter()
            .map(|r| Effect {
                job: r.get(0),
                token: r.get::<_, i64>(1) as u64,
                worker: r.get::<_, i64>(2) as u64,
                seq: r.get::<_, i64>(3) as u64,
            })
            .collect();
        report.sql_effects = effects
            .iter()
            .filter(|e| e.worker >= workers - 2 && e.worker < 100)
            .count();
        check(&effects, &logs, &mut report);
        // The table holds each write once: what the upstream saw arrive again is the check.
        let repeats = std::mem::take(&mut *upstream_repeats.lock().unwrap());
        report.duplicate_effects.extend(repeats);
        let _ = client
            .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await;
        return report;
    }
    let effects: Vec<Effect> = std::fs::read_to_string(&log_path)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            Effect {
                job: f[0].to_owned(),
                token: f[1].parse().unwrap(),
                worker: f[2].parse().unwrap(),
                seq: f[3].parse().unwrap(),
            }
        })
        .collect();
    check(&effects, &logs, &mut report);
    report
}

/// Every kind of fault happened, and no stale effect, no generation granted twice, no
/// acknowledged write lost.
fn assert_clean(report: &Report, seed: u64) {
    assert_faults(
        report,
        seed,
        &[
            "worker SIGSTOP past its lease",
            "proxy SIGKILL + restart",
            "server SIGKILL + restart, clock jump",
        ],
    );
    assert_no_violations(report, seed);
}

/// Each of `kinds` happened at least once.
fn assert_faults(report: &Report, seed: u64, kinds: &[&str]) {
    for kind in kinds {
        assert!(
            report.faults.get(kind).is_some_and(|n| *n > 0),
            "seed {seed}: no {kind:?}: {:?}",
            report.faults
        );
    }
}

fn assert_no_violations(report: &Report, seed: u64) {
    assert_eq!(
        report.violations(),
        0,
        "seed {seed}: {:?} {:?} {:?}",
        report.stale_effects,
        report.reused_generations,
        report.duplicate_effects
    );
    assert!(
        report.lost_acks.is_empty(),
        "seed {seed}: {:?}",
        report.lost_acks
    );
}

/// Stops process `pid` (SIGSTOP) and lets it go on after `ms` (SIGCONT; a process killed
/// meanwhile is gone, and the signal goes nowhere). `None` when the stop did not take
/// effect: the process had ended.
fn stop_for(pid: u32, ms: u64) -> Option<tokio::task::JoinHandle<()>> {
    let kill = move |sig: &str| {
        Command::new("kill")
            .args([sig, &pid.to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    kill("-STOP").then(|| {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            kill("-CONT");
        })
    })
}

fn seed_and_secs(default_secs: u64) -> (u64, u64) {
    let seed = std::env::var("FENCE_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(std::time::SystemTime::now())
        });
    let secs = std::env::var("FENCE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_secs);
    (seed, secs)
}

/// One run of `mode` with the seed and length from the environment (`default_secs` when
/// unset), announced first with what replays it, and its report printed under `title`.
async fn soak(mode: Mode, default_secs: u64, title: &str) -> (Report, u64) {
    let (seed, secs) = seed_and_secs(default_secs);
    println!(
        "{title}: seed {seed}, {secs} s (replay with FENCE_SOAK_SEED={seed} FENCE_SOAK_SECS={secs})"
    );
    let report = run(seed, secs, mode).await;
    report.print(title, seed);
    (report, seed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_run_has_no_violations() {
    let (report, seed) = soak(Mode::Fenced, 20, "fault injection, fenced").await;
    // The stale write sent on purpose (see `stale_http_write`); the faults' own stale writes
    // are counted in the report too, as many as the seed made.
    assert_eq!(
        report.outcomes.get("HTTP 409-forced"),
        Some(&1),
        "seed {seed}: the stale write sent on purpose was not refused: {:?}",
        report.outcomes
    );
    assert!(
        report.effects > 0,
        "no effect was applied at all: the harness did not run"
    );
    assert_clean(&report, seed);
    // What may hold a newer holder's first write up, by design: older requests in flight at
    // this proxy, for at most the 2 s drain limit (stalled bodies are cut at 1 s), and, after a
    // proxy restart, what the killed process may have left running: the restart hold of
    // SLOWEST_WORK + 500 ms. The two waits overlap, so their sum plus 500 ms of scheduling
    // slack bounds the first write (its time at the upstream is not counted: that is the
    // destination's, not the fence's). The bound catches a job jammed for longer (a request
    // kind the gate forgets to let go holds the next holder for its upstream timeout and
    // more), not a regression of speed: that is for the benchmarks. (A bound of 3 s, the drain
    // limit alone, failed on seeds whose first write came just after a proxy restart: 3.1 s.)
    let bound = 2_000 + SLOWEST_WORK.as_millis() as u64 + 500 + 500;
    assert!(
        report.first_write_p99() < bound,
        "seed {seed}: the newer holder's first write took {} ms at p99 (bound {bound} ms)",
        report.first_write_p99()
    );
}

/// The count of the semaphore mode sees leases that overlap, and only those: a hand-over at
/// the same millisecond is not an overlap, a lease without writes is not counted.
#[test]
fn most_writers_at_once_counts_overlapping_leases() {
    let logs = [
        "HOLD sem#1 1 100\nSEND sem#1 1 150\nSEND sem#1 1 200\nHOLD sem#1 2 200\nSEND sem#1 2 300"
            .to_owned(),
        "HOLD sem#2 1 120\nSEND sem#2 1 250\nHOLD sem#2 2 260\n".to_owned(),
    ];
    assert_eq!(most_writers_at_once(&logs), 2);
    let three = ["HOLD sem#3 1 140\nSEND sem#3 1 160".to_owned()];
    let all: Vec<String> = logs.iter().chain(&three).cloned().collect();
    assert_eq!(most_writers_at_once(&all), 3);
}

/// The semaphore mode (contract section 15): 6 workers and a `fence run --slots` script on
/// a semaphore of 2 slots, with stops past the lease and proxy and server kills. Per slot,
/// no stale effect; and never more than 2 leases writing with unexpired tokens at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_run_has_no_violations() {
    let title = "fault injection, a semaphore of 2 slots";
    let (report, seed) = soak(Mode::Semaphore, 20, title).await;
    // No clock jumps here: the count below needs one clock.
    let kinds = [
        "worker SIGSTOP past its lease",
        "proxy SIGKILL + restart",
        "server SIGKILL + restart",
    ];
    assert_faults(&report, seed, &kinds);
    assert_no_violations(&report, seed);
    let slots = report
        .claims_by_job
        .keys()
        .filter(|job| job.starts_with("sem#"))
        .count();
    assert_eq!(slots, 2, "seed {seed}: claims of {slots} slots, not 2");
    assert!(
        report.most_writers > 0,
        "seed {seed}: no lease wrote at all: the count checked nothing"
    );
    assert!(
        report.most_writers <= 2,
        "seed {seed}: {} leases of a 2-slot semaphore wrote with unexpired tokens at once",
        report.most_writers
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgetting_run_has_no_violations() {
    const TITLE: &str = "fault injection, forgetting after 4 s (proxy) and 2 s (server)";
    let (report, seed) = soak(Mode::Forgetting, 20, TITLE).await;
    assert!(report.effects > 0, "no effect was applied at all");
    for forgotten in [
        "jobs of the first window forgotten by the server",
        "jobs of the first window forgotten by the proxy",
    ] {
        assert!(
            report.faults.contains_key(forgotten),
            "seed {seed}: the run did not exercise forgetting: {:?}",
            report.faults
        );
    }
    // A late write of a job the proxy had forgotten, sent on purpose: refused as expired
    // (the writes the faults held in the network past forget-after are counted as
    // "HTTP 409-expired", as many as the seed made; none applied: the stale-effect check).
    assert_eq!(
        report.outcomes.get("HTTP 409-forgotten"),
        Some(&1),
        "seed {seed}: the late write of a forgotten job was not refused as token-expired: {:?}",
        report.outcomes
    );
    assert_no_violations(&report, seed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_fencing_finds_violations() {
    // The faults are random, and one round without a violation can happen by chance; three
    // in a row means too few faults.
    let (seed, secs) = seed_and_secs(15);
    finds_stale_effects(
        Mode::Unfenced,
        seed,
        secs,
        3,
        "negative control: fencing disabled",
    )
    .await;
}

/// The restart hold's negative control: with the proxy forgetting, across a restart, what
/// it passed on, a slow effect of an older generation commits after a newer one (which the
/// fenced run, with the hold, never shows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_restart_hold_a_killed_proxy_lets_effects_commit_out_of_order() {
    let (seed, secs) = seed_and_secs(15);
    let title = "negative control: a restarted proxy forgets what it passed on";
    finds_stale_effects(Mode::RestartHoldOff, seed, secs, 4, title).await;
}

/// Runs `mode` for up to `rounds` rounds (seeds derived from `seed`) until one applies a stale
/// or out-of-order effect; panics if none does.
async fn finds_stale_effects(mode: Mode, seed: u64, secs: u64, rounds: u64, title: &str) {
    for round in 0..rounds {
        let round_seed = seed.wrapping_add(round);
        println!("{title}: seed {round_seed}, {secs} s");
        let report = run(round_seed, secs, mode).await;
        report.print(title, round_seed);
        if !report.stale_effects.is_empty() {
            return;
        }
    }
    panic!(
        "seed {seed}, {title}: no stale or out-of-order effect in {rounds} rounds: the harness is not injecting enough faults"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_writers_and_the_proxy_share_one_fence_without_violations() {
    let title = "fault injection, fenced in PostgreSQL, SQL writers beside the proxy's";
    let (report, seed) = soak(Mode::Sql, 20, title).await;
    println!(
        "{:<40} {:>8}",
        "effects written by SQL workers", report.sql_effects
    );
    assert!(report.sql_effects > 0, "seed {seed}: no SQL worker wrote");
    assert!(
        report.effects > report.sql_effects,
        "seed {seed}: nothing came through the proxy"
    );
    assert_faults(
        &report,
        seed,
        &[
            "proxy SIGSTOP for 0.5 to 1.5 s",
            "PostgreSQL restart (immediate)",
            "database connections dropped (pg_terminate_backend)",
        ],
    );
    // The forced stale write of a forgotten job (see `stale_sql_write_after_forgetting`).
    assert_eq!(
        report.outcomes.get("HTTP 409-forgotten"),
        Some(&1),
        "seed {seed}: the stale SQL write of a forgotten job was not refused: {:?}",
        report.outcomes
    );
    assert_clean(&report, seed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_writers_that_ignore_their_lease_end_commit_stale_effects_of_forgotten_jobs() {
    let title = "negative control: SQL writers claiming a full TTL left on every lease, the proxy forgetting";
    let (report, seed) = soak(Mode::SqlIgnoresExpiry, 10, title).await;
    assert!(
        !report.stale_effects.is_empty(),
        "seed {seed}: without the lease end, no stale effect of a forgotten job committed"
    );
}

/// Issue 18: two lease servers and three proxies on one PostgreSQL, workers spread over
/// all of them, the upstream and two workers writing with the SQL fence in the effect's own
/// transaction (which orders effects across proxies), and faults of every part: workers
/// and proxies stopped, servers and proxies killed, the database restarted and its
/// connections dropped, one server's clock 30 s ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_servers_and_proxies_on_one_database_have_no_violations() {
    let title = "multi-node fault injection, 2 servers and 3 proxies on one PostgreSQL";
    let (report, seed) = soak(Mode::MultiNode, 30, title).await;
    assert!(report.sql_effects > 0, "seed {seed}: no SQL worker wrote");
    assert!(
        report.effects > report.sql_effects,
        "seed {seed}: nothing came through the proxies"
    );
    assert_faults(
        &report,
        seed,
        &[
            "worker SIGSTOP past its lease",
            "proxy SIGKILL + restart",
            "server SIGKILL + restart",
            "proxy SIGSTOP for 0.5 to 1.5 s",
            "PostgreSQL restart (immediate)",
            "database connections dropped (pg_terminate_backend)",
        ],
    );
    // The write held at the upstream while a newer holder's passed another proxy (see
    // `reorder_across_proxies`): refused where it commits.
    assert_eq!(
        report.outcomes.get("HTTP 409-reordered"),
        Some(&1),
        "seed {seed}: the held older write was not refused by the SQL fence: {:?}",
        report.outcomes
    );
    assert_no_violations(&report, seed);
}

/// The multi-node run's negative control: an upstream that writes without the SQL fence, so
/// only each proxy's own gate orders effects. A request one proxy admitted lands after a
/// newer token's effect passed another proxy: out of order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_fence_in_the_effects_transaction_proxies_reorder_effects() {
    // Each run ends with a reorder made on purpose (`reorder_across_proxies`): without the
    // fence in the effect's transaction the held older write commits after the newer one.
    // The random faults add about two more in 30 s on 2 cores, by chance only, so the
    // assertion is on the one made on purpose.
    let (seed, secs) = seed_and_secs(20);
    let title = "multi-node negative control, upstream without the SQL fence";
    println!("{title}: seed {seed}, {secs} s");
    let report = run(seed, secs, Mode::MultiNodeUnordered).await;
    report.print(title, seed);
    assert!(
        report
            .stale_effects
            .iter()
            .any(|e| e.contains("job forced-reorder ")),
        "seed {seed}, {title}: the held older write did not land after the newer one: {:?} {:?}",
        report.stale_effects,
        report.outcomes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_workers_through_the_proxy_have_no_violations() {
    let title = "fault injection, gRPC: tonic workers through the proxy to a tonic ledger";
    let (report, seed) = soak(Mode::Grpc, 20, title).await;
    assert!(
        report.effects > 0,
        "seed {seed}: no charge reached the ledger"
    );
    assert!(
        report.outcomes.contains_key("gRPC status 10"),
        "seed {seed}: the stale call sent on purpose was not refused the gRPC way (ABORTED): {:?}",
        report.outcomes
    );
    assert_clean(&report, seed);
}

// ------------------------------------------------------------------------------------------
// The checker, on histories with a known violation: each check can fail.
// ------------------------------------------------------------------------------------------

fn effect(job: &str, token: u64, worker: u64, seq: u64) -> Effect {
    Effect {
        job: job.into(),
        token,
        worker,
        seq,
    }
}

#[test]
fn the_checker_finds_each_kind_of_violation() {
    let effects = [
        effect("a", 2, 1, 1),
        effect("b", 1, 2, 1),
        effect("a", 3, 1, 2),
    ];
    let clean = "CLAIM a 2 w1\nACK a 2 1 1\nCLAIM a 3 w1\nACK a 3 1 2\nCLAIM b 1 w2\nACK b 1 2 1\n";
    let mut report = Report::default();
    check(&effects, &[clean.into()], &mut report);
    assert_eq!(
        (report.violations(), report.lost_acks.len()),
        (0, 0),
        "{report:?}"
    );

    // A lower token applied after a higher one of the same job.
    let mut stale = effects.to_vec();
    stale.push(effect("a", 2, 3, 9));
    let mut report = Report::default();
    check(&stale, &[clean.into()], &mut report);
    assert_eq!(report.stale_effects.len(), 1, "{report:?}");

    // One generation granted to two owners, in two workers' logs.
    let mut report = Report::default();
    check(
        &effects,
        &[clean.into(), "CLAIM a 3 w9\n".into()],
        &mut report,
    );
    assert_eq!(report.reused_generations.len(), 1, "{report:?}");

    // An acknowledged write that never reached the upstream.
    let mut report = Report::default();
    check(&effects, &[format!("{clean}ACK a 3 1 77\n")], &mut report);
    assert_eq!(report.lost_acks.len(), 1, "{report:?}");

    // One write applied twice (a retry that ran again instead of being replayed).
    let mut twice = effects.to_vec();
    twice.push(effect("a", 3, 1, 2));
    let mut report = Report::default();
    check(&twice, &[clean.into()], &mut report);
    assert_eq!(report.duplicate_effects.len(), 1, "{report:?}");

    // A write the layer cut in flight is counted apart from one it refused, and is no
    // violation whether or not it was applied (here it was: seq 2).
    let mut report = Report::default();
    check(
        &effects,
        &[format!(
            "{clean}CUT a 3
REFUSED a 3
REFUSED a 3
"
        )],
        &mut report,
    );
    assert_eq!(report.violations(), 0, "{report:?}");
    assert_eq!(
        (
            report
                .outcomes
                .get("cut in flight by layer (outcome unknown)"),
            report.outcomes.get("refused by layer")
        ),
        (Some(&1), Some(&2)),
        "{report:?}"
    );
}
