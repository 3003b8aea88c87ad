//! The admin listener: metrics, liveness and readiness, apart from the proxied paths.
//!
//! - `GET /metrics`: Prometheus text.
//! - `GET /healthz`: 200 while the fence's store answers, 503 `store-unavailable` when it
//!   does not (the proxy then refuses fenced requests too).
//! - `GET /readyz`: 200 when the store answers and the upstream accepts a connection, 503
//!   otherwise, naming which.
//! - `GET /v1/fence/{job}`: `{"job", "highest", "in_flight"}`, the job's fence as the proxy
//!   sees it.
//! - `POST /v1/fence/{job}` `{"token"}`: raises the job's highest generation to a signed
//!   token's (what `fence revoke --sink` pushes); 200 `{"job", "highest"}`. Needs verify
//!   keys: the signature is what makes a push trustworthy.

use std::{
    convert::Infallible, future::Future, net::SocketAddr, pin::Pin, sync::Arc, time::Duration,
};

use bytes::Bytes;
use fence_core::{
    JobId, Problem, ProblemType,
    sink_api::{AdvanceRequest, FenceView as SinkFence},
};
use fence_sink::{FenceLayer, GenerationStore, IdempotencyStore, JobFence};
use http::{
    HeaderValue, Method, Request, Response, StatusCode,
    header::{ALLOW, CONTENT_TYPE},
};
use http_body_util::Full;
use hyper::body::Incoming;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::listen::Listener;

type Check = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;
type JobCheck = Pin<Box<dyn Future<Output = Result<JobFence, Problem>> + Send>>;
/// A push's answer: the job's highest generation before it (`None`: not known, the job was
/// not in memory) and after it.
type Push = Pin<Box<dyn Future<Output = Result<(Option<u64>, u64), Problem>> + Send>>;

/// How the admin listener tells whether the proxy can work (its store answers, its upstream
/// accepts connections) and what its fence holds.
#[derive(Clone)]
pub struct Health {
    store: Arc<dyn Fn() -> Check + Send + Sync>,
    /// The last probe of the store, shared for a second: the probes need no secret (unless
    /// `--admin-auth-file`), and one store read each would take the connections of a
    /// PostgreSQL pool that fenced requests wait for.
    probed: Arc<crate::probe::Shared<Result<(), String>>>,
    upstream: Option<String>,
    /// The last check of the upstream, shared for a second like the store's: each
    /// `/readyz` opening a connection of its own would leave one in TIME_WAIT per probe, and
    /// a flood of them would use up the ephemeral ports the proxy reaches the upstream by.
    upstream_checked: Arc<crate::probe::Shared<Result<(), String>>>,
    fence: Option<FenceView>,
    /// The admin listener's own clients (`--admin-auth-file`): without one of their
    /// secrets, every request is 401.
    auth: Option<crate::auth::Auth>,
}

/// What the admin listener reads of the proxy's fence.
#[derive(Clone)]
struct FenceView {
    job: Arc<dyn Fn(JobId) -> JobCheck + Send + Sync>,
    /// Raises a job to a signed token's generation; says what it was before.
    advance: Arc<dyn Fn(JobId, String) -> Push + Send + Sync>,
    /// Cached jobs, requests in flight, buffered bytes.
    gauges: Arc<dyn Fn() -> (usize, usize, usize) + Send + Sync>,
}

/// What a probe answers when the store failed: the error, never its sources (a database's
/// error text names tables and hosts, and the admin listener may be open to anyone who can
/// connect); the whole chain goes to the log.
fn store_failed(job: &JobId, e: &fence_sink::StoreError) -> String {
    // Rate-limited like refusals: probes come as often as anyone sends them.
    fence_sink::refusals::log_store_failure("fence", job, e);
    format!("the fence store failed ({e}); the proxy's log has the cause")
}

/// How long one probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Reads of `GET /v1/fence/{job}` at once, at most (each may take a store connection).
const JOB_READS: usize = 4;

