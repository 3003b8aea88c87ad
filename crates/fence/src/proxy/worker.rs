//! One serving thread of the proxy: its own runtime, accept loop and upstream connections.

use std::{
    convert::Infallible,
    future::Future,
    panic::AssertUnwindSafe,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use anyhow::Context as _;
use fence_sink::{Fence, FenceLayer, GenerationStore, IdempotencyStore};
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
};

use crate::listen::{Limits, Listener};
use tower::{Layer, Service};

use super::{
    ProxyBody,
    config::Target,
    conns::UpstreamConns,
    headers::ClientAddr,
    metrics::Outcomes,
    streams::ClientStreams,
    upstream::{Forwarding, Upstream},
};

/// One serving thread of the proxy: a single-threaded runtime with its own accept loop and
/// upstream pool, sharing the fence (and its store) with the other workers.
pub(super) struct Worker<St> {
    pub(super) listener: std::net::TcpListener,
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
    pub(super) limits: Limits,
    /// The proxy's one connection limit, shared with the other workers.
    pub(super) slots: Arc<crate::listen::Slots>,
    pub(super) layer: FenceLayer<St>,
    pub(super) target: Arc<Target>,
    pub(super) timeout: Duration,
    pub(super) idle_timeout: Duration,
    pub(super) preserve_host: bool,
    pub(super) via: bool,
    pub(super) stopped: watch::Receiver<bool>,
    /// This worker's place among those still serving.
    pub(super) serving: Serving,
}

/// How long past its own shutdown deadline a worker waits for the others.
const OTHERS_SLACK: Duration = Duration::from_secs(1);

/// The workers still serving, counted: each holds one `Serving` until its own requests are
/// over. The tasks a worker's runtime runs after its requests (a hold after an unknown
/// outcome, an idempotency record being finished) hold guards of the fence the workers share:
/// dropped with the runtime while another worker still serves, such a guard would let that
/// worker admit a newer token the hold exists to keep back. So a worker that has finished
/// keeps driving its runtime until every worker has (or its deadline has passed).
pub(super) struct Serving(Arc<watch::Sender<usize>>);

impl Serving {
    /// A new count, with nobody serving yet.
    pub(super) fn count() -> Arc<watch::Sender<usize>> {
        Arc::new(watch::Sender::new(0))
    }

    /// One more worker serving, counted in `count` until dropped.
    pub(super) fn join(count: &Arc<watch::Sender<usize>>) -> Self {
        count.send_modify(|n| *n += 1);
        Self(count.clone())
    }

