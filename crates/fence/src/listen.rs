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
//! - at most [`Limits::max_connections`] are open. At the cap, a newcomer takes the place of
//!   the oldest connection that has not sent a request head yet (an idle flood cannot queue
//!   ahead of real clients, who send theirs at once); when every connection has asked for
//!   something, newcomers wait in the kernel's backlog. Established connections (a worker's
//!   kept-alive renewals) are never closed for room;
//! - HTTP/2 (h2c by its preface, or ALPN `h2` over TLS) pings every
//!   [`Limits::h2_keepalive`] and closes a peer that does not answer, and allows at most
//!   [`Limits::h2_max_streams`] concurrent streams per connection.

use std::{
    collections::VecDeque,
    future::Future,
    net::SocketAddr,
    sync::{
        Arc, Mutex, Weak,
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

/// The connections a listener (or several, sharing a socket) may hold, and those among them
/// that have not sent a request head yet, oldest first: the ones to close for room.
#[derive(Debug)]
pub struct Slots {
    permits: Arc<Semaphore>,
    fresh: Mutex<VecDeque<Weak<Fresh>>>,
    max: usize,
}

/// A connection until its first request head: closed early if a newcomer needs its slot.
#[derive(Debug, Default)]
struct Fresh {
    asked: AtomicBool,
    evict: tokio::sync::Notify,
}

impl Fresh {
    /// Resolves at `deadline`, or when the connection is picked to make room.
    async fn cut_off(&self, deadline: Instant) {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {}
            () = self.evict.notified() => tracing::debug!("closing a connection with no request yet to make room"),
        }
    }
}

impl Slots {
    /// Room for `max` connections (at least 1).
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max)),
            fresh: Mutex::default(),
            max,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Weak<Fresh>>> {
        self.fresh
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Lists a new connection as one to close first for room, until it asks for something.
    fn register(&self, fresh: &Arc<Fresh>) {
        let mut list = self.lock();
        list.push_back(Arc::downgrade(fresh));
        if list.len() > 2 * self.max + 64 {
            // Connections that asked or ended stay listed until here: now and then, drop them.
            list.retain(|w| {
                w.upgrade()
                    .is_some_and(|f| !f.asked.load(Ordering::Acquire))
            });
        }
    }

    /// Asks the oldest connection that has not sent a request head yet to close; false when
    /// there is none.
    fn evict_one(&self) -> bool {
        let mut list = self.lock();
        while let Some(weak) = list.pop_front() {
            if let Some(fresh) = weak.upgrade()
                && !fresh.asked.load(Ordering::Acquire)
            {
                fresh.evict.notify_one();
                return true;
            }
        }
        false
    }
}

/// A bound socket, with TLS or without, and its limits.
pub struct Listener {
    tcp: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    slots: Arc<Slots>,
}

impl Listener {
    /// Serves `tcp` in plain HTTP, or HTTPS with `tls`, within `limits`.
    pub fn new(tcp: TcpListener, tls: Option<TlsAcceptor>, limits: Limits) -> Self {
        let slots = Slots::new(limits.max_connections);
        Self {
            tcp,
            tls,
            limits,
            slots,
        }
    }

    /// Counts its connections against `slots`, shared with other listeners (the workers of
    /// one proxy, on one socket).
    pub fn sharing(mut self, slots: Arc<Slots>) -> Self {
        self.slots = slots;
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
        slots,
    } = listener;
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // At the connection limit, close the oldest connection that has not asked for
        // anything yet, and wait for a slot: the kernel's backlog holds newcomers meanwhile,
        // and connections that asked for something are not disturbed.
        let permit = match slots.permits.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(tokio::sync::TryAcquireError::Closed) => break,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                slots.evict_one();
                tokio::select! {
                    () = &mut shutdown => break,
                    permit = slots.permits.clone().acquire_owned() => match permit {
                        Ok(permit) => permit,
                        Err(_) => break,
                    },
                    Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                }
            }
        };
        tokio::select! {
            () = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                Ok((stream, peer)) => {
                    let fresh = Arc::new(Fresh::default());
                    slots.register(&fresh);
                    let conn = Conn {
                        stream,
                        tls: tls.clone(),
                        limits,
                        stop: stopped.clone(),
                        fresh,
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
    fresh: Arc<Fresh>,
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
            fresh,
        } = self;
        let _ = stream.set_nodelay(true);
        let deadline = Instant::now() + limits.header_timeout;
        // A request head has arrived once the service is first called.
        let service = Marked {
            inner: service,
            fresh: fresh.clone(),
        };
        match tls {
            Some(acceptor) => {
                let stream = tokio::select! {
                    accepted = acceptor.accept(stream) => match accepted {
                        Ok(stream) => stream,
                        Err(_) => return, // a failed handshake: nothing to answer
                    },
                    () = fresh.cut_off(deadline) => return,
                };
                let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                drive(stream, h2, service, limits, deadline, fresh, stop).await;
            }
            None => {
                let h2 = tokio::select! {
                    h2 = speaks_h2c(&stream) => match h2 {
                        Some(h2) => h2,
                        None => return, // gone
                    },
                    () = fresh.cut_off(deadline) => return, // silent until the deadline
                };
                drive(stream, h2, service, limits, deadline, fresh, stop).await;
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
    fresh: Arc<Fresh>,
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
        fresh.cut_off(deadline).await;
        if fresh.asked.load(Ordering::Acquire) {
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
    fresh: Arc<Fresh>,
}

impl<S, R> hyper::service::Service<R> for Marked<S>
where
    S: hyper::service::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, req: R) -> Self::Future {
        self.fresh.asked.store(true, Ordering::Release);
        self.inner.call(req)
    }
}