impl Health {
    /// Probes `store` by reading a job's highest generation, and `upstream` (`host:port`,
    /// when given) by opening a connection.
    pub fn new<St: GenerationStore>(store: Arc<St>, upstream: Option<String>) -> Self {
        let probe: JobId = "fence-healthz".parse().expect("valid job id");
        let store: Arc<dyn Fn() -> Check + Send + Sync> = Arc::new(move || {
            let (store, probe) = (store.clone(), probe.clone());
            Box::pin(async move {
                match tokio::time::timeout(PROBE_TIMEOUT, store.highest(&probe)).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(store_failed(&probe, &e)),
                    Err(_) => Err(format!(
                        "the fence store did not answer within {PROBE_TIMEOUT:?}"
                    )),
                }
            })
        });
        Self::probing(store, upstream)
    }

    /// Probes the store with `store`.
    fn probing(store: Arc<dyn Fn() -> Check + Send + Sync>, upstream: Option<String>) -> Self {
        Self {
            store,
            probed: Arc::default(),
            upstream,
            upstream_checked: Arc::default(),
            fence: None,
            auth: None,
        }
    }

    /// Whether the store answers: one probe at a time, its answer shared for a second.
    async fn store_answers(&self) -> Result<(), String> {
        self.probed.check((self.store)()).await
    }

    /// Answers only requests with a bearer secret of `auth` (401 otherwise), when given.
    #[must_use]
    pub fn with_auth(mut self, auth: Option<crate::auth::Auth>) -> Self {
        self.auth = auth;
        self
    }

    /// Also serves `GET /v1/fence/{job}` and the fence's gauges from `layer` (a clone of the
    /// proxy's: it sees the same jobs).
    #[must_use]
    pub fn with_fence<St: GenerationStore + IdempotencyStore>(
        mut self,
        layer: FenceLayer<St>,
    ) -> Self {
        let reader = layer.clone();
        let reads = Arc::new(tokio::sync::Semaphore::new(JOB_READS));
        let job: Arc<dyn Fn(JobId) -> JobCheck + Send + Sync> = Arc::new(move |job| {
            let (layer, reads) = (reader.clone(), reads.clone());
            Box::pin(async move {
                // A job may have to be read from the store (one not cached): a few reads at
                // a time, cached or not, so that a flood takes no more of a PostgreSQL pool
                // than that.
                let Ok(_reading) = reads.try_acquire_owned() else {
                    return Err(Problem::new(
                        ProblemType::Overloaded,
                        format!(
                            "the admin listener is already reading {JOB_READS} jobs' fences; ask again shortly"
                        ),
                    ));
                };
                let unavailable = |detail| Problem::new(ProblemType::StoreUnavailable, detail);
                match tokio::time::timeout(PROBE_TIMEOUT, layer.job(&job)).await {
                    Ok(Ok(fence)) => Ok(fence),
                    Ok(Err(e)) => Err(unavailable(store_failed(&job, &e))),
                    Err(_) => Err(unavailable(format!(
                        "the fence store did not answer within {PROBE_TIMEOUT:?}"
                    ))),
                }
            })
        });
        let pusher = layer.clone();
        let advance: Arc<dyn Fn(JobId, String) -> Push + Send + Sync> =
            Arc::new(move |job, token| {
                let layer = pusher.clone();
                Box::pin(async move {
                    // What it was before, to log only a push that raised it: from memory
                    // only (the push below caches the job). Never a store read here: this
                    // runs before the token is verified, and junk pushes for uncached jobs
                    // would read the store without limit, taking a PostgreSQL pool from the
                    // fenced requests. Not in memory: the push is logged as a raise.
                    let before = layer.cached_highest(&job).map(|g| g.get());
                    Ok((before, layer.advance(&job, &token).await?))
                })
            });
        let gauges = Arc::new(move || {
            (
                layer.cached_jobs(),
                layer.in_flight(),
                layer.buffered_bytes(),
            )
        });
        self.fence = Some(FenceView {
            job,
            advance,
            gauges,
        });
        self
    }

    /// Whether the upstream accepts a connection: one check at a time, its answer shared
    /// for a second.
    async fn upstream(&self) -> Result<(), String> {
        let Some(addr) = &self.upstream else {
            return Ok(());
        };
        let connect = async {
            match tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("the upstream {addr} refuses connections: {e}")),
                Err(_) => Err(format!(
                    "the upstream {addr} did not accept a connection within {PROBE_TIMEOUT:?}"
                )),
            }
        };
        self.upstream_checked.check(connect).await
    }
}

/// Serves the admin paths on `listener` until `shutdown` resolves.
///
/// # Errors
/// None at present; the signature leaves room for listener failures.
pub async fn serve_admin(
    listener: Listener,
    handle: PrometheusHandle,
    health: Health,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    crate::listen::serve(listener, shutdown, move |peer, _| {
        let (handle, health) = (handle.clone(), health.clone());
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let (handle, health) = (handle.clone(), health.clone());
            async move { Ok::<_, Infallible>(admin(&handle, &health, req, peer).await) }
        })
    })
    .await;
    Ok(())
}

