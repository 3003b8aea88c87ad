//! What the proxy is told: [`ProxyConfig`], and the upstream address checked once at start.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use http::{
    HeaderValue, Method, Uri,
    uri::{Authority, PathAndQuery, Scheme},
};

use crate::listen::Limits;

/// How the proxy fences and forwards.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where admitted requests go, e.g. `http://127.0.0.1:8080` or `http://10.0.0.5/api`
    /// (a path is a prefix joined to every request's path); `http` or `https`.
    pub upstream: Uri,
    /// The methods that are fenced; `None` (the default) fences every method but GET, HEAD,
    /// OPTIONS and TRACE, so a method nobody listed fails closed.
    pub fence_methods: Option<Vec<Method>>,
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
    /// How long a fenced request's body may take to arrive after admission (default 30 s).
    pub body_timeout: Duration,
    /// How long a request of unknown outcome still counts as in flight (default 60 s, the
    /// upstream timeout's default).
    pub unknown_outcome_hold: Duration,
    /// The upstream's own answers whose outcome is unknown, as the proxy's 504 is (default
    /// 504: a gateway's, in front of the service, comes while it may still act); they hold
    /// their job for `unknown_outcome_hold`.
    pub unknown_outcome_statuses: Vec<http::StatusCode>,
    /// The gRPC statuses, in the upstream's answer to a gRPC call, whose outcome is unknown
    /// (default CANCELLED and DEADLINE_EXCEEDED: a gRPC server answers them after dropping
    /// the handler of a call whose deadline ran out); they hold their job for
    /// `unknown_outcome_hold`.
    pub unknown_outcome_grpc_statuses: fence_sink::GrpcStatuses,
    /// The most bytes of bodies the fence holds at once (default 256 MiB).
    pub max_buffered_bytes: usize,
    /// How far the lease server's clock may be ahead (default 5 s), for expired tokens.
    pub clock_skew: Duration,
    /// Forget a job with no admitted request for this long (default: never); needs a
    /// verifier and at least `max_lease_ttl` plus twice `clock_skew`. On sled, never sooner
    /// than what a request may run after a restart (the upstream or body timeout, the later;
    /// with idempotency plus the store timeout and the body timeout) plus the unknown-outcome
    /// hold.
    pub forget_after: Option<Duration>,
    /// The longest lease the lease server grants (default 24 h).
    pub max_lease_ttl: Duration,
    /// How long a kept-alive upstream connection may stay unused and still be reused
    /// (default 4 s, `fence proxy --upstream-idle-timeout`). Older ones are not reused
    /// (closed when the worker next looks for a connection): the upstream closes its idle
    /// connections after its own keep-alive timeout (Node's is 5 s), and a request written
    /// just as it does gets no answer (a 502 of unknown outcome, which holds its job); a
    /// firewall or NAT on the way may have dropped them without a word, and a request sent
    /// on one would wait for `upstream_timeout`.
    pub upstream_idle_timeout: Duration,
    /// Whether the upstream sees the client's `Host` (true) or its own authority, with the
    /// client's `Host` in `X-Forwarded-Host` (false, the default).
    pub preserve_host: bool,
    /// Whether forwarded requests get `Via: <version> fence` appended (true, the default;
    /// RFC 9110 section 7.6.3).
    pub via: bool,
    /// Require signed tokens valid under one of these keys (contract section 6).
    pub verifier: Option<fence_core::signing::TokenVerifier>,
    /// How many threads serve connections, each on a runtime of its own with its own
    /// upstream pool (default: one per core the process may use; 0 counts as 1).
    pub workers: usize,
    /// Trust only this CA (PEM) for an `https://` upstream, instead of the system's roots.
    pub upstream_ca_cert: Option<PathBuf>,
    /// Serve HTTPS with this configuration (default: plain HTTP).
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// The listener's limits: first-request deadline, idle time, connections, HTTP/2.
    pub limits: Limits,
    /// Test hook (feature `test-hooks`): after a restart, wait for nothing the process before
    /// passed on (the fault harness's negative control for the restart hold).
    #[cfg(feature = "test-hooks")]
    pub unsafe_no_restart_hold: bool,
}

impl ProxyConfig {
    /// Forwards to `upstream` with the defaults documented on each field.
    pub fn new(upstream: Uri) -> Self {
        Self {
            upstream,
            fence_methods: None,
            require_token: true,
            idempotency: Some(fence_sink::IdempotencyConfig::default()),
            drain_timeout: Duration::from_secs(10),
            store_timeout: Duration::from_secs(5),
            upstream_timeout: Duration::from_secs(60),
            body_timeout: Duration::from_secs(30),
            unknown_outcome_hold: Duration::from_secs(60),
            unknown_outcome_statuses: vec![http::StatusCode::GATEWAY_TIMEOUT],
            unknown_outcome_grpc_statuses: fence_sink::GrpcStatuses::DEFAULT,
            max_buffered_bytes: 256 << 20,
            clock_skew: Duration::from_secs(5),
            forget_after: None,
            max_lease_ttl: Duration::from_secs(24 * 3600),
            upstream_idle_timeout: Duration::from_secs(4),
            preserve_host: false,
            via: true,
            verifier: None,
            workers: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            upstream_ca_cert: None,
            tls: None,
            limits: Limits::default(),
            #[cfg(feature = "test-hooks")]
            unsafe_no_restart_hold: false,
        }
    }

