//! The fencing reverse proxy: PROTOCOL.md section 3 in front of any HTTP service (`fence proxy`).
//!
//! Every request passes through a [`FenceLayer`] (stale tokens get 409, missing ones 428, …)
//! and, when admitted, is streamed to the upstream over a kept-alive HTTP/1.1 connection;
//! the answer is streamed back. Hop-by-hop headers are dropped in both directions, the client's
//! address is appended to `X-Forwarded-For`, and the fencing headers are forwarded so the
//! upstream can record the token it acted under.
//!
//! A client that goes away does not cut an admitted request short: each request runs in a
//! task of its own until the upstream answered (or its connection closed), so a newer token
//! never reaches the upstream while an older request may still take effect there
//! (DESIGN-NOTES section 2).
//!
//! The proxy runs [`ProxyConfig::workers`] threads (one per core by default), each with a
//! single-threaded runtime, its own upstream connection pool and its own accept loop on the
//! shared listening socket. A connection, its requests and their upstream calls stay on one
//! thread: no work is handed between cores on the way through, which is what a reverse
//! proxy spends most of its time on otherwise. The fence itself (the highest generation per
//! job, the gates that order a bump after older requests) is one, shared by every thread.
//!
//! ```no_run
//! # async fn run() -> anyhow::Result<()> {
//! use fence::proxy::{ProxyConfig, serve};
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8081").await?;
//! let store = fence_sink::SledStore::open("/var/lib/fence-proxy")?;
//! let config = ProxyConfig::new("http://127.0.0.1:8080".parse()?);
//! serve(listener, store, config, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(()) }
//! ```

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use fence_core::{
    Problem, ProblemType,
    headers::{IDEMPOTENCY_KEY, X_FENCING_JOB, X_FENCING_TOKEN},
};
use fence_sink::{BoxError, Fence, FenceLayer, GenerationStore, IdempotencyStore, RequestBody};
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version,
    header::{ALLOW, CONTENT_TYPE, HOST},
    uri::{Authority, PathAndQuery, Scheme},
};
use http_body_util::{Either, Full};
use hyper::{
    body::{Body, Incoming},
    client::conn::http1::SendRequest,
};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::{
    net::{TcpListener, TcpStream},
    sync::{mpsc, watch},
    task::JoinSet,
    time::Instant,
};
use tower::{Layer, Service, ServiceExt};

/// How long in-flight connections and requests may take to finish after shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Headers that describe one connection, not the message (RFC 9110 section 7.6.1, plus the
/// non-standard `Keep-Alive` and `Proxy-Connection`); never forwarded in either direction.
const HOP_BY_HOP: [HeaderName; 9] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
    http::header::UPGRADE,
];

/// How the proxy fences and forwards.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where admitted requests go, e.g. `http://127.0.0.1:8080` or `http://10.0.0.5/api`
    /// (a path is a prefix joined to every request's path). Only `http` is supported.
    pub upstream: Uri,
    /// The methods that are fenced (default POST, PUT, PATCH, DELETE); others pass unfenced.
    pub fence_methods: Vec<Method>,
    /// Whether a fenced request without fencing headers gets 428 (true, the default) or
    /// passes unfenced (false).
    pub require_token: bool,
    /// How `Idempotency-Key` is handled; `None` ignores it (it is still checked for syntax).
    /// Default: the sink's defaults.
    pub idempotency: Option<fence_sink::IdempotencyConfig>,
    /// How long a higher token waits for older in-flight requests of its job (default 10 s).
    pub drain_timeout: Duration,
    /// How long the generation store may take per call (default 5 s).
    pub store_timeout: Duration,
    /// How long the upstream may take to answer with a response head (default 60 s); then
    /// the client gets 504 and the upstream connection is closed.
    pub upstream_timeout: Duration,
    /// How long a kept-alive upstream connection may stay unused and still be reused
    /// (default 90 s). Older ones are closed: a firewall or NAT on the way may have dropped
    /// them without a word, and a request sent on one would wait for `upstream_timeout`.
    pub upstream_idle_timeout: Duration,
    /// Whether the upstream sees the client's `Host` (true) or its own authority, with the
    /// client's `Host` in `X-Forwarded-Host` (false, the default).
    pub preserve_host: bool,
    /// Require signed tokens valid under one of these keys (contract section 6).
    pub verifier: Option<fence_core::signing::TokenVerifier>,
    /// How many threads serve connections, each on a runtime of its own with its own
    /// upstream pool (default: one per core the process may use; 0 counts as 1).
    pub workers: usize,
}