async fn admin(
    handle: &PrometheusHandle,
    health: &Health,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let text = |content_type: &'static str, body: String| {
        let mut response = Response::new(Full::from(body));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    };
    let unavailable = |detail: String| {
        let mut response =
            Problem::new(ProblemType::StoreUnavailable, detail).to_response::<Full<Bytes>>();
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        response
    };
    if health
        .auth
        .as_ref()
        .is_some_and(|auth| !auth.knows(req.headers()))
    {
        let mut response = Problem::new(
            ProblemType::Unauthenticated,
            "this admin listener needs a client secret (--admin-auth-file): send Authorization: Bearer <secret>",
        )
        .to_response::<Full<Bytes>>();
        response.headers_mut().insert(
            http::header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Bearer"),
        );
        return response;
    }
    if let (Some(fence), Some(raw)) = (&health.fence, req.uri().path().strip_prefix("/v1/fence/")) {
        let raw = raw.to_owned();
        return job_fence(fence, &raw, req, peer).await;
    }
    match req.uri().path() {
        "/metrics" if get => {
            if let Some(fence) = &health.fence {
                let (cached, in_flight, buffered) = (fence.gauges)();
                metrics::gauge!("fence_proxy_cached_jobs").set(cached as f64);
                metrics::gauge!("fence_proxy_in_flight").set(in_flight as f64);
                metrics::gauge!("fence_proxy_buffered_bytes").set(buffered as f64);
            }
            text("text/plain; version=0.0.4", handle.render())
        }
        "/healthz" if get => match health.store_answers().await {
            Ok(()) => text("text/plain; charset=utf-8", "ok\n".to_owned()),
            Err(why) => unavailable(why),
        },
        "/readyz" if get => match health.store_answers().await {
            Err(why) => unavailable(why),
            Ok(()) => match health.upstream().await {
                Ok(()) => text("text/plain; charset=utf-8", "ready\n".to_owned()),
                Err(why) => {
                    // Not ready is 503 whatever the cause: the body says the same status.
                    let mut problem = Problem::new(ProblemType::UpstreamUnavailable, why);
                    problem.status = StatusCode::SERVICE_UNAVAILABLE.as_u16();
                    problem.to_response::<Full<Bytes>>()
                }
            },
        },
        "/metrics" | "/healthz" | "/readyz" => {
            let p = Problem::new(
                ProblemType::MethodNotAllowed,
                format!(
                    "{} {}: only GET and HEAD are allowed",
                    req.method(),
                    req.uri().path()
                ),
            );
            let mut response = p.to_response::<Full<Bytes>>();
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
            response
        }
        path => Problem::new(
            ProblemType::NotFound,
            format!(
                "{path} is not served here; see GET /metrics, /healthz, /readyz and /v1/fence/{{job}}"
            ),
        )
        .to_response(),
    }
}

/// `GET /v1/fence/{job}`: the job's highest generation and requests in flight, as JSON;
/// `POST` with `{"token"}`: raise it to the token's generation.
async fn job_fence(
    fence: &FenceView,
    raw: &str,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let method = req.method().clone();
    if !matches!(method, Method::GET | Method::HEAD | Method::POST) {
        let mut response = Problem::new(
            ProblemType::MethodNotAllowed,
            "/v1/fence/{job}: only GET, HEAD and POST are allowed",
        )
        .to_response::<Full<Bytes>>();
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD, POST"));
        return response;
    }
    let job = fence_core::lease_api::decode_path_segment(raw)
        .map_err(|e| format!("job (in the path): {e}"))
        .and_then(|j| JobId::new(j).map_err(|e| format!("job (in the path): {e}")));
    let job = match job {
        Ok(job) => job,
        Err(detail) => return Problem::new(ProblemType::BadRequest, detail).to_response(),
    };
    if method == Method::POST {
        return push(fence, job, req.into_body(), peer).await;
    }
    match (fence.job)(job.clone()).await {
        Ok(f) => json_response(&SinkFence {
            job,
            highest: f.highest.get(),
            in_flight: Some(f.in_flight),
        }),
        Err(problem) => problem.to_response(),
    }
}

/// The largest push body read, in bytes.
const MAX_PUSH_BODY: usize = 4 * 1024;