    /// Checks the upstream (and its TLS set-up) before anything listens, so a bad one stops
    /// the proxy before it says it is ready.
    ///
    /// # Errors
    /// When `upstream` is not `http(s)://host[:port][/path]` or its CA file is unusable.
    pub fn check(&self) -> anyhow::Result<()> {
        Target::parse(&self.upstream, self.upstream_ca_cert.as_deref())?;
        if let Some(after) = self.forget_after {
            let limit = self
                .max_lease_ttl
                .saturating_add(self.clock_skew.saturating_mul(2));
            if self.verifier.is_none() {
                anyhow::bail!(fence_sink::ForgetError::Unsigned);
            }
            if after < limit {
                anyhow::bail!(fence_sink::ForgetError::TooSoon {
                    after,
                    max_ttl: self.max_lease_ttl,
                    skew: self.clock_skew,
                });
            }
        }
        Ok(())
    }
}

/// The upstream's address, checked once at start.
pub(super) struct Target {
    pub(super) authority: Authority,
    /// For `https://`: how to connect, and the name the certificate must carry.
    pub(super) tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    /// For `https://`, the same offering only `h2` by ALPN: how gRPC calls connect.
    pub(super) tls_h2: Option<tokio_rustls::TlsConnector>,
    /// `http` or `https`, for the absolute URIs of HTTP/2 requests.
    pub(super) scheme: Scheme,
    /// The `Host` the upstream sees (unless `preserve_host`).
    pub(super) host: HeaderValue,
    /// The upstream's path without a trailing `/` (empty for none), joined before every path.
    prefix: String,
    /// `http(s)://authority/prefix`, for messages.
    pub(super) display: String,
    /// Its answers of unknown outcome (`ProxyConfig::unknown_outcome_statuses`).
    pub(super) unknown_outcome: Vec<http::StatusCode>,
}

impl Target {
    pub(super) fn parse(uri: &Uri, ca_cert: Option<&std::path::Path>) -> anyhow::Result<Self> {
        // What errors show of it: user info and a query (either may hold a secret) never
        // reach a log.
        let mut shown = match uri.authority() {
            Some(authority) if authority.as_str().contains('@') => {
                let host = authority.as_str().rsplit('@').next().unwrap_or_default();
                uri.to_string()
                    .replacen(authority.as_str(), &format!("…@{host}"), 1)
            }
            _ => uri.to_string(),
        };
        if let Some(at) = shown.find('?') {
            shown.replace_range(at.., "?…");
        }
        let Some(scheme) = uri.scheme() else {
            bail!("upstream {shown}: no scheme; write it as http://host:port");
        };
        if *scheme != Scheme::HTTP && *scheme != Scheme::HTTPS {
            bail!(
                "upstream {shown}: only http:// and https:// upstreams are supported, not {scheme}://"
            );
        }
        let Some(authority) = uri.authority() else {
            bail!("upstream {shown}: no host; write it as http://host:port");
        };
        if authority.as_str().contains('@') {
            bail!("upstream {shown}: user info (user:password@) is not supported");
        }
        if authority.host().is_empty() {
            bail!("upstream {shown}: empty host");
        }
        if uri.query().is_some() {
            bail!(
                "upstream {shown}: a query is not supported; give only scheme, host, port and an optional path prefix"
            );
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let host = HeaderValue::from_str(authority.as_str())
            .with_context(|| format!("upstream {shown}: the host is not a valid Host header"))?;
        let (tls, tls_h2) = if *scheme == Scheme::HTTPS {
            let connector = |alpn: &[&[u8]]| {
                fence_storage::tls::client_config(ca_cert, alpn)
                    .map(|config| tokio_rustls::TlsConnector::from(Arc::new(config)))
                    .with_context(|| format!("upstream {shown}: cannot set up TLS"))
            };
            let name = rustls::pki_types::ServerName::try_from(
                authority.host().trim_matches(['[', ']']).to_owned(),
            )
            .with_context(|| format!("upstream {shown}: the host is not a TLS server name"))?;
            (
                Some((connector(&[b"http/1.1"])?, name)),
                Some(connector(&[b"h2"])?),
            )
        } else {
            (None, None)
        };
        Ok(Self {
            authority: authority.clone(),
            tls,
            tls_h2,
            scheme: scheme.clone(),
            host,
            display: format!("{scheme}://{authority}{prefix}"),
            prefix,
            unknown_outcome: Vec::new(),
        })
    }

    /// The same, with `statuses` of its answers taken for unknown outcomes.
    pub(super) fn with_unknown_outcome(mut self, statuses: &[http::StatusCode]) -> Self {
        self.unknown_outcome = statuses.to_vec();
        self
    }

    /// The request target sent upstream for a request to `original`: its path (behind the
    /// prefix) and query, in origin form.
    pub(super) fn uri_for(&self, original: &Uri) -> Result<Uri, http::Error> {
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