impl ProxyConfig {
    /// Forwards to `upstream` with the defaults documented on each field.
    pub fn new(upstream: Uri) -> Self {
        Self {
            upstream,
            fence_methods: vec![Method::POST, Method::PUT, Method::PATCH, Method::DELETE],
            require_token: true,
            idempotency: Some(fence_sink::IdempotencyConfig::default()),
            drain_timeout: Duration::from_secs(10),
            store_timeout: Duration::from_secs(5),
            upstream_timeout: Duration::from_secs(60),
            upstream_idle_timeout: Duration::from_secs(90),
            preserve_host: false,
            verifier: None,
            workers: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        }
    }
}

/// Serves the proxy on `listener` until `shutdown` resolves, then stops accepting and finishes
/// in-flight requests (graceful, bounded by [`SHUTDOWN_GRACE`]).
///
/// # Errors
///
/// When `config.upstream` is not an `http://host[:port][/path]` URI (no other scheme, no
/// query, no user info).
pub async fn serve<St>(
    listener: TcpListener,
    layer_store: St,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    St: GenerationStore + IdempotencyStore,
{
    let target = Arc::new(Target::parse(&config.upstream)?);
    let mut layer = FenceLayer::new(layer_store)
        .fence_methods(config.fence_methods.iter().cloned())
        .store_timeout(config.store_timeout)
        // A client that goes away must not cancel an admitted request before the upstream
        // answered: the fence counts it in flight until then (DESIGN-NOTES section 2).
        .run_to_completion()
        .drain_timeout(config.drain_timeout);
    layer = if config.require_token {
        layer.require_token()
    } else {
        layer.allow_missing_token()
    };
    layer = match config.idempotency {
        Some(idempotency) => layer.idempotency(idempotency.store_timeout(config.store_timeout)),
        None => layer.without_idempotency(),
    };
    if let Some(verifier) = config.verifier.clone() {
        layer = layer.require_signatures(verifier);
    }

    let listen = listener
        .local_addr()
        .context("reading the proxy's listen address")?;
    // Every worker accepts on its own copy of the listening socket (one socket, several
    // descriptors): the kernel hands each new connection to one of them.
    let listener = listener
        .into_std()
        .context("taking the listening socket off the runtime")?;
    let workers = config.workers.max(1);
    let (stop, stopped) = watch::channel(false);
    let (ended, mut ends) = mpsc::unbounded_channel::<anyhow::Result<()>>();
    for n in 0..workers {
        let started = listener
            .try_clone()
            .context("sharing the listening socket with a worker")
            .and_then(|listener| {
                let worker = Worker {
                    listener,
                    layer: layer.clone(),
                    target: target.clone(),
                    timeout: config.upstream_timeout,
                    idle_timeout: config.upstream_idle_timeout,
                    preserve_host: config.preserve_host,
                    stopped: stopped.clone(),
                };
                let report = ended.clone();
                std::thread::Builder::new()
                    .name(format!("fence-proxy-{n}"))
                    .spawn(move || {
                        let result =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()))
                                .unwrap_or_else(|_| {
                                    Err(anyhow::anyhow!("a proxy worker panicked"))
                                });
                        let _ = report.send(result);
                    })
                    .context("starting a proxy worker thread")
            });
        if let Err(e) = started {
            // Stop the workers already running before giving up.
            let _ = stop.send(true);
            drop(ended);
            while ends.recv().await.is_some() {}
            return Err(e);
        }
    }
    drop((listener, ended));
    tracing::info!(%listen, upstream = %target.display, workers, "fencing proxy started");

    // Run until shutdown is asked for, or until a worker ends on its own (it failed).
    let mut result = tokio::select! {
        () = shutdown => Ok(()),
        Some(early) = ends.recv() => {
            early.and_then(|()| Err(anyhow::anyhow!("a proxy worker stopped unexpectedly")))
        }
    };
    let _ = stop.send(true);
    while let Some(end) = ends.recv().await {
        if result.is_ok() {
            result = end;
        }
    }
    tracing::info!("fencing proxy stopped");
    result
}

/// One serving thread of the proxy: a single-threaded runtime with its own accept loop and
/// upstream pool, sharing the fence (and its store) with the other workers.
struct Worker<St> {
    listener: std::net::TcpListener,
    layer: FenceLayer<St>,
    target: Arc<Target>,
    timeout: Duration,
    idle_timeout: Duration,
    preserve_host: bool,
    stopped: watch::Receiver<bool>,
}

