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
//! - at most [`Limits::max_connections`] are open, at most
//!   [`Limits::max_connections_per_peer`] from one IP address (see [`Slots`]). At the cap,
//!   newcomers wait in a lobby of up to 64 per accept loop (open files beyond the cap), and
//!   for each an idle connection of the peer that holds the most (its own, or one holding
//!   more than its address will) is closed gracefully, unauthenticated ones first (a
//!   service marks an answer [`Authenticated`]); when every
//!   connection is answering a request, they wait for one to finish. The lobby seats the address that holds the
//!   fewest connections first; when it is full, the newest newcomer of the address that holds
//!   the most is closed unanswered. So a flood's reconnects cannot queue ahead of other
//!   addresses, as they would in the kernel's first-come backlog. A newcomer whose address
//!   holds its own cap with every connection busy is closed at once, as before;
//! - HTTP/2 (h2c by its preface, or ALPN `h2` over TLS) pings every
//!   [`Limits::h2_keepalive`] and closes a peer that does not answer, closes a connection
//!   with no stream open for [`Limits::idle_timeout`], and allows at most
//!   [`Limits::h2_max_streams`] concurrent streams per connection.

mod lobby;
mod marked;
mod progress;
mod slots;

use lobby::{LOBBY, Lobby, Waiting};
use marked::Marked;
use progress::Progress;
use slots::Tracked;
pub use slots::{SeatHold, Slots};

use std::{
    future::Future,
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
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
    sync::{OwnedSemaphorePermit, watch},
    task::JoinSet,
    time::Instant,
};
use tokio_rustls::TlsAcceptor;

/// How often a listener at its cap with newcomers waiting looks for a newly idle connection.
const RECHECK: Duration = Duration::from_millis(100);

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
    /// Open connections from one IP address at most, an IPv4-mapped IPv6 address counted as
    /// its IPv4 address (default: half of `max_connections`).
    pub max_connections_per_peer: usize,
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
            max_connections_per_peer: default_max_connections().div_ceil(2),
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
    slots: Arc<Slots>,
}

/// Put in an answer's extensions by a service that checked the request's credential and
/// found it good: the connection counts as authenticated from then on, and is closed for room
/// after those that never were. A header's mere presence is not enough: anyone can send one.
#[derive(Debug, Clone, Copy)]
pub struct Authenticated;

