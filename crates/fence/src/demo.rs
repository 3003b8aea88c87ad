//! `fence demo`: the seed's worked example end to end over real HTTP on loopback.
//!
//! A lease server and a fenced "ledger" service run on ephemeral ports with their stores in a
//! temporary directory. Worker A claims generation 7 and writes; one more write of A's is
//! stamped with token 7 and then held up on its way (a slow network); A stalls past its lease
//! (its renewals stop, as in a GC pause), and its client gives up on the held-up write at the
//! loss (in flight: A cannot know whether it arrived); B claims generation 8 and writes; A's
//! held-up write arrives all the same and the ledger's fence rejects it with 409; A wakes up, its layer refuses to send
//! anything new, and the store rejects its completion. Exit 0 only if all of that happened.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::Context;
use axum::{Extension, Router, routing::post};
use bytes::Bytes;
use fence_core::signing::TokenVerifier;
use fence_core::{Generation, JobId, Problem, lease_api::ListQuery};
use fence_lease::{
    ClaimError, FinishError, HttpLeaseStore, LeaseClient, LeaseLost, LeaseOp, LeaseRecord,
    LeaseStore, ListPage, Outcome, SigningLeaseStore, SledLeaseStore, StoreError, Ttl,
};
use fence_sink::{FenceLayer, Fenced, SledStore};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tokio::{sync::watch, time::Instant};
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

struct Timeline {
    start: Instant,
    checks: Mutex<Vec<(bool, String)>>,
}

impl Timeline {
    fn say(&self, who: &str, what: impl AsRef<str>) {
        out!(
            "  {:>6.3}s  {who:<8} {}",
            self.start.elapsed().as_secs_f64(),
            what.as_ref()
        );
    }

    fn check(&self, ok: bool, what: impl Into<String>) {
        self.checks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((ok, what.into()));
    }
}

/// A lease store whose renewals stop while `paused` is true: the worker's process is frozen.
#[derive(Debug, Clone)]
struct Freezable {
    inner: HttpLeaseStore,
    paused: watch::Receiver<bool>,
}

impl Freezable {
    async fn thawed(&self) {
        let mut rx = self.paused.clone();
        let _ = rx.wait_for(|p| !*p).await;
    }
}

impl LeaseStore for Freezable {
    async fn claim_slot(
        &self,
        resource: &fence_core::JobId,
        owner: &fence_core::Owner,
        key: &fence_core::secret::LeaseKey,
        terms: fence_lease::ClaimTerms,
        slots: u32,
    ) -> Result<fence_lease::SlotClaim, fence_lease::StoreError> {
        self.inner
            .claim_slot(resource, owner, key, terms, slots)
            .await
    }

    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        if matches!(op, LeaseOp::Renew { .. }) {
            self.thawed().await;
        }
        self.inner.apply(job, op).await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.inner.get(job).await
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        self.inner.list(query).await
    }
}

type Ledger = Arc<Mutex<Vec<(String, u64, String)>>>;

async fn ledger_entry(
    Extension(ledger): Extension<Ledger>,
    Extension(fenced): Extension<Fenced>,
    body: String,
) -> String {
    ledger.lock().unwrap_or_else(|e| e.into_inner()).push((
        fenced.job.to_string(),
        fenced.token.get(),
        body.clone(),
    ));
    format!("applied {body:?} under token {}\n", fenced.token)
}

async fn bind() -> anyhow::Result<(tokio::net::TcpListener, String)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .context("binding a loopback port")?;
    let url = format!("http://{}", l.local_addr()?);
    Ok((l, url))
}