impl<St: GenerationStore + IdempotencyStore> Worker<St> {
    /// Serves until the proxy stops, then finishes in-flight requests (bounded by
    /// [`SHUTDOWN_GRACE`]).
    fn run(self) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting a proxy worker's runtime")?;
        runtime.block_on(async move {
            let listener = TcpListener::from_std(self.listener)
                .context("registering the listening socket with a worker's runtime")?;
            // This thread's own upstream connections, served on its runtime: a request
            // and its upstream call never cross threads.
            let conns = Arc::new(UpstreamConns::new(
                &self.target.authority,
                self.idle_timeout,
            ));
            // Every copy of the upstream service holds a sender: the connections' and each
            // request's own, which lives until its upstream call is over. All are gone when
            // the connections are closed and the last request has finished.
            let (running, mut finished) = mpsc::channel::<()>(1);
            let fence = self.layer.layer(Upstream {
                conns,
                outcomes: Arc::new(Outcomes::new()),
                target: self.target,
                timeout: self.timeout,
                preserve_host: self.preserve_host,
                _running: running,
            });
            let mut stopped = self.stopped;
            let shutdown = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            let deadline = accept_loop(listener, shutdown, move |peer| {
                let (fence, client) = (fence.clone(), ClientAddr::new(peer));
                hyper::service::service_fn(move |req| handle(fence.clone(), client.clone(), req))
            })
            .await;
            if tokio::time::timeout_at(deadline, finished.recv())
                .await
                .is_err()
            {
                tracing::warn!("shutdown grace ran out with upstream requests still running");
            }
            Ok(())
        })
    }
}

/// Serves `GET /metrics` (Prometheus text from `handle`) and `GET /healthz` on a separate admin
/// listener until `shutdown` resolves.
///
/// # Errors
///
/// None at present; the signature leaves room for listener failures.
pub async fn serve_admin(
    listener: TcpListener,
    handle: PrometheusHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    accept_loop(listener, shutdown, move |_| {
        let handle = handle.clone();
        hyper::service::service_fn(move |req: Request<Incoming>| {
            let response = admin(&handle, &req);
            async move { Ok::<_, Infallible>(response) }
        })
    })
    .await;
    Ok(())
}

fn admin(handle: &PrometheusHandle, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    let text = |content_type: &'static str, body: String| {
        let mut response = Response::new(Full::from(body));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    };
    match req.uri().path() {
        "/metrics" if get => text("text/plain; version=0.0.4", handle.render()),
        "/healthz" if get => text("text/plain; charset=utf-8", "ok\n".to_owned()),
        "/metrics" | "/healthz" => {
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
            format!("{path} is not served here; see GET /metrics and GET /healthz"),
        )
        .to_response(),
    }
}

/// The body of an upstream answer as the fence sees it: the upstream's own, or a problem.
type UpstreamBody = Either<Incoming, Full<Bytes>>;
/// The body of every answer of the proxy.
type ProxyBody = fence_sink::ResponseBody<UpstreamBody>;

/// The client's IP as `X-Forwarded-For` writes it, made once per connection and put into
/// each request's extensions.
#[derive(Debug, Clone)]
struct ClientAddr(HeaderValue);

impl ClientAddr {
    fn new(peer: SocketAddr) -> Self {
        let ip = peer.ip().to_canonical().to_string();
        // An IP address is digits, letters, dots and colons: always a valid header value.
        Self(HeaderValue::from_str(&ip).unwrap_or(HeaderValue::from_static("unknown")))
    }
}