    /// This worker has finished: waits, driving its runtime, until every worker has, or
    /// until `deadline` (plus a second's slack for a worker that finished at its own).
    async fn finished(self, deadline: tokio::time::Instant) {
        let mut all = self.0.subscribe();
        drop(self);
        let _ = tokio::time::timeout_at(deadline + OTHERS_SLACK, all.wait_for(|n| *n == 0)).await;
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl<St: GenerationStore + IdempotencyStore> Worker<St> {
    /// Serves until the proxy stops, then finishes in-flight requests (bounded by
    /// [`SHUTDOWN_GRACE`]).
    pub(super) fn run(self) -> anyhow::Result<()> {
        // Single-threaded, and the upstream connections' tasks on it: the proxy's reading of
        // an HTTP/2 call's failure relies on it (`conns::unprocessed`).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting a proxy worker's runtime")?;
        let served = runtime.block_on(CatchPanic(Box::pin(async move {
            let listener = TcpListener::from_std(self.listener)
                .context("registering the listening socket with a worker's runtime")?;
            // This thread's own upstream connections, served on its runtime: a request
            // and its upstream call never cross threads.
            let conns = Arc::new(UpstreamConns::new(&self.target, self.idle_timeout));
            let proto = if self.tls.is_some() { "https" } else { "http" };
            // The upstream service holds a sender, shared by all its copies (the
            // connections' and each request's own, which lives until its upstream call is
            // over): it is dropped when the connections are closed and the last request has
            // finished.
            let (running, mut finished) = mpsc::channel::<()>(1);
            let fence = self.layer.layer(Upstream::new(Forwarding {
                conns,
                outcomes: Arc::new(Outcomes::new()),
                target: self.target,
                slots: self.slots.clone(),
                timeout: self.timeout,
                preserve_host: self.preserve_host,
                via: self.via,
                proto: http::HeaderValue::from_static(proto),
                _running: running,
            }));
            // A connection whose fenced request got through (the fence admitted it and the
            // upstream answered 2xx, marked by `Upstream`) is closed for room after those that
            // never had one.
            let most_calls = usize::try_from(self.limits.h2_max_streams).unwrap_or(usize::MAX);
            let listener = Listener::new(listener, self.tls, self.limits).sharing(self.slots);
            let (mut stopped, serving) = (self.stopped, self.serving);
            let shutdown = async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            };
            let deadline = crate::listen::serve(listener, shutdown, move |peer, seat| {
                // Every request keeps a share in its connection's seat while it uses an
                // upstream connection, even after its client went away.
                let (fence, client) = (
                    fence.clone(),
                    ClientStreams::new(ClientAddr::new(peer), seat).calls_at_most(most_calls),
                );
                hyper::service::service_fn(move |req: Request<Incoming>| {
                    handle(fence.clone(), client.clone(), peer, req)
                })
            })
            .await;
            if tokio::time::timeout_at(deadline, finished.recv())
                .await
                .is_err()
            {
                tracing::warn!("shutdown grace ran out with upstream requests still running");
            }
            serving.finished(deadline).await;
            Ok(())
        })));
        match served {
            Ok(result) => result,
            Err(_panicked) => {
                // Its runtime still holds the requests in flight on this worker, and with
                // them the fence's record that they run. Unwound, it would drop that record
                // while their upstream calls may still commit, and another worker would
                // admit a newer token at once. So the process ends here, with that record
                // still held: nothing newer is admitted after it, and a restart on disk
                // waits for what may still run (the restart hold).
                say!(
                    "fence proxy: a worker panicked; exiting at once (status 70) so that no newer token is admitted beside its requests in flight"
                );
                std::process::exit(70)
            }
        }
    }
}

/// Polls a future with a panic caught where it happens: the runtime polling it, and the
/// tasks on it, are still there when the caller learns of the panic.
struct CatchPanic<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchPanic<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

/// One request, through the fence to the upstream. The fence runs admitted requests to
/// completion: when a client disconnects (hyper then drops this future) before the upstream
/// answered, the rest of the request goes on in a task of its own, and the fence counts it
/// in flight until then.
async fn handle<St>(
    mut fence: Fence<Upstream, St>,
    client: ClientStreams,
    peer: std::net::SocketAddr,
    mut req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible>
where
    St: GenerationStore + IdempotencyStore,
{
    req.extensions_mut().insert(client);
    req.extensions_mut().insert(fence_sink::PeerAddr(peer));
    // What `ServiceExt::oneshot` does (the service goes once called), without its state
    // machine: the request is not moved into it and out again.
    std::future::poll_fn(|cx| fence.poll_ready(cx)).await?;
    let answer = fence.call(req);
    drop(fence);
    answer.await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic in the worker's own future is caught before its runtime is dropped: the
    /// tasks on it (requests in flight, and the fence's guards of them) are still there.
    #[test]
    fn a_panic_is_caught_with_the_runtime_and_its_tasks_still_there() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let guard = Arc::new(());
        let held = guard.clone();
        let served = runtime.block_on(CatchPanic(Box::pin(async move {
            tokio::spawn(async move {
                let _held = held;
                std::future::pending::<()>().await;
            });
            tokio::task::yield_now().await;
            panic!("the accept loop failed");
        })));
        assert!(served.is_err());
        assert_eq!(Arc::strong_count(&guard), 2, "the task's guard was dropped");
        drop(runtime);
        assert_eq!(Arc::strong_count(&guard), 1);
    }

    /// A worker that finished waits for the others before its runtime (and the holds on it)
    /// goes, and no longer than its deadline for one that never finishes.
    #[tokio::test(start_paused = true)]
    async fn a_finished_worker_waits_for_the_others_within_its_deadline() {
        let count = Serving::count();
        let (first, second) = (Serving::join(&count), Serving::join(&count));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let waiting = tokio::spawn(first.finished(deadline));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "gone while another worker serves");
        drop(second);
        tokio::time::timeout(Duration::from_millis(10), waiting)
            .await
            .expect("free the moment the last worker finished")
            .unwrap();

        // One that never finishes (its thread stuck) is waited for until the deadline only.
        let (first, _stuck) = (Serving::join(&count), Serving::join(&count));
        let started = tokio::time::Instant::now();
        first.finished(started + Duration::from_secs(30)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(30) + OTHERS_SLACK);
    }
}
