//! A lease store that is down: its failures are logged rate-limited, and health probes
//! share one read of it a second, failed or not.
//!
//! One test in this binary: the refusal log's rate limit is the process's, and another test
//! failing the store at the same time would spend it.

use std::{
    io::Write,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use axum::body::Body;
use fence_core::{JobId, Owner, lease_api::ListQuery};
use fence_lease::{
    ClaimTerms, LeaseKey, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, SlotClaim,
    StoreError,
};
use http::{Request, StatusCode};
use tower::ServiceExt;

/// A store whose every call fails, as a database that went away does, naming its host.
#[derive(Default)]
struct DownStore {
    reads: AtomicUsize,
}

fn down() -> StoreError {
    StoreError::io(std::io::Error::other(
        "connection to db.internal:5432 refused",
    ))
}

impl LeaseStore for DownStore {
    async fn apply(&self, _: &JobId, _: LeaseOp) -> Result<Outcome, StoreError> {
        Err(down())
    }

    async fn get(&self, _: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        Err(down())
    }

    async fn list(&self, _: &ListQuery) -> Result<ListPage, StoreError> {
        Err(down())
    }

    async fn claim_slot(
        &self,
        _: &JobId,
        _: &Owner,
        _: &LeaseKey,
        _: ClaimTerms,
        _: u32,
    ) -> Result<SlotClaim, StoreError> {
        Err(down())
    }
}

/// What the test's subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// The lines that log a failure of the lease store (not the refusals' own lines).
    fn store_failures(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains("store=\"lease\""))
            .map(str::to_owned)
            .collect()
    }
}

#[tokio::test]
async fn a_down_store_is_logged_rate_limited_and_probed_once_a_second() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _log = tracing::subscriber::set_default(subscriber);
    let store = Arc::new(DownStore::default());
    let router = fence::server::router(store.clone(), fence::server::ServerOptions::default());
    let send = |method: &str, path: &str, body: &'static str| {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let router = router.clone();
        async move { router.oneshot(request).await.unwrap().status() }
    };

    // Unauthenticated probes of a store that is down: one read answers them all.
    for _ in 0..25 {
        assert_eq!(
            send("GET", "/healthz", "").await,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
    assert_eq!(
        store.reads.load(Ordering::SeqCst),
        1,
        "25 probes within a second, one read of the store"
    );

    // Lease calls, each of which fails in the store.
    let claim = r#"{"owner": "w", "lease_key": "k0123456789abcdefghijk"}"#;
    for _ in 0..25 {
        let status = send("POST", "/v1/leases/j/claim", claim).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let status = send("GET", "/v1/leases/j", "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        let status = send("GET", "/v1/leases", "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    }

    let lines = captured.store_failures();
    assert_eq!(
        lines.len(),
        fence_sink::refusals::PER_WINDOW as usize,
        "76 store failures in one window:\n{}",
        lines.join("\n")
    );
    assert!(
        lines[0].contains("db.internal:5432"),
        "the log has the cause: {}",
        lines[0]
    );
}