/// Runs the demo; returns the exit code.
///
/// # Errors
/// When a port cannot be bound or the temporary directory cannot be created.
pub async fn run() -> anyhow::Result<i32> {
    let dir = tempfile::Builder::new()
        .prefix("fence-demo-")
        .tempdir()
        .context("creating a temporary directory")?;
    let t = Arc::new(Timeline {
        start: Instant::now(),
        checks: Mutex::default(),
    });
    out!("fence demo: the worked example, end to end on loopback\n");

    // Signed tokens at both ends (contract section 6): a fresh key pair for this run.
    let signer = crate::keys::generate_signer()?;
    let verifier = TokenVerifier::new([signer.verify_key()]);

    // The lease server.
    let lease_store = Arc::new(SigningLeaseStore::new(
        SledLeaseStore::open(dir.path().join("leases")).context("opening the lease store")?,
        signer,
    ));
    let (listener, server) = bind().await?;
    tokio::spawn(async move {
        let router = crate::server::router(lease_store, crate::server::ServerOptions::default());
        axum::serve(listener, router).await
    });
    t.say(
        "server",
        format!(
            "lease server on {server} (sled in {})",
            dir.path().join("leases").display()
        ),
    );

    // The destination: a ledger protected by the fence.
    let ledger: Ledger = Arc::default();
    let sink_store = SledStore::open(dir.path().join("sink")).context("opening the sink store")?;
    let app = Router::new()
        .route("/ledger", post(ledger_entry))
        .layer(FenceLayer::new(sink_store).require_signatures(verifier))
        .layer(Extension(ledger.clone()));
    let (listener, sink) = bind().await?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    t.say("sink", format!("fenced ledger on {sink}/ledger"));

    let job: JobId = "invoice-42".parse()?;
    let ttl = Ttl::from_millis(1_000)?;
    let http = HttpLeaseStore::new(&server)?;

    // Earlier runs bring the job to generation 6, so A gets 7 as in the seed.
    let earlier = LeaseClient::new(http.clone())
        .owner("earlier-run".parse()?)
        .ttl(ttl);
    for _ in 0..6 {
        earlier.claim(job.clone()).await?.release().await?;
    }
    t.say(
        "server",
        "invoice-42 was claimed and released by 6 earlier runs (generations 1-6)",
    );

    // Worker A.
    let (freeze, paused) = watch::channel(false);
    let a = LeaseClient::new(Freezable {
        inner: http.clone(),
        paused,
    })
    .owner("worker-a".parse()?)
    .ttl(ttl);
    let lease_a = a.claim(job.clone()).await?;
    t.say(
        "A",
        format!(
            "claims invoice-42: generation {} (ttl {} ms)",
            lease_a.generation(),
            ttl.as_millis()
        ),
    );
    t.check(
        lease_a.generation() == Generation::new(7),
        "A holds generation 7",
    );

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let (hold, held) = watch::channel(false);
    // B's requests take a network of their own that never holds anything up.
    let direct = {
        let client = client.clone();
        service_fn(move |req: http::Request<Full<Bytes>>| {
            let client = client.clone();
            async move {
                let resp = client.request(req).await?;
                let status = resp.status();
                let body = resp.into_body().collect().await?.to_bytes();
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body))
            }
        })
    };
    // What the network delivered, and the answer: a request on the wire arrives even when its
    // sender has given up on it (its client cut it at the loss of its lease).
    let (delivered_tx, mut delivered) = tokio::sync::mpsc::unbounded_channel();
    // Sent at the first poll, as hyper's client sends, then on a task of its own.
    let network = service_fn(move |req: http::Request<Full<Bytes>>| {
        let (client, mut held, delivered) = (client.clone(), held.clone(), delivered_tx.clone());
        async move {
            let on_the_wire = tokio::spawn(async move {
                let _ = held.wait_for(|h| !*h).await; // a slow network holds the request here
                let answer = async {
                    let resp = client.request(req).await?;
                    let status = resp.status();
                    let body = resp.into_body().collect().await?.to_bytes();
                    Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, body))
                }
                .await
                .map_err(|e| e.to_string());
                let _ = delivered.send(answer.clone());
                answer
            });
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(on_the_wire.await??)
        }
    });
    let mut a_http = ServiceBuilder::new()
        .layer(lease_a.fencing_layer())
        .service(network.clone());
    let post = |body: &str| {
        http::Request::post(format!("{sink}/ledger")).body(Full::new(Bytes::from(body.to_owned())))
    };

    let (status, _) = a_http
        .ready()
        .await
        .map_err(anyhow_box)?
        .call(post("A: charge 10 EUR")?)
        .await
        .map_err(anyhow_box)?;
    t.say(
        "A",
        format!("POST /ledger \"A: charge 10 EUR\" with token 7 -> {status}"),
    );
    t.check(status == 200, "A's first write is accepted");

    // Someone who can reach the ledger tries to lock the job out with a huge token.
    let (status, body) = network
        .clone()
        .oneshot(
            http::Request::post(format!("{sink}/ledger"))
                .header("x-fencing-job", "invoice-42")
                .header("x-fencing-token", "18446744073709551615")
                .body(Full::new(Bytes::from_static(b"attacker")))?,
        )
        .await
        .map_err(anyhow_box)?;
    let kind = serde_json::from_slice::<Problem>(&body)
        .map(|p| p.kind.to_string())
        .unwrap_or_default();
    t.say(
        "attacker",
        format!("POST /ledger with token 18446744073709551615 (unsigned) -> {status} {kind}"),
    );
    t.check(
        status == 403,
        "an unsigned huge token is refused (403) and fences nobody out",
    );

    // A stamps one more write with token 7; the network holds it up.
    while delivered.try_recv().is_ok() {} // the answers above, read already
    hold.send_replace(true);
    let delayed = tokio::spawn(
        a_http
            .ready()
            .await
            .map_err(anyhow_box)?
            .call(post("A: refund 10 EUR")?),
    );
    tokio::task::yield_now().await;
    t.say(
        "A",
        "sends POST /ledger \"A: refund 10 EUR\" with token 7; the network holds it up",
    );

    // A stalls: its renewals stop.
    freeze.send_replace(true);
    t.say(
        "A",
        "stalls (simulated GC pause): no renewals reach the server",
    );
    tokio::select! {
        () = lease_a.lost() => {}
        () = tokio::time::sleep(Duration::from_secs(5)) => {}
    }
    let reason = lease_a
        .loss_reason()
        .map(|r| r.to_string())
        .unwrap_or_default();
    t.say("A", format!("lease lost locally: {reason}"));
    t.check(lease_a.is_lost(), "A's lost signal fires");

    // A's client gives up on its held-up write at the loss; the network still holds it.
    // The loss came (or the 5 s above passed): the cut is due now, not at the delivery.
    let cut = tokio::time::timeout(Duration::from_secs(5), delayed)
        .await
        .map_err(|_| anyhow::anyhow!("A's held-up write was not cut within 5 s of the loss"))??;
    match &cut {
        Err(e) if e.downcast_ref::<LeaseLost>().is_some_and(|l| l.in_flight) => {
            t.say("A", format!("its client gave up on the held-up write: {e}"));
        }
        Err(e) => t.say("A", format!("the held-up write failed otherwise: {e}")),
        Ok((s, _)) => t.say("A", format!("the held-up write was answered: {s}")),
    }
    t.check(
        cut.as_ref()
            .is_err_and(|e| e.downcast_ref::<LeaseLost>().is_some_and(|l| l.in_flight)),
        "A's client gives up on its write in flight at the loss (its outcome is unknown to A)",
    );

    // B claims once the store says the lease expired.
    let b = LeaseClient::new(http.clone())
        .owner("worker-b".parse()?)
        .ttl(Ttl::from_millis(10_000)?);
    let lease_b = loop {
        match b.claim(job.clone()).await {
            Ok(lease) => break lease,
            Err(ClaimError::Held { expires_in, .. }) => {
                tokio::time::sleep(expires_in + Duration::from_millis(5)).await
            }
            Err(e) => return Err(e.into()),
        }
    };
    t.say(
        "B",
        format!(
            "claims invoice-42 after the server-side expiry: generation {}",
            lease_b.generation()
        ),
    );
    t.check(
        lease_b.generation() == Generation::new(8),
        "B holds generation 8",
    );
    let b_http = ServiceBuilder::new()
        .layer(lease_b.fencing_layer())
        .service(direct);
    // B's only write: its client is used once.
    let b_write = b_http.oneshot(post("B: charge 10 EUR")?);
    let (status, _) = b_write.await.map_err(anyhow_box)?;
    t.say(
        "B",
        format!("POST /ledger \"B: charge 10 EUR\" with token 8 -> {status}"),
    );
    t.check(status == 200, "B's write is accepted");
    hold.send_replace(false); // only now does the network deliver A's held-up write

    // The network delivers A's held-up write all the same.
    let (status, body) = tokio::time::timeout(Duration::from_secs(10), delivered.recv())
        .await
        .ok()
        .flatten()
        .ok_or_else(|| anyhow::anyhow!("the network did not deliver A's held-up write"))?
        .map_err(|e| anyhow::anyhow!("the network could not deliver A's held-up write: {e}"))?;
    let problem: Option<Problem> = serde_json::from_slice(&body).ok();
    let kind = problem
        .as_ref()
        .map_or("(no problem body)".to_owned(), |p| p.kind.to_string());
    let highest = problem.as_ref().and_then(|p| p.highest);
    t.say(
        "network",
        format!(
            "delivers A's held-up write (token 7) -> {status} {kind}, highest {}",
            highest.map_or_else(|| "unknown".to_owned(), |h| h.to_string())
        ),
    );
    t.check(
        status == 409
            && problem
                .as_ref()
                .is_some_and(|p| p.kind == fence_core::ProblemType::StaleToken)
            && highest == Some(8),
        "A's delayed write is rejected by the sink with 409 urn:fence:stale-token, highest 8",
    );

    // A wakes up.
    freeze.send_replace(false);
    t.say("A", "wakes up");
    let refused = a_http
        .ready()
        .await
        .map_err(anyhow_box)?
        .call(post("A: charge again")?)
        .await;
    match &refused {
        Err(e) if e.is::<LeaseLost>() => t.say("A", format!("its layer refuses a new write: {e}")),
        Err(e) => t.say("A", format!("new write failed otherwise: {e}")),
        Ok((s, _)) => t.say("A", format!("new write was SENT: {s}")),
    }
    t.check(
        refused.as_ref().is_err_and(|e| e.is::<LeaseLost>()),
        "A's layer refuses to send once the lease is lost",
    );
    match lease_a.complete().await {
        Err(FinishError::Lost { owner, generation }) => {
            let holder = owner.map_or_else(|| "nobody".into(), |o| o.to_string());
            t.say("A", format!("complete(generation 7) -> rejected by the store: lease lost, {holder} holds generation {generation}"));
            t.check(
                holder == "worker-b" && generation == Generation::new(8),
                "A's stale completion is rejected by the store",
            );
        }
        other => {
            t.say("A", format!("complete(generation 7) -> {other:?}"));
            t.check(false, "A's stale completion is rejected by the store");
        }
    }
    let record = lease_b.complete().await?;
    t.say(
        "B",
        format!("complete(generation 8) -> {}", record.state.as_str()),
    );
    t.check(record.state.as_str() == "completed", "B completes the job");

    let entries = ledger.lock().unwrap_or_else(|e| e.into_inner()).clone();
    out!("\nledger of invoice-42 (what actually happened):");
    for (_, token, body) in &entries {
        out!("  token {token}: {body}");
    }
    let tokens: Vec<u64> = entries.iter().map(|e| e.1).collect();
    t.check(
        tokens == [7, 8],
        "the ledger holds exactly A's first write (7) and B's write (8)",
    );

    out!();
    let checks = t.checks.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for (ok, what) in &checks {
        out!("  [{}] {what}", if *ok { "ok" } else { "FAILED" });
    }
    let passed = checks.iter().all(|(ok, _)| *ok);
    out!(
        "\n{}",
        if passed {
            "PASS: the stale worker's late write and completion were rejected; only current holders produced effects."
        } else {
            "FAIL: the run did not go as the worked example says (see FAILED above)."
        }
    );
    Ok(if passed { 0 } else { 1 })
}

fn anyhow_box(e: Box<dyn std::error::Error + Send + Sync>) -> anyhow::Error {
    anyhow::anyhow!(e)
}
