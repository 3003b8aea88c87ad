//! Connections from one worker thread to the upstream: HTTP/1.1 kept alive, HTTP/2 for gRPC.

use std::{sync::Arc, time::Duration};

use fence_sink::RequestBody;
use fence_storage::BoxError;
use http::{Request, Response};
use hyper::{
    body::Incoming,
    client::conn::{http1::SendRequest, http2},
};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpStream, time::Instant};

use super::config::Target;

/// Keep-alive HTTP/1.1 connections from one worker thread to the upstream.
///
/// A request takes a connection that is ready for one (not closed, no response still
/// streaming on it), or opens a new one, and puts it back as soon as the response head
/// arrived: it is ready again once that response's body has been read. A kept-alive
/// connection the upstream closed just before the request went out hands the request
/// back untouched (hyper's `try_send_request`), and it is tried on another connection.
pub(super) struct UpstreamConns {
    /// `host:port` to connect to.
    addr: String,
    /// TLS to an `https://` upstream: the connector and the name its certificate must have.
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls::pki_types::ServerName<'static>,
    )>,
    idle: std::sync::Mutex<Vec<Idle>>,
    idle_timeout: Duration,
    /// For `https://`: TLS offering `h2`, for the HTTP/2 connection.
    tls_h2: Option<tokio_rustls::TlsConnector>,
    /// The HTTP/2 connection of calls that come with no client connection's own
    /// ([`H2Slot`]).
    h2: H2Slot,
    /// How many HTTP/2 connections this worker has opened.
    h2_opened: std::sync::atomic::AtomicU64,
}

/// An HTTP/2 connection to the upstream, opened by the first gRPC call that uses it and
/// shared by every call after it (HTTP/2 multiplexes); opened again once it has closed. With
/// it, whether the upstream has spoken HTTP/2 on it, and its number (counted per worker), by
/// which a call that timed out on it retires it ([`UpstreamConns::retire_h2`]).
///
/// Each client connection has its own ([`ClientStreams`](super::streams::ClientStreams)),
/// closed when the client connection and its calls are done. Until this version a worker's
/// calls all shared one: a client that stopped reading its answers (its HTTP/2 receive window
/// at 0) let their unread data fill that connection's flow-control window upstream, and
/// every other client's answers on the worker, for every job, stopped until the proxy closed
/// the idle client (an audit: three calls of one client held every other job's gRPC answers
/// 60 to 88 s, and a client reconnecting kept it up). Now a client that does not read holds
/// only its own calls.
#[derive(Default)]
pub(super) struct H2Slot(tokio::sync::Mutex<Option<H2Conn>>);

/// An HTTP/2 connection to the upstream: the handle calls are sent on, whether the upstream
/// has spoken HTTP/2 on it, its number, and what it holds of the proxy's connection cap while
/// any call or its client connection keeps it (see [`Hold`]).
type H2Conn = (
    http2::SendRequest<RequestBody<Incoming>>,
    Preface,
    u64,
    Option<Hold>,
);

/// A client connection's share of the proxy's connection cap, held by its upstream HTTP/2
/// connection: the client's seat covers one upstream connection, and this one counts as one
/// of its requests using an upstream connection, so that an HTTP/1.1 request of the same
/// client at the same time takes a slot of the cap (and the other way round). Without it, a
/// review counted three file descriptors per seat where the cap allows two (`EMFILE` for
/// every job near the cap).
pub(super) type Hold = Arc<dyn std::any::Any + Send + Sync>;

/// The flow-control windows of an upstream HTTP/2 connection: what the proxy takes from the
/// upstream of one call (stream), and of all the calls of one client connection, before its
/// client has read it. A client connection that reads nothing holds at most this much in the
/// proxy's memory, about what an HTTP/1.1 connection's socket buffers and hyper's read buffer
/// hold for a client that does not read (hyper's defaults are 2 and 5 MiB).
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONNECTION_WINDOW: u32 = 1024 * 1024;

/// Whether the peer of an HTTP/2 connection has sent what every HTTP/2 server sends first, a
/// SETTINGS frame. A peer that has not (an HTTP/1.1 server answering the connection preface
/// with an error, or nothing at all) cannot have acted on a request of that connection: a
/// failure there is known, not an unknown outcome.
/// Its state: nothing read yet (0), something that is not a SETTINGS frame (1), SETTINGS (2).
#[derive(Clone, Default)]
pub(super) struct Preface(Arc<std::sync::atomic::AtomicU8>);