/// `POST /v1/fence/{job}`: reads `{"token"}` (at most [`MAX_PUSH_BODY`] bytes, within
/// [`PROBE_TIMEOUT`]) and raises the job's fence to it. A push that raised it is logged at
/// warn, under the refusal log's limit per peer; one that changed nothing (a token at or
/// below the highest, pushed again) is not: any local process holding a token, which is no
/// secret, could otherwise write a line per request reporting a revoke that never happened.
async fn push(
    fence: &FenceView,
    job: JobId,
    body: Incoming,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    use http_body_util::{BodyExt, Limited};
    let bad = |detail: String| Problem::new(ProblemType::BadRequest, detail).to_response();
    let read = tokio::time::timeout(PROBE_TIMEOUT, Limited::new(body, MAX_PUSH_BODY).collect());
    let bytes = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) => {
            return bad(format!(
                "body: not read (at most {MAX_PUSH_BODY} bytes): {e}"
            ));
        }
        Err(_) => return bad(format!("body: not received within {PROBE_TIMEOUT:?}")),
    };
    let token = match AdvanceRequest::from_json(&bytes) {
        Ok(push) => push.token,
        Err(e) => return bad(e.to_string()),
    };
    match (fence.advance)(job.clone(), token).await {
        Ok((before, highest)) => {
            let raised = before.is_none_or(|before| highest > before);
            if raised
                && let Some(suppressed) = fence_sink::refusals::admit("fence-push", Some(peer.ip()))
            {
                tracing::warn!(
                    job = %job,
                    generation = highest,
                    before,
                    peer = %peer.ip(),
                    suppressed = (suppressed > 0).then_some(suppressed),
                    "fence raised by a push (revoke)"
                );
            }
            json_response(&SinkFence {
                job,
                highest,
                in_flight: None,
            })
        }
        Err(problem) => problem.to_response(),
    }
}

fn json_response(view: &SinkFence) -> Response<Full<Bytes>> {
    let body = serde_json::to_string(view).unwrap_or_default();
    let mut response = Response::new(Full::from(body));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A flood of `/healthz` and `/readyz` probes reads the store once: one probe at a
    /// time, its answer shared for a second (each would otherwise take a connection of a
    /// PostgreSQL pool that fenced requests wait for).
    #[tokio::test(start_paused = true)]
    async fn a_flood_of_probes_reads_the_store_once() {
        let reads = Arc::new(AtomicUsize::new(0));
        let counted = reads.clone();
        let store: Arc<dyn Fn() -> Check + Send + Sync> = Arc::new(move || {
            let reads = counted.clone();
            Box::pin(async move {
                reads.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await; // a slow store
                Ok(())
            })
        });
        let health = Health::probing(store, None);
        let flood: Vec<_> = (0..100)
            .map(|_| {
                let health = health.clone();
                tokio::spawn(async move { health.store_answers().await })
            })
            .collect();
        for probe in flood {
            assert_eq!(probe.await.unwrap(), Ok(()));
        }
        assert_eq!(
            reads.load(Ordering::SeqCst),
            1,
            "one store read for the flood"
        );
    }

    /// A flood of `/readyz` opens one connection to the upstream, not one each: the check
    /// is shared for a second like the store's (each connection the proxy closes first
    /// waits in TIME_WAIT for a minute, and enough of them use up the ports to the upstream).
    #[tokio::test]
    async fn a_flood_of_readiness_checks_connects_to_the_upstream_once() {
        let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = upstream.local_addr().unwrap().to_string();
        let (accepted, mut peers) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((_, peer)) = upstream.accept().await {
                let _ = accepted.send(peer);
            }
        });
        let store: Arc<dyn Fn() -> Check + Send + Sync> = Arc::new(|| Box::pin(async { Ok(()) }));
        let health = Health::probing(store, Some(addr.clone()));
        let flood: Vec<_> = (0..200)
            .map(|_| {
                let health = health.clone();
                tokio::spawn(async move { health.upstream().await })
            })
            .collect();
        for check in flood {
            assert_eq!(check.await.unwrap(), Ok(()));
        }
        // A last connection of the test's own: accepted after every one the checks made.
        let last = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let last = last.local_addr().unwrap();
        let mut checks = 0;
        while peers.recv().await.unwrap() != last {
            checks += 1;
        }
        // Two at most: a run slowed past the second starts one more check.
        assert!(
            (1..=2).contains(&checks),
            "{checks} upstream connections for 200 checks"
        );
    }
}
