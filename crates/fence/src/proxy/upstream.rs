//! The fence's inner service: forwards a request upstream, answers 502/504 when it fails.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use fence_core::{Problem, ProblemType};
use fence_sink::RequestBody;
use fence_storage::error_chain;
use http::{Method, Request, Response};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use tokio::{sync::mpsc, time::Instant};
use tower::Service;

use super::{
    config::Target,
    conns::{SendFailed, UpstreamConns},
    failure::how_it_failed,
    headers::{self, strip_hop_by_hop},
    metrics::Outcomes,
    streams::{ClientStreams, Held},
};

/// The body of an upstream answer as the fence sees it: the upstream's own, or a problem.
pub(super) type UpstreamBody = Either<Held<Incoming>, Full<Bytes>>;

/// The inner service of the fence: forwards a request to the upstream over the worker's
/// connections and answers 502/504 problems when the upstream fails or is too slow.
///
/// One allocation shared by its copies: each request clones it three times on its way in
/// (its connection's, the fence's, its own), one reference count each.
#[derive(Clone)]
pub(super) struct Upstream(Arc<Forwarding>);

impl Upstream {
    pub(super) fn new(forwarding: Forwarding) -> Self {
        Self(Arc::new(forwarding))
    }
}

impl std::ops::Deref for Upstream {
    type Target = Forwarding;

    fn deref(&self) -> &Forwarding {
        &self.0
    }
}

/// What [`Upstream`] forwards with.
pub(super) struct Forwarding {
    pub(super) conns: Arc<UpstreamConns>,
    pub(super) outcomes: Arc<Outcomes>,
    pub(super) target: Arc<Target>,
    /// The proxy's connection cap, which an HTTP/2 client's concurrent streams count
    /// against (see [`super::streams`]).
    pub(super) slots: Arc<crate::listen::Slots>,
    pub(super) timeout: Duration,
    pub(super) preserve_host: bool,
    /// Whether to append `Via`.
    pub(super) via: bool,
    /// `X-Forwarded-Proto`: how the client reached the proxy.
    pub(super) proto: http::HeaderValue,
    /// Counts the service for graceful shutdown, as long as a copy of it lives (see
    /// `Worker::run`).
    pub(super) _running: mpsc::Sender<()>,
}

impl Service<Request<RequestBody<Incoming>>> for Upstream {
    type Response = Response<UpstreamBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<RequestBody<Incoming>>) -> Self::Future {
        Box::pin(Forwarded {
            forward: self.clone().forward(req),
        })
    }
}

pin_project_lite::pin_project! {
    /// `forward`'s future with its answer as the service's `Ok`. Not an async block around
    /// it: the block's state would take the forward future in with one more copy of it.
    struct Forwarded<F> {
        #[pin]
        forward: F,
    }
}

impl<F: Future<Output = Response<UpstreamBody>>> Future for Forwarded<F> {
    type Output = Result<Response<UpstreamBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().forward.poll(cx).map(Ok)
    }
}