impl Listener {
    /// Serves `tcp` in plain HTTP, or HTTPS with `tls`, within `limits`.
    pub fn new(tcp: TcpListener, tls: Option<TlsAcceptor>, limits: Limits) -> Self {
        let slots = Slots::new(limits.max_connections, limits.max_connections_per_peer);
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
/// builds for its peer and its share in the connection's slot (kept by what outlives the
/// connection, to keep counting against the cap); then asks every connection to finish
/// gracefully and waits for them up to [`SHUTDOWN_GRACE`]. Returns the grace deadline, for
/// other waits to share.
pub async fn serve<M, S, B>(
    listener: Listener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    mut make: M,
) -> Instant
where
    M: FnMut(SocketAddr, SeatHold) -> S,
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
    let (mut lobby, mut look) = (Lobby::new(LOBBY), true);
    // One timer for the loop: a sleep remade on each pass never fires under steady accepts.
    let mut recheck = tokio::time::interval(RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let door = Door {
        tls,
        limits,
        stopped,
        slots: slots.clone(),
    };
    'serving: loop {
        // Seat whoever waits while there is room: the lightest address first (see `lobby`).
        while !lobby.is_empty() {
            match slots.permits().clone().try_acquire_owned() {
                Ok(permit) => {
                    if let Some((conn, peer)) = door.seat_next(&mut lobby, permit) {
                        let hold = conn.seat.clone();
                        connections.spawn(conn.serve(make(peer, hold)));
                    }
                }
                Err(tokio::sync::TryAcquireError::Closed) => break 'serving,
                Err(tokio::sync::TryAcquireError::NoPermits) => break,
            }
        }
        // At the cap, one idle connection of the address that holds the most is asked to
        // close for each newcomer waiting. A look that found none (a scan under the slots'
        // lock) is repeated when a connection ended, or at the next recheck, not per newcomer.
        look = look && lobby.make_room(&slots);
        let expiry = lobby.first_deadline(limits.header_timeout);
        tokio::select! {
            () = &mut shutdown => break,
            accepted = tcp.accept() => match accepted {
                // Its address holds its cap, all busy: closed at once, as `seat` would.
                Ok((_, peer)) if !slots.could_seat(peer.ip()) => {
                    tracing::debug!(peer = %peer.ip(), "refusing a connection: its address holds its cap (--max-connections-per-peer), all busy");
                }
                Ok((stream, peer)) => {
                    let since = Instant::now();
                    lobby.admit(Waiting { stream, peer, since }, &slots);
                }
                Err(e) => {
                    // Out of file descriptors and the like: free one if a newcomer waits,
                    // and back off instead of spinning.
                    fence_sink::refusals::log_accept_failure(&e);
                    if !lobby.is_empty() {
                        lobby.shed(&slots);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            permit = slots.permits().clone().acquire_owned(), if !lobby.is_empty() => {
                let Ok(permit) = permit else { break };
                if let Some((conn, peer)) = door.seat_next(&mut lobby, permit) {
                    let hold = conn.seat.clone();
                        connections.spawn(conn.serve(make(peer, hold)));
                }
            }
            () = tokio::time::sleep_until(expiry.unwrap_or_else(Instant::now)), if expiry.is_some() => {
                lobby.expire(Instant::now(), limits.header_timeout);
            }
            // Nothing wakes this loop when a busy connection becomes idle: look again.
            _ = recheck.tick(), if !lobby.is_empty() => look = true,
            Some(_) = connections.join_next(), if !connections.is_empty() => look = true,
        }
    }
    drop(tcp);
    drop(lobby); // the newcomers not seated yet: closed unanswered
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

/// What seats a waiting connection: the listener's TLS, limits, slots and stop signal.
struct Door {
    tls: Option<TlsAcceptor>,
    limits: Limits,
    stopped: watch::Receiver<bool>,
    slots: Arc<Slots>,
}

impl Door {
    /// Seats the lobby's next connection on `permit`, with its peer; `None` when the lobby
    /// is empty, or its address holds its cap with every connection busy (it is closed).
    fn seat_next(
        &self,
        lobby: &mut Lobby,
        permit: OwnedSemaphorePermit,
    ) -> Option<(Conn, SocketAddr)> {
        let Waiting {
            stream,
            peer,
            since,
        } = lobby.next(&self.slots)?;
        let Some(seat) = self.slots.seat(peer.ip(), permit) else {
            tracing::debug!(peer = %peer.ip(), "refusing a connection: its address holds its cap (--max-connections-per-peer), all busy");
            return None;
        };
        let conn = Conn {
            stream,
            tls: self.tls.clone(),
            limits: self.limits,
            stop: self.stopped.clone(),
            seat: SeatHold::new(seat),
            since,
        };
        Some((conn, peer))
    }
}

/// One accepted connection.
struct Conn {
    stream: TcpStream,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    stop: watch::Receiver<bool>,
    seat: SeatHold,
    /// When it was accepted: its first-request deadline counts from here.
    since: Instant,
}

/// Resolves at `deadline`, or when the connection is picked to make room.
async fn cut_off(conn: &Tracked, deadline: Instant) {
    tokio::select! {
        () = tokio::time::sleep_until(deadline) => {}
        () = conn.evict.notified() => tracing::debug!("closing a connection with no request yet to make room"),
    }
}

/// The HTTP/2 client preface: a plain-text connection that starts with it speaks h2c.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The most hyper buffers of an HTTP/1.1 request head not yet complete: past it, 431 (it
/// checks between reads, so a head that comes at once may pass up to about twice this). hyper's default, some 400 KiB, let each of thousands of connections
/// hold that much while it trickled a head; an HTTP/2 client's header list is capped lower
/// still (16 KiB), and nginx's at 32 KiB.
const MAX_HEAD: usize = 64 << 10;

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
            seat,
            since,
        } = self;
        let _ = stream.set_nodelay(true);
        let peer = stream.peer_addr();
        let deadline = since + limits.header_timeout;
        let Some(fresh) = seat.conn().cloned() else {
            return; // every seated connection has one
        };
        // A request head has arrived once the service is first called.
        let service = Marked {
            inner: service,
            conn: fresh.clone(),
        };
        match tls {
            Some(acceptor) => {
                let stream = tokio::select! {
                    accepted = acceptor.accept(stream) => match accepted {
                        Ok(stream) => stream,
                        // A failed handshake: nothing to answer, but the operator hears of it.
                        Err(e) => {
                            if let Ok(peer) = peer {
                                fence_sink::refusals::log_handshake_failure(peer, &e);
                            }
                            return;
                        }
                    },
                    () = cut_off(&fresh, deadline) => return,
                };
                let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2".as_slice());
                drive(stream, h2, service, limits, deadline, &fresh, stop).await;
            }
            None => {
                let h2 = tokio::select! {
                    h2 = speaks_h2c(&stream) => match h2 {
                        Some(h2) => h2,
                        None => return, // gone
                    },
                    () = cut_off(&fresh, deadline) => return, // silent until the deadline
                };
                drive(stream, h2, service, limits, deadline, &fresh, stop).await;
            }
        }
        seat.closed();
    }
}

/// Whether a plain-text connection opens with the HTTP/2 preface; `None` when it closes
/// before saying enough to tell.
async fn speaks_h2c(stream: &TcpStream) -> Option<bool> {
    let mut buf = [0u8; H2_PREFACE.len()];
    let mut pause = Duration::from_millis(1);
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
        // A partial preface: wait for more. Not for readiness, which the bytes already there
        // keep set (`peek` does not clear it): the loop would spin a worker's thread until
        // the header deadline. A pause growing to 50 ms costs a client that really splits
        // its preface a few milliseconds.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
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
    tracked: &Arc<Tracked>,
    mut stop: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: ConnService<B>,
    B: ConnBody,
{
    let io = TokioIo::new(Progress {
        io,
        conn: tracked.clone(),
    });
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
            .max_buf_size(MAX_HEAD)
            .keep_alive(true);
        Box::pin(builder.serve_connection(io, service))
    };
    let first_head = async {
        tokio::time::sleep_until(deadline).await;
        if tracked.asked.load(Ordering::Acquire) {
            std::future::pending::<()>().await; // in time: no more deadline
        }
    };
    let idle = async {
        if !h2 {
            std::future::pending::<()>().await; // hyper's header timeout covers HTTP/1.1
        }
        idle_for(tracked, limits.idle_timeout).await;
    };
    let result = tokio::select! {
        result = conn.as_mut() => result,
        () = first_head => {
            tracing::debug!("closing a connection that sent no request head in time");
            return;
        }
        () = tracked.evict.notified() => {
            if !tracked.asked.load(Ordering::Acquire) {
                return; // nothing asked, nothing to finish
            }
            conn.as_mut().shut_down();
            // What it still runs or writes out gets the shutdown grace, unless its client
            // stops reading: stuck in hyper's write, such a connection would keep the seat
            // for the whole grace, past the deadline of the newcomer it was closed for.
            tokio::select! {
                result = tokio::time::timeout(SHUTDOWN_GRACE, conn.as_mut()) => {
                    result.unwrap_or(Ok(()))
                }
                // Half the newcomer's first-request deadline: the kernel wakes a writer only
                // once a third of the socket's buffer is free again, so a client that reads,
                // slowly, can leave a write waiting for a while; one that does not read
                // never frees it.
                () = unread_for(|| tracked.unread_for(), (limits.header_timeout / 2).max(UNREAD_AT_LEAST)) => {
                    tracing::debug!("closing a connection picked to make room: its client does not read");
                    Ok(())
                }
            }
        }
        // A client that takes in nothing of what it is sent keeps its seat, the answer's
        // producer (an upstream connection and its handler) and the memory of both, for as
        // long as it likes, at the cap or not: closed once a write has waited the idle
        // timeout for it (nginx's `send_timeout`).
        () = unread_for(|| tracked.socket_unread_for(), limits.idle_timeout) => {
            tracing::debug!("closing a connection whose client read nothing it was sent for the idle timeout");
            return;
        }
        () = idle => {
            tracing::debug!("closing an HTTP/2 connection with no stream open for the idle timeout");
            conn.as_mut().shut_down();
            tokio::time::timeout(SHUTDOWN_GRACE, conn).await.unwrap_or(Ok(()))
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

/// The least time a connection picked to make room may wait for its client to read.
const UNREAD_AT_LEAST: Duration = Duration::from_millis(100);

/// Resolves once `stalled` (how long the connection has waited for its client to read, if
/// it waits: [`Tracked::unread_for`], or [`Tracked::socket_unread_for`] for the socket
/// alone) reaches `limit`.
async fn unread_for(stalled: impl Fn() -> Option<Duration>, limit: Duration) {
    loop {
        let wait = match stalled() {
            Some(stalled) if stalled >= limit => return,
            Some(stalled) => limit - stalled,
            None => limit,
        };
        tokio::time::sleep(wait).await;
    }
}

/// Resolves once `conn` has had no request running for `idle`.
async fn idle_for(conn: &Tracked, idle: Duration) {
    loop {
        match conn.idle_since() {
            Some(since) if since + idle <= Instant::now() => return,
            Some(since) => tokio::time::sleep_until(since + idle).await,
            None => tokio::time::sleep(idle).await,
        }
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