impl Preface {
    fn spoken(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) == 2
    }

    /// Whether the peer sent anything at all: one that closed without a byte is not known
    /// not to speak HTTP/2 (a restart, a backend shedding load).
    fn heard(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) != 0
    }
}

/// An upstream stream whose first bytes read are checked for an HTTP/2 SETTINGS frame
/// (a 9-byte frame header whose fourth byte, the type, is 0x4).
struct Sniffed<I> {
    io: I,
    seen: [u8; 4],
    read: usize,
    preface: Preface,
}

impl<I: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Sniffed<I> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.io).poll_read(cx, buf);
        let this = &mut *self;
        if this.read < this.seen.len() {
            if buf.filled().len() > before {
                let _ = this.preface.0.compare_exchange(
                    0,
                    1,
                    std::sync::atomic::Ordering::AcqRel,
                    std::sync::atomic::Ordering::Acquire,
                );
            }
            for &b in &buf.filled()[before..] {
                if this.read == this.seen.len() {
                    break;
                }
                this.seen[this.read] = b;
                this.read += 1;
            }
            if this.read == this.seen.len() && this.seen[3] == 0x4 {
                this.preface
                    .0
                    .store(2, std::sync::atomic::Ordering::Release);
            }
        }
        polled
    }
}

impl<I: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Sniffed<I> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A kept-alive connection and when it was last handed back.
struct Idle {
    conn: SendRequest<RequestBody<Incoming>>,
    since: Instant,
}

/// How an upstream call failed; the variants say whether the upstream may have seen it.
pub(super) enum SendFailed {
    /// No connection could be opened: the upstream never saw the request.
    Connect(BoxError),
    /// The connection failed after the request was (perhaps) written.
    Request(hyper::Error),
}

impl From<BoxError> for SendFailed {
    fn from(e: BoxError) -> Self {
        Self::Connect(e)
    }
}

/// How long opening a connection to the upstream may take (TCP, TLS, HTTP/2 handshake). A
/// connection that could not be opened carried no request: a failure here is a plain 502,
/// never an unknown outcome.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// More idle connections than this per worker are closed instead of kept.
const MAX_IDLE_PER_WORKER: usize = 256;