impl Upstream {
    async fn forward(self, req: Request<RequestBody<Incoming>>) -> Response<UpstreamBody> {
        let started = Instant::now();
        let (mut parts, body) = req.into_parts();
        // An HTTP/2 client may have several requests going upstream at once.
        let several = parts.version == http::Version::HTTP_2;
        // Admitted by the fence (a signed token verified, with --verify-key): its connection
        // counts as authenticated once the upstream accepts it. Not a mere X-Fencing-Token
        // header on a request the fence never judged (a GET).
        let admitted = parts.extensions.get::<fence_sink::Fenced>().is_some();
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
                        "the request target {} cannot be forwarded upstream: {e}",
                        parts.uri
                    ),
                ));
            }
        };
        let streams = parts.extensions.remove::<ClientStreams>();
        let client = streams.as_ref().map(|s| &s.addr);
        headers::to_upstream(
            &mut parts,
            (uri, client),
            &self.target,
            self.preserve_host,
            self.via,
        );
        parts
            .headers
            .insert(headers::X_FORWARDED_PROTO, self.proto.clone());

        // A gRPC call goes to the upstream over HTTP/2 (gRPC-Web, over HTTP/1.1, is not).
        let grpc = fence_sink::is_grpc(&parts.headers);
        // For a gRPC call: its client connection (whose upstream HTTP/2 connection it uses,
        // and whose share of the connection cap that takes, should it have to be opened).
        // Cloned for gRPC only: nothing more per request on the HTTP/1.1 path.
        let h2_client = if grpc { streams.clone() } else { None };
        let h2_slot = h2_client.as_ref().map(|s| s.h2.clone());
        if grpc && let Err(e) = self.as_h2(&mut parts) {
            self.outcomes.bad_target.record(started);
            return problem(Problem::new(
                ProblemType::BadRequest,
                format!("the gRPC call cannot be forwarded upstream: {e}"),
            ));
        }
        // Taken before anything is sent and outside the upstream timeout: a refusal here is
        // a known outcome, and no wait for room can run into that timeout. A gRPC call takes
        // no slot, but counts among its connection's calls running upstream (see
        // `ClientStreams::enter_call`).
        let entered = streams.map(|streams| {
            if grpc {
                streams.enter_call()
            } else {
                streams.enter(&self.slots, several)
            }
        });
        let using = match entered {
            None => None,
            Some(Some(using)) => Some(using),
            Some(None) => {
                self.outcomes.overloaded.record(started);
                tracing::debug!("refusing a stream: no room for another upstream request");
                let mut response = problem(Problem::new(
                    ProblemType::Overloaded,
                    if grpc {
                        "not sent upstream: this connection already has --h2-max-streams \
                         gRPC calls running there (calls its client reset included, \
                         which run to their end); retry once some have ended"
                    } else {
                        "not sent upstream: this HTTP/2 connection already has a request \
                         in flight there, and the proxy has no room for another upstream \
                         connection (each stream beyond one in flight at a time counts \
                         against --max-connections); retry, or send fewer requests at \
                         once on one connection"
                    },
                ));
                response.headers_mut().insert(
                    http::header::RETRY_AFTER,
                    http::HeaderValue::from_static("1"),
                );
                return if grpc {
                    grpc_problem(response)
                } else {
                    response
                };
            }
        };
        let request = Request::from_parts(parts, body);
        // The HTTP/2 connection a gRPC call went out on (none yet: u64::MAX).
        let used = std::sync::atomic::AtomicU64::new(u64::MAX);
        let sent = if grpc {
            // Boxed, like connecting: the HTTP/1.1 path's future stays small (issue 32).
            let slots = &self.slots;
            let hold = move || -> Option<super::conns::Hold> {
                match &h2_client {
                    Some(client) => Some(Arc::new(client.clone().enter(slots, true)?)),
                    None => Some(Arc::new(())),
                }
            };
            let call = Box::pin(
                self.conns
                    .send_h2(request, h2_slot.as_deref(), &hold, &used),
            );
            tokio::time::timeout(self.timeout, call).await
        } else {
            tokio::time::timeout(self.timeout, self.conns.send(request)).await
        };
        let response = match sent {
            Ok(Ok(response)) => {
                self.outcomes.ok.record(started);
                let (mut head, body) = response.into_parts();
                strip_hop_by_hop(&mut head.headers, false);
                if admitted && head.status.is_success() {
                    head.extensions.insert(crate::listen::Authenticated);
                }
                if self.target.unknown_outcome.contains(&head.status) {
                    // A gateway in front of the service gave up on it (504) or lost it
                    // (502): the service may still be acting on the request.
                    tracing::debug!(status = %head.status, "the upstream's answer leaves its outcome unknown");
                    head.extensions.insert(fence_sink::OutcomeUnknown);
                }
                Response::from_parts(head, Either::Left(Held::new(body, using)))
            }
            Ok(Err(failed)) => {
                self.outcomes.unavailable.record(started);
                let (cause, how, maybe_seen) = match &failed {
                    SendFailed::Connect(e) => {
                        (error_chain(e.as_ref()), how_it_failed(e.as_ref()), false)
                    }
                    // The client's body failed (cut at the body deadline, or the client went
                    // away mid-body): the upstream saw the head and a prefix of the body,
                    // never a whole request, and the connection is closed without
                    // completing it. Not an unknown outcome.
                    SendFailed::Request(e) if client_body_failed(e) => (
                        error_chain(e),
                        "the request's body did not arrive whole (it timed out, or the client went away)",
                        false,
                    ),
                    SendFailed::Request(e) => (error_chain(e), how_it_failed(e), true),
                };
                fence_sink::refusals::log_upstream_failure(&self.target.display, &cause);
                // The error's text stays in the log: it may name the upstream (a
                // certificate's names, a host), and clients are not told the proxy's inner
                // topology; the answer says only how it failed.
                let mut response = problem(Problem::new(
                    ProblemType::UpstreamUnavailable,
                    format!("the upstream failed: {how}"),
                ));
                if maybe_seen {
                    // The request may have reached the upstream before the failure.
                    response.extensions_mut().insert(fence_sink::OutcomeUnknown);
                }
                response
            }
            Err(_) => {
                // Dropping the request future closes its upstream HTTP/1.1 connection; an
                // HTTP/2 one, shared by its client connection's calls, takes no new call
                // from now on.
                if grpc {
                    self.conns.retire_h2(
                        h2_slot.as_deref(),
                        used.load(std::sync::atomic::Ordering::Relaxed),
                    );
                }
                self.outcomes.timeout.record(started);
                fence_sink::refusals::log_upstream_failure(
                    &self.target.display,
                    &format_args!("no answer within {:?}", self.timeout),
                );
                let mut response = problem(Problem::new(
                    ProblemType::UpstreamTimeout,
                    format!(
                        "the upstream did not answer within {:?}; its connection was closed, and whether the request took effect there is unknown",
                        self.timeout
                    ),
                ));
                response.extensions_mut().insert(fence_sink::OutcomeUnknown);
                response
            }
        };
        if grpc {
            grpc_problem(response)
        } else {
            response
        }
    }
}