/// One request, through the fence to the upstream. The fence runs admitted requests to
/// completion: when a client disconnects (hyper then drops this future) before the upstream
/// answered, the rest of the request goes on in a task of its own, and the fence counts it
/// in flight until then.
async fn handle<St>(
    fence: Fence<Upstream, St>,
    client: ClientAddr,
    mut req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible>
where
    St: GenerationStore + IdempotencyStore,
{
    req.extensions_mut().insert(client);
    fence.oneshot(req).await
}

/// The upstream's address, checked once at start.
#[derive(Debug)]
struct Target {
    authority: Authority,
    /// The `Host` the upstream sees (unless `preserve_host`).
    host: HeaderValue,
    /// The upstream's path without a trailing `/` (empty for none), joined before every path.
    prefix: String,
    /// `http://authority/prefix`, for messages.
    display: String,
}

impl Target {
    fn parse(uri: &Uri) -> anyhow::Result<Self> {
        let Some(scheme) = uri.scheme() else {
            bail!("upstream {uri}: no scheme; write it as http://host:port");
        };
        if *scheme != Scheme::HTTP {
            bail!("upstream {uri}: only http:// upstreams are supported, not {scheme}://");
        }
        let Some(authority) = uri.authority() else {
            bail!("upstream {uri}: no host; write it as http://host:port");
        };
        if authority.as_str().contains('@') {
            bail!("upstream {uri}: user info (user:password@) is not supported");
        }
        if authority.host().is_empty() {
            bail!("upstream {uri}: empty host");
        }
        if uri.query().is_some() {
            bail!(
                "upstream {uri}: a query is not supported; give only scheme, host, port and an optional path prefix"
            );
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let host = HeaderValue::from_str(authority.as_str())
            .with_context(|| format!("upstream {uri}: the host is not a valid Host header"))?;
        Ok(Self {
            authority: authority.clone(),
            host,
            display: format!("{scheme}://{authority}{prefix}"),
            prefix,
        })
    }

    /// The request target sent upstream for a request to `original`: its path (behind the
    /// prefix) and query, in origin form.
    fn uri_for(&self, original: &Uri) -> Result<Uri, http::Error> {
        let pq = original
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        if self.prefix.is_empty() || !pq.as_str().starts_with('/') {
            return Ok(Uri::from(pq));
        }
        Ok(Uri::from(PathAndQuery::try_from(format!(
            "{}{pq}",
            self.prefix
        ))?))
    }
}

/// The inner service of the fence: forwards a request to the upstream over the worker's
/// connections and answers 502/504 problems when the upstream fails or is too slow.
#[derive(Clone)]
struct Upstream {
    conns: Arc<UpstreamConns>,
    outcomes: Arc<Outcomes>,
    target: Arc<Target>,
    timeout: Duration,
    preserve_host: bool,
    /// Counts this copy for graceful shutdown (see `Worker::run`).
    _running: mpsc::Sender<()>,
}

impl Service<Request<RequestBody<Incoming>>> for Upstream {
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody<Incoming>>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.forward(req).await) })
    }
}

impl Upstream {
    async fn forward(self, req: Request<RequestBody<Incoming>>) -> Response<UpstreamBody> {
        let started = Instant::now();
        let (mut parts, body) = req.into_parts();
        if parts.method == Method::CONNECT {
            self.outcomes.bad_target.record(started);
            return problem(Problem::new(
                ProblemType::MethodNotAllowed,
                "CONNECT is not supported: this is a reverse proxy, not a tunnel",
            ));
        }
        let uri = match self.target.uri_for(&parts.uri) {
            Ok(uri) => uri,
            Err(e) => {
                self.outcomes.bad_target.record(started);
                return problem(Problem::new(
                    ProblemType::BadRequest,
                    format!(
                        "the request target {} cannot be forwarded to {}: {e}",
                        parts.uri, self.target.display
                    ),
                ));
            }
        };
        let original_host = parts.headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        strip_hop_by_hop(&mut parts.headers, true);
        let headers = &mut parts.headers;
        if self.preserve_host {
            // HTTP/1.1 needs a Host: an HTTP/1.0 client without one gets the upstream's.
            headers.insert(
                HOST,
                original_host.unwrap_or_else(|| self.target.host.clone()),
            );
        } else {
            headers.insert(HOST, self.target.host.clone());
            match original_host {
                Some(host) => {
                    headers.insert(X_FORWARDED_HOST, host);
                }
                None => {
                    headers.remove(X_FORWARDED_HOST);
                }
            }
        }
        if let Some(ClientAddr(ip)) = parts.extensions.get::<ClientAddr>() {
            append_forwarded_for(headers, ip);
        }
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
        parts.uri = uri;
        // The upstream connections speak HTTP/1.1, whatever the client spoke to us.
        parts.version = Version::HTTP_11;

        let request = self.conns.send(Request::from_parts(parts, body));
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(response)) => {
                self.outcomes.ok.record(started);
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, false);
                Response::from_parts(head, Either::Left(body))
            }
            Ok(Err(failed)) => {
                self.outcomes.unavailable.record(started);
                let (cause, maybe_seen) = match &failed {
                    SendFailed::Connect(e) => (crate::error_chain(e.as_ref()), false),
                    SendFailed::Request(e) => (crate::error_chain(e), true),
                };
                tracing::warn!(upstream = %self.target.display, error = %cause, "upstream failed");
                let mut response = problem(Problem::new(
                    ProblemType::UpstreamUnavailable,
                    format!("upstream {} failed: {cause}", self.target.display),
                ));
                if maybe_seen {
                    // The request may have reached the upstream before the failure.
                    response.extensions_mut().insert(fence_sink::OutcomeUnknown);
                }
                response
            }
            Err(_) => {
                // Dropping the request future closes its upstream connection.
                self.outcomes.timeout.record(started);
                tracing::warn!(upstream = %self.target.display, timeout = ?self.timeout, "upstream timed out");
                let mut p = Problem::new(
                    ProblemType::UpstreamUnavailable,
                    format!(
                        "upstream {} did not answer within {:?}; its connection was closed",
                        self.target.display, self.timeout
                    ),
                );
                p.status = StatusCode::GATEWAY_TIMEOUT.as_u16();
                p.title = "Upstream timeout".into();
                let mut response = problem(p);
                response.extensions_mut().insert(fence_sink::OutcomeUnknown);
                response
            }
        }
    }
}

