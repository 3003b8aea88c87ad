//! Listeners that hold up under abuse: TLS, a first-request deadline, idle and connection caps.
//!
//! Every listener of `fence` (the lease server, the proxy, the proxy's admin port) accepts
//! through [`serve`]:
//! - a connection has [`Limits::header_timeout`] from accept to send its first request head,
//!   TLS handshake included, whatever protocol it speaks; one that sends nothing, or one byte
//!   a second, is closed then;
//! - later request heads of a kept-alive HTTP/1.1 connection must arrive within
//!   [`Limits::idle_timeout`] of the previous answer (hyper counts the idle wait and the
//!   header read as one);
//! - at most [`Limits::max_connections`] are open; beyond, new connections wait in the
//!   kernel's backlog while established ones (a worker's kept-alive renewals) go on;
//! - HTTP/2 (h2c by its preface, or ALPN `h2` over TLS) pings every
//!   [`Limits::h2_keepalive`] and closes a peer that does not answer, and allows at most
//!   [`Limits::h2_max_streams`] concurrent streams per connection.

use std::{
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use fence_storage::BoxError;
use http::{Request, Response};
use hyper::{
    body::{Body, Incoming},
    server::conn::{http1, http2},
};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, watch},
    task::JoinSet,
    time::Instant,
};
use tokio_rustls::TlsAcceptor;

/// How long in-flight connections and requests may take to finish after shutdown begins.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// The limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From accept to a connection's first complete request head (default 10 s).
    pub header_timeout: Duration,
    /// From an answer to the next request head on a kept-alive connection (default 60 s).
    pub idle_timeout: Duration,
    /// Open connections at most (default: 10,000, or what the file limit leaves room for).
    pub max_connections: usize,
    /// Concurrent HTTP/2 streams per connection at most (default 100).
    pub h2_max_streams: u32,
    /// HTTP/2 keepalive ping interval; a peer silent for as long again is closed (default
    /// 20 s).
    pub h2_keepalive: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_connections: default_max_connections(),
            h2_max_streams: 100,
            h2_keepalive: Duration::from_secs(20),
        }
    }
}

/// 10,000 connections, or fewer when the process's file limit is lower: room is left for
/// the store, upstream connections and logs, so a flood of clients cannot starve them.
pub fn default_max_connections() -> usize {
    let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(1024, |(soft, _)| soft);
    let room = usize::try_from(soft).unwrap_or(usize::MAX);
    (room.saturating_sub(64) / 2).clamp(16, 10_000)
}

/// A bound socket, with TLS or without, and its limits.
pub struct Listener {
    tcp: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    permits: Arc<Semaphore>,
}

impl Listener {
    /// Serves `tcp` in plain HTTP, or HTTPS with `tls`, within `limits`.
    pub fn new(tcp: TcpListener, tls: Option<TlsAcceptor>, limits: Limits) -> Self {
        let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        Self {
            tcp,
            tls,
            limits,
            permits,
        }
    }

    /// Counts its connections against `permits`, shared with other listeners (the workers
    /// of one proxy, on one socket).
    pub fn sharing(mut self, permits: Arc<Semaphore>) -> Self {
        self.permits = permits;
        self
    }