/// The proxy's own problem answered to a gRPC client the gRPC way (contract section 9): see
/// [`Problem::to_grpc_head`]. Answers of the upstream pass unchanged.
fn grpc_problem(response: Response<UpstreamBody>) -> Response<UpstreamBody> {
    let (mut head, body) = response.into_parts();
    let Some(problem) = head.extensions.remove::<Problem>() else {
        return Response::from_parts(head, body);
    };
    problem.to_grpc_head(&mut head.status, &mut head.headers);
    Response::from_parts(head, Either::Right(Full::new(Bytes::new())))
}

impl Upstream {
    /// Turns an upstream request made for HTTP/1.1 into one for HTTP/2: an absolute URI whose
    /// authority is the `Host` it would have carried, no `Host` header, and `te: trailers`,
    /// which gRPC servers expect and HTTP/2 allows.
    fn as_h2(&self, parts: &mut http::request::Parts) -> Result<(), http::Error> {
        let host = parts
            .headers
            .remove(http::header::HOST)
            .unwrap_or_else(|| self.target.host.clone());
        let authority = http::uri::Authority::try_from(host.as_bytes())?;
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        parts.uri = http::Uri::builder()
            .scheme(self.target.scheme.clone())
            .authority(authority)
            .path_and_query(path)
            .build()?;
        parts.version = http::Version::HTTP_2;
        parts
            .headers
            .insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        Ok(())
    }
}

/// Whether `e` came from the request body on our side (the client's body failed, or the
/// fence cut it at the body deadline) rather than from the upstream or the connection.
fn client_body_failed(e: &hyper::Error) -> bool {
    if e.is_user() {
        return true;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if err.is::<fence_sink::BodyTimeout>() {
            return true;
        }
        source = err.source();
    }
    false
}

/// The proxy's own problem; the problem stays in its extensions for [`grpc_problem`].
fn problem(p: Problem) -> Response<UpstreamBody> {
    let mut response = p.to_response::<Full<Bytes>>().map(Either::Right);
    response.extensions_mut().insert(p);
    response
}