/// Keep-alive HTTP/1.1 connections from one worker thread to the upstream.
///
/// A request takes a connection that is ready for one (not closed, no response still
/// streaming on it), or opens a new one, and puts it back as soon as the response head
/// arrived: it is ready again once that response's body has been read. A kept-alive
/// connection the upstream closed just before the request went out hands the request
/// back untouched (hyper's `try_send_request`), and it is tried on another connection.
struct UpstreamConns {
    /// `host:port` to connect to.
    addr: String,
    idle: std::sync::Mutex<Vec<Idle>>,
    idle_timeout: Duration,
}

/// A kept-alive connection and when it was last handed back.
struct Idle {
    conn: SendRequest<RequestBody<Incoming>>,
    since: Instant,
}

/// How an upstream call failed; the variants say whether the upstream may have seen it.
enum SendFailed {
    /// No connection could be opened: the upstream never saw the request.
    Connect(BoxError),
    /// The connection failed after the request was (perhaps) written.
    Request(hyper::Error),
}

/// More idle connections than this per worker are closed instead of kept.
const MAX_IDLE_PER_WORKER: usize = 256;

impl UpstreamConns {
    fn new(authority: &Authority, idle_timeout: Duration) -> Self {
        let addr = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:80", authority.host()),
        };
        Self {
            addr,
            idle: std::sync::Mutex::default(),
            idle_timeout,
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // Nothing can panic while the list is held; a poisoned list is still a valid list.
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn take_ready(&self) -> Option<SendRequest<RequestBody<Incoming>>> {
        let now = Instant::now();
        let mut idle = self.idle();
        // Dropping the last handle of a connection closes it.
        idle.retain(|i| !i.conn.is_closed() && now.duration_since(i.since) < self.idle_timeout);
        let ready = idle.iter().rposition(|i| i.conn.is_ready())?;
        Some(idle.swap_remove(ready).conn)
    }

    fn put_back(&self, conn: SendRequest<RequestBody<Incoming>>) {
        let mut idle = self.idle();
        if !conn.is_closed() && idle.len() < MAX_IDLE_PER_WORKER {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self) -> Result<SendRequest<RequestBody<Incoming>>, BoxError> {
        let stream = TcpStream::connect(&self.addr).await?;
        let _ = stream.set_nodelay(true);
        let (conn, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        // Served on this worker's runtime, next to the requests that use it.
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(conn)
    }

    async fn send(
        &self,
        mut req: Request<RequestBody<Incoming>>,
    ) -> Result<Response<Incoming>, SendFailed> {
        loop {
            let (mut conn, reused) = match self.take_ready() {
                Some(conn) => (conn, true),
                None => (self.connect().await.map_err(SendFailed::Connect)?, false),
            };
            match conn.try_send_request(req).await {
                Ok(response) => {
                    self.put_back(conn);
                    return Ok(response);
                }
                Err(mut e) => match e.take_message() {
                    // Never written: a kept-alive connection closed under us. Each retry
                    // uses up one idle connection, so this ends on a new one at the latest.
                    Some(back) if reused => req = back,
                    Some(_) => return Err(SendFailed::Connect(e.into_error().into())),
                    None => return Err(SendFailed::Request(e.into_error())),
                },
            }
        }
    }
}

fn problem(p: Problem) -> Response<UpstreamBody> {
    p.to_response::<Full<Bytes>>().map(Either::Right)
}

/// The metrics of one outcome of upstream calls, registered once (a lookup by name and
/// label on every request would cost more than the rest of the bookkeeping).
struct Outcome {
    count: metrics::Counter,
    seconds: metrics::Histogram,
}

impl Outcome {
    fn new(outcome: &'static str) -> Self {
        Self {
            count: metrics::counter!("fence_proxy_upstream_requests_total", "outcome" => outcome),
            seconds: metrics::histogram!("fence_proxy_upstream_seconds", "outcome" => outcome),
        }
    }

    fn record(&self, started: Instant) {
        self.count.increment(1);
        self.seconds.record(started.elapsed().as_secs_f64());
    }
}

/// Every outcome of an upstream call, as `fence_proxy_upstream_requests_total{outcome}`.
struct Outcomes {
    ok: Outcome,
    unavailable: Outcome,
    timeout: Outcome,
    bad_target: Outcome,
}

impl Outcomes {
    fn new() -> Self {
        Self {
            ok: Outcome::new("ok"),
            unavailable: Outcome::new("unavailable"),
            timeout: Outcome::new("timeout"),
            bad_target: Outcome::new("bad_target"),
        }
    }
}

/// Removes the hop-by-hop headers and every header the `Connection` header names. On a
/// request the fencing and idempotency headers stay even when named: the fence already
/// acted on them, and the upstream must see the token it accepted.
fn strip_hop_by_hop(headers: &mut HeaderMap, request: bool) {
    // Most messages carry none of them: looking at the few names present is cheaper than
    // nine removals, each of which hashes its name.
    if !headers.keys().any(|name| HOP_BY_HOP.contains(name)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        let kept = request && [X_FENCING_JOB, X_FENCING_TOKEN, IDEMPOTENCY_KEY].contains(&name);
        if !kept {
            headers.remove(name);
        }
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Appends the client's IP to `X-Forwarded-For`, joining earlier values into one line.
fn append_forwarded_for(headers: &mut HeaderMap, ip: &HeaderValue) {
    if !headers.contains_key(&X_FORWARDED_FOR) {
        headers.insert(X_FORWARDED_FOR, ip.clone());
        return;
    }
    let mut joined: Vec<u8> = Vec::new();
    for value in headers.get_all(&X_FORWARDED_FOR) {
        let value = value.as_bytes().trim_ascii();
        if !value.is_empty() {
            joined.extend_from_slice(value);
            joined.extend_from_slice(b", ");
        }
    }
    joined.extend_from_slice(ip.as_bytes());
    match HeaderValue::from_bytes(&joined) {
        Ok(value) => {
            headers.insert(X_FORWARDED_FOR, value);
        }
        Err(_) => {
            // Earlier values were valid header bytes, so this cannot happen; still, never
            // lose the client's address.
            headers.append(X_FORWARDED_FOR, ip.clone());
        }
    }
}

/// Accepts connections until `shutdown` resolves, serving each with the service `make`
/// builds for its peer; then asks every connection to finish gracefully and waits for them
/// up to [`SHUTDOWN_GRACE`]. Returns the grace deadline, for other waits to share.
async fn accept_loop<M, S, B>(
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut make: M,
) -> Instant
where
    M: FnMut(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new());
    builder.http2().timer(TokioTimer::new());
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let service = make(peer);
                    connections.spawn(connection(builder.clone(), stream, service, stopped.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    drop(make);
    let deadline = Instant::now() + SHUTDOWN_GRACE;
    let _ = stop.send(true);
    let drained = tokio::time::timeout_at(deadline, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            open = connections.len(),
            "shutdown grace ran out; closing the remaining connections"
        );
        connections.shutdown().await;
    }
    deadline
}

/// Serves one connection; on shutdown lets its in-flight requests finish, then closes it.
async fn connection<S, B>(
    builder: auto::Builder<TokioExecutor>,
    stream: TcpStream,
    service: S,
    mut stop: watch::Receiver<bool>,
) where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let _ = stream.set_nodelay(true);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = async {
            // The guard `wait_for` returns must not live across the await below.
            let _ = stop.wait_for(|stop| *stop).await;
        } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
