//! Accept loops: serve each connection until shutdown, then let it finish, within a grace.

use std::{future::Future, net::SocketAddr, time::Duration};

use fence_storage::BoxError;
use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::conn::auto,
};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinSet,
    time::Instant,
};

use super::SHUTDOWN_GRACE;

/// Accepts connections until `shutdown` resolves, serving each with the service `make`
/// builds for its peer; then asks every connection to finish gracefully and waits for them
/// up to [`SHUTDOWN_GRACE`]. Returns the grace deadline, for other waits to share.
pub(super) async fn accept_loop<M, S, B>(
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