    /// The address it listens on.
    ///
    /// # Errors
    /// When the socket cannot tell.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// `https` or `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

/// What a connection needs from the service that serves it (hyper's bounds).
pub trait ConnService<B>:
    hyper::service::Service<
        Request<Incoming>,
        Response = Response<B>,
        Future: Send + 'static,
        Error: Into<BoxError>,
    > + Clone
    + Send
    + 'static
{
}

impl<S, B> ConnService<B> for S where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<B>,
            Future: Send + 'static,
            Error: Into<BoxError>,
        > + Clone
        + Send
        + 'static
{
}

/// What an answer's body needs to be written by hyper.
pub trait ConnBody: Body<Data: Send, Error: Into<BoxError>> + Send + 'static {}

impl<B> ConnBody for B where B: Body<Data: Send, Error: Into<BoxError>> + Send + 'static {}

/// Accepts connections until `shutdown` resolves, serving each with the service `make`
/// builds for its peer; then asks every connection to finish gracefully and waits for them
/// up to [`SHUTDOWN_GRACE`]. Returns the grace deadline, for other waits to share.
pub async fn serve<M, S, B>(
    listener: Listener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut make: M,
) -> Instant
where
    M: FnMut(SocketAddr) -> S,
    S: ConnService<B>,
    B: ConnBody,
{
    let Listener {
        tcp,
        tls,
        limits,
        permits,
    } = listener;
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // At the connection limit, wait for one to close before accepting another: the
        // kernel's backlog holds newcomers, established connections are not disturbed.
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        tokio::select! {
            () = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => {
                    let conn = Conn {
                        stream,
                        tls: tls.clone(),
                        limits,
                        stop: stopped.clone(),
                    };
                    let service = make(peer);
                    connections.spawn(async move {
                        conn.serve(service).await;
                        drop(permit);
                    });
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
    drop(tcp);
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

/// One accepted connection.
struct Conn {
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    stop: watch::Receiver<bool>,
}

/// The HTTP/2 client preface: a plain-text connection that starts with it speaks h2c.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl Conn {
    async fn serve<S, B>(self, service: S)
    where
        S: ConnService<B>,
        B: ConnBody,
    {
        let Self {
            stream,
            tls,
            limits,
            stop,
        } = self;
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + limits.header_timeout;
        // A request head has arrived once the service is first called.
        let asked = Arc::new(AtomicBool::new(false));
        let service = Marked {
            inner: service,
            asked: asked.clone(),
        };
        match tls {
            Some(acceptor) => {
                let Ok(Ok(stream)) =
                    tokio::time::timeout_at(deadline, acceptor.accept(stream)).await
                else {
                    return; // no handshake in time, or a failed one: nothing to answer
                };
                let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                drive(stream, h2, service, limits, deadline, asked, stop).await;
            }
            None => {
                let Ok(Some(h2)) = tokio::time::timeout_at(deadline, speaks_h2c(&stream)).await
                else {
                    return; // silent until the deadline, or gone
                };
                drive(stream, h2, service, limits, deadline, asked, stop).await;
            }
        }
    }
}

/// Whether a plain-text connection opens with the HTTP/2 preface; `None` when it closes
/// before saying enough to tell.
async fn speaks_h2c(stream: &TcpStream) -> Option<bool> {
    let mut buf = [0u8; H2_PREFACE.len()];
    loop {
        let n = stream.peek(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        if buf[..n] != H2_PREFACE[..n] {
            return Some(false);
        }
        if n == H2_PREFACE.len() {
            return Some(true);
        }
        // A partial preface: wait for more (peek returns at once while bytes are there).
        stream.readable().await.ok()?;
        tokio::task::yield_now().await;
    }
}

/// Serves one connection with hyper; closes it when its first request head is not complete
/// by `deadline`, and lets it finish gracefully on shutdown.
async fn drive<I, S, B>(
    io: I,
    h2: bool,
    service: Marked<S>,
    limits: Limits,
    deadline: Instant,
    asked: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: ConnService<B>,
    B: ConnBody,
{
    let io = TokioIo::new(io);
    let mut conn: std::pin::Pin<Box<dyn Connection>> = if h2 {
        let mut builder = http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(limits.h2_keepalive)
            .keep_alive_timeout(limits.h2_keepalive)
            .max_concurrent_streams(limits.h2_max_streams);
        Box::pin(builder.serve_connection(io, service))
    } else {
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.idle_timeout)
            .keep_alive(true);
        Box::pin(builder.serve_connection(io, service))
    };
    let first_head = async {
        tokio::time::sleep_until(deadline).await;
        if asked.load(Ordering::Acquire) {
            std::future::pending::<()>().await; // in time: no more deadline
        }
    };
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = first_head => {
            tracing::debug!("closing a connection that sent no request head in time");
            return;
        }
        () = async {
            // The guard `wait_for` returns must not live across the await below.
            let _ = stop.wait_for(|stop| *stop).await;
        } => {
            conn.as_mut().shut_down();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// A served HTTP/1 or HTTP/2 connection, as one type.
trait Connection: Future<Output = Result<(), hyper::Error>> + Send {
    fn shut_down(self: std::pin::Pin<&mut Self>);
}

impl<I, S, B> Connection for http1::Connection<I, S>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Send,
    S::Future: Send,
    B: ConnBody,
{
    fn shut_down(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

impl<I, S, B> Connection for http2::Connection<I, S, TokioExecutor>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::HttpService<Incoming, ResBody = B> + Send,
    S::Future: Send + 'static,
    B: ConnBody,
{
    fn shut_down(self: std::pin::Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// The service of a connection, marking that a request head arrived.
#[derive(Clone)]
struct Marked<S> {
    inner: S,
    asked: Arc<AtomicBool>,
}

impl<S, R> hyper::service::Service<R> for Marked<S>
where
    S: hyper::service::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, req: R) -> Self::Future {
        self.asked.store(true, Ordering::Release);
        self.inner.call(req)
    }
}