impl UpstreamConns {
    pub(super) fn new(target: &Target, idle_timeout: Duration) -> Self {
        let authority = &target.authority;
        let default_port = if target.tls.is_some() { 443 } else { 80 };
        let addr = match authority.port_u16() {
            Some(_) => authority.as_str().to_owned(),
            None => format!("{}:{default_port}", authority.host()),
        };
        Self {
            addr,
            tls: target.tls.clone(),
            idle: std::sync::Mutex::default(),
            idle_timeout,
            tls_h2: target.tls_h2.clone(),
            h2: H2Slot::default(),
            h2_opened: std::sync::atomic::AtomicU64::new(0),
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
        match &self.tls {
            None => handshake(stream).await,
            Some((connector, name)) => {
                handshake(connector.connect(name.clone(), stream).await?).await
            }
        }
    }

    pub(super) async fn send(
        &self,
        mut req: Request<RequestBody<Incoming>>,
    ) -> Result<Response<Incoming>, SendFailed> {
        loop {
            let (mut conn, reused) = match self.take_ready() {
                Some(conn) => (conn, true),
                // Boxed: connecting (TCP, TLS, handshake) is a future of several KiB that
                // every request's future would otherwise carry and copy, connected or not.
                None => (
                    within_connect_timeout(Box::pin(self.connect())).await?,
                    false,
                ),
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

impl UpstreamConns {
    /// The HTTP/2 connection of `slot` (`None`: this worker's own, for calls with no client
    /// connection's), opened (h2c, or TLS with ALPN `h2`) if there is none or it closed.
    async fn h2(
        &self,
        slot: Option<&H2Slot>,
        hold: &(dyn Fn() -> Option<Hold> + Sync),
    ) -> Result<H2Conn, SendFailed> {
        let mut slot = slot.unwrap_or(&self.h2).0.lock().await;
        if let Some(conn) = slot.as_ref().filter(|c| !c.0.is_closed()) {
            return Ok(conn.clone());
        }
        // A closed connection gives back its share of the cap here, before the new one asks
        // for its own (kept in the slot, it would count twice: a call near the cap refused
        // with room to spare).
        *slot = None;
        // Before anything is opened: no room is a known outcome, nothing went out.
        let held = hold().ok_or_else(|| {
            SendFailed::Connect(Box::new(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                "not sent upstream: no room for another upstream connection (this client \
                 connection's HTTP/2 one counts against --max-connections while another of its \
                 requests uses one); retry",
            )))
        })?;
        let conn = self.open_h2().await.map_err(SendFailed::Connect)?;
        let conn = (conn.0, conn.1, conn.2, Some(held));
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// A new HTTP/2 connection to the upstream, numbered.
    async fn open_h2(
        &self,
    ) -> Result<(http2::SendRequest<RequestBody<Incoming>>, Preface, u64), BoxError> {
        let stream = TcpStream::connect(&self.addr).await?;
        let _ = stream.set_nodelay(true);
        let preface = Preface::default();
        let conn = match (&self.tls_h2, &self.tls) {
            (Some(connector), Some((_, name))) => {
                let tls = connector.connect(name.clone(), stream).await?;
                handshake_h2(sniffed(tls, &preface)).await?
            }
            _ => handshake_h2(sniffed(stream, &preface)).await?,
        };
        let number = self
            .h2_opened
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok((conn, preface, number))
    }

    /// Stops sending new calls on HTTP/2 connection `number` (a call on it timed out): the
    /// next call opens another. An upstream that went silent without closing the connection
    /// (a host powered off, a NAT that forgot the flow) would otherwise take every later call
    /// of the worker into the upstream timeout, and an unknown-outcome hold, until the kernel
    /// gives up on the socket (about 15 minutes). Calls still running on it go on; it closes
    /// when the last has ended. No pings: gRPC servers refuse frequent ones (grpc-go, by
    /// default, closes a connection pinged more than once in 5 minutes), and closing would
    /// cut the calls running on it.
    ///
    /// Does not wait: while another call holds the slot it is opening a new connection (or
    /// takes this one a moment before, and retires it in turn when it times out).
    pub(super) fn retire_h2(&self, slot: Option<&H2Slot>, number: u64) {
        if let Ok(mut slot) = slot.unwrap_or(&self.h2).0.try_lock()
            && slot.as_ref().is_some_and(|conn| conn.2 == number)
        {
            *slot = None;
        }
    }

    /// Sends a gRPC call over the HTTP/2 connection of `slot` (its client connection's;
    /// `None`: this worker's own): trailers and streams both ways, as gRPC needs.
    ///
    /// `used` is set to the number of the connection the call went out on, so that a caller
    /// whose call timed out can retire it.
    pub(super) async fn send_h2(
        &self,
        req: Request<RequestBody<Incoming>>,
        slot: Option<&H2Slot>,
        hold: &(dyn Fn() -> Option<Hold> + Sync),
        used: &std::sync::atomic::AtomicU64,
    ) -> Result<Response<Incoming>, SendFailed> {
        // See `unprocessed`: what it reads from an error holds on a single-threaded runtime.
        debug_assert!(
            tokio::runtime::Handle::current().runtime_flavor()
                == tokio::runtime::RuntimeFlavor::CurrentThread,
            "a proxy worker's runtime is single-threaded"
        );
        let (mut req, mut first) = (req, true);
        loop {
            // Calls of one client connection wait for one connection to open (at most
            // CONNECT_TIMEOUT) rather than each opening its own.
            let (mut conn, preface, number, _held) =
                within_connect_timeout(self.h2(slot, hold)).await?;
            used.store(number, std::sync::atomic::Ordering::Relaxed);
            conn.ready()
                .await
                .map_err(|e| SendFailed::Connect(e.into()))?;
            let mut failed = match conn.try_send_request(req).await {
                Ok(response) => return Ok(response),
                Err(failed) => failed,
            };
            let unsent = failed.take_message();
            let e = failed.into_error();
            if !preface.spoken() {
                // Not an HTTP/2 server (or none that got as far as its first frame): it
                // cannot have acted on the call. What the client is told (`failure`) by
                // the kind: Unsupported when it answered something else, ConnectionReset
                // when it closed without a byte.
                return Err(SendFailed::Connect(Box::new(if preface.heard() {
                    std::io::Error::new(
                        std::io::ErrorKind::Unsupported,
                        format!("the upstream does not speak HTTP/2 (gRPC needs it): {e}"),
                    )
                } else {
                    std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        format!("the upstream closed the connection before its first frame: {e}"),
                    )
                })));
            }
            if unsent.is_none() && !unprocessed(&e) {
                return Err(SendFailed::Request(e));
            }
            // Never processed upstream: handed back unsent (the connection closed first),
            // refused (REFUSED_STREAM), or above the last stream of the upstream's GOAWAY (a
            // server going away, a connection at its maximum age). After a GOAWAY, or a
            // hand-back, the connection takes no new call, and one handed back goes once more
            // on a new one. A refused stream leaves it in use: a server refuses streams over
            // its limit, and a new connection per refusal would multiply connections to an
            // upstream that is already overloaded.
            if unsent.is_some() || !refused_stream(&e) {
                self.retire_h2(slot, number);
            }
            match unsent {
                Some(again) if first => (req, first) = (again, false),
                _ => {
                    // ConnectionReset: what the client is told (`failure`).
                    return Err(SendFailed::Connect(Box::new(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        format!("the upstream did not process the call: {e}"),
                    ))));
                }
            }
        }
    }
}

/// Whether `e`, a call's failure on an HTTP/2 connection, says the upstream never processed
/// it (RFC 9113 sections 6.8 and 8.7): a stream reset by the upstream with REFUSED_STREAM, or
/// a graceful GOAWAY (NO_ERROR) from it whose last stream is below the call's, or that came
/// before the call's stream was opened. h2 (0.4) gives that GOAWAY's error to exactly those
/// streams; the streams it covered that are cut later end with a broken pipe, which says
/// nothing here. A GOAWAY with an error code says nothing either.
///
/// It relies on the worker's runtime being single-threaded (`Worker::run`, checked in
/// debug builds by `send_h2`): hyper opens a call's stream and then asks h2 whether the
/// connection is ready, and h2 answers that with the error of any GOAWAY received, whatever
/// its last stream. On one thread nothing runs between the two, so a GOAWAY received after
/// the stream opened cannot reach the call that way; on several, one covering the call could.
fn unprocessed(e: &hyper::Error) -> bool {
    h2_error_is(e, |h2| {
        h2.is_remote()
            && (h2.reason() == Some(h2::Reason::REFUSED_STREAM) && h2.is_reset()
                || h2.reason() == Some(h2::Reason::NO_ERROR) && h2.is_go_away())
    })
}

/// Whether `e` is a stream the upstream refused (REFUSED_STREAM).
fn refused_stream(e: &hyper::Error) -> bool {
    h2_error_is(e, |h2| {
        h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM)
    })
}

/// Whether an h2 error under `e` (its chain walked as `failure` walks it) is `such`.
fn h2_error_is(e: &hyper::Error, such: impl Fn(&h2::Error) -> bool) -> bool {
    let mut found = false;
    super::failure::visit(e, &mut |error| {
        found |= error.downcast_ref::<h2::Error>().is_some_and(&such);
    });
    found
}

fn sniffed<I>(io: I, preface: &Preface) -> Sniffed<I> {
    Sniffed {
        io,
        seen: [0; 4],
        read: 0,
        preface: preface.clone(),
    }
}

/// `connect`, failing as [`SendFailed::Connect`] after [`CONNECT_TIMEOUT`].
async fn within_connect_timeout<T, E: Into<SendFailed>>(
    connect: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, SendFailed> {
    match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(SendFailed::Connect(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no connection to the upstream within {CONNECT_TIMEOUT:?}"),
        )))),
    }
}

/// An HTTP/2 connection over `io`, driven on this worker's runtime.
async fn handshake_h2<I>(io: I) -> Result<http2::SendRequest<RequestBody<Incoming>>, BoxError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (conn, connection) = http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .initial_stream_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONNECTION_WINDOW)
        .handshake(TokioIo::new(io))
        .await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
        }
    });
    Ok(conn)
}

/// An HTTP/1.1 connection over `io`, driven on this worker's runtime next to the requests
/// that use it.
async fn handshake<I>(io: I) -> Result<SendRequest<RequestBody<Incoming>>, BoxError>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (conn, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(conn)
}
