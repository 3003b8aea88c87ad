//! One log event for each refusal, with the request it refused, rate-limited per kind and peer.
//!
//! The layer logs every answer it gives instead of the service (a stale or missing token, a
//! bad header, a drain timeout, ...) as one event: the problem type and status, the job, token
//! and highest where they apply, the request's method and path, and its peer when the server
//! put a [`PeerAddr`] in the request's extensions (`fence proxy` does). A flood cannot fill a
//! disk: an event repeats at most [`MAX_QUOTED`] bytes of the method and of the path, and
//! [`MAX_DETAIL`] of the detail, whatever the client sent ([`clipped`]); past [`PER_WINDOW`] events of one kind from one peer in [`WINDOW`], the rest are
//! counted, and the next event of that kind and peer says how many were left out
//! (`suppressed`); and past [`ALL_PER_WINDOW`] from all peers together, so that many peers
//! cannot add up to a flood either. The lease server logs its refusals through the same [`log`],
//! and the lease decisions it logs in events of its own (a claim of a held job, ...) under the
//! same limit ([`admit_refusal`]).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

use fence_core::Problem;
use http::{Method, StatusCode};

/// The peer of a request, for the refusal log: a server puts it in each request's
/// extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// The address a peer is counted by, for every per-peer limit (this log's rate limit, a
/// listener's connections per peer): an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, an IPv4
/// client of a dual-stack socket) as that IPv4 address; any other address as it is. An IPv6
/// /64 is not taken for one peer: the hosts of one cloud subnet (pods of a cluster) share
/// one, and would share one cap.
pub fn peer_key(ip: IpAddr) -> IpAddr {
    ip.to_canonical()
}

/// How long one window of the rate limit lasts.
pub const WINDOW: Duration = Duration::from_secs(10);
/// How many events of one kind from one peer are logged per [`WINDOW`].
pub const PER_WINDOW: u32 = 10;
/// How many events are logged per [`WINDOW`] from all peers together.
pub const ALL_PER_WINDOW: u32 = 1_000;
/// How many (kind, peer) pairs are tracked at once; past it the counts start over.
const MAX_TRACKED: usize = 10_000;
/// How many bytes of a method or path a client chose one event repeats (a head may hold
/// 64 KiB of path): past it the text is cut, and says how long it was ([`clipped`]).
pub const MAX_QUOTED: usize = 256;
/// How many bytes of a refusal's detail, which may quote what the client sent, one event
/// repeats.
pub const MAX_DETAIL: usize = 640;

/// What a refused request asked, kept until its answer is known.
#[derive(Debug, Clone)]
pub(crate) struct Asked {
    method: Method,
    uri: http::Uri,
    peer: Option<IpAddr>,
}

impl Asked {
    pub(crate) fn of(parts: &http::request::Parts) -> Self {
        Self {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            peer: parts.extensions.get::<PeerAddr>().map(|p| p.0.ip()),
        }
    }

    /// Logs `response` when it is a refusal (a problem in its extensions).
    pub(crate) fn log_if_refused<B>(&self, response: &http::Response<B>) {
        if let Some(problem) = response.extensions().get::<Problem>() {
            log(problem, &self.method, self.uri.path(), self.peer, None);
        }
    }
}

/// Logs one refusal: `problem`, answered to `method path` from `peer` (and the auth-file
/// `client`, when known), unless the rate limit for its kind and peer is spent.
pub fn log(
    problem: &Problem,
    method: &Method,
    path: &str,
    peer: Option<IpAddr>,
    client: Option<&str>,
) {
    let Some(suppressed) = admit(problem.kind.uri(), peer) else {
        return;
    };
    let job = problem.job.as_ref().map(fence_core::JobId::as_str);
    let peer = peer.map(tracing::field::display);
    let kind = problem.kind.uri();
    let name = kind
        .strip_prefix("urn:fence:")
        .unwrap_or(kind)
        .replace('-', " ");
    // The token's generation, or the lease's for the lease API's refusals.
    let generation = problem.token.or(problem.generation);
    // A detail may quote what the client sent: on one line, so it cannot forge another;
    // and it, the method and the path are cut short, so that a few lines a second of a
    // client's 64 KiB path cannot fill a disk either.
    let detail = clipped(&problem.detail, MAX_DETAIL);
    let method = clipped(method.as_str(), MAX_QUOTED);
    let path: &str = &clipped(path, MAX_QUOTED);
    macro_rules! refused {
        ($level:ident) => {
            tracing::$level!(
                r#type = kind,
                status = problem.status,
                job,
                generation,
                highest = problem.highest,
                method = %method,
                path,
                peer,
                client,
                suppressed = (suppressed > 0).then_some(suppressed),
                "refused ({name}): {detail}"
            )
        };
    }
    // What a client did wrong, or the fence working as it should (a stale token), is news
    // at info; a missing secret, a forbidden job or a failing store at warn.
    match problem.status_code() {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => refused!(warn),
        s if s.is_server_error() => refused!(warn),
        _ => refused!(info),
    }
}

/// `text` with its control characters (CR, LF, ESC, ...) escaped as `\n`, `\u{1b}`, and at
/// most `max` bytes of that: a log line stays one line, cannot forge the next or move a
/// terminal's cursor, and repeats no more of what a client sent than `max`. A longer text
/// is cut at a character and ends with `…(N bytes in all)`, N the length of `text`.
pub fn clipped(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max && !text.chars().any(char::is_control) {
        return text.into();
    }
    let mut out = String::with_capacity(max.min(text.len()) + 32);
    for c in text.chars() {
        let before = out.len();
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
        if out.len() > max {
            out.truncate(before);
            out.push_str(&format!("…({} bytes in all)", text.len()));
            break;
        }
    }
    out.into()
}

/// Whether a refusal of `kind` (a problem type) from `peer`, which the caller logs itself in
/// an event of its own (the lease server's decisions, with their owner and holder), is to be
/// logged now: `Some(how many of that kind and peer were left out since the last one logged)`,
/// or `None` when the rate limit of [`log`], which it shares, is spent and it is counted
/// instead.
pub fn admit_refusal(kind: fence_core::ProblemType, peer: Option<IpAddr>) -> Option<u64> {
    admit(kind.uri(), peer)
}

/// Logs why the `which` store failed for `job` (`None`: a request for no one job, a list or
/// a health probe): its whole error chain, which may name tables, hosts or paths and so
/// never goes into an answer. Rate-limited like refusals: a store that is down fails every
/// request, and one line per request would fill a disk at the request rate.
pub fn log_store_failure<'a>(
    which: &str,
    job: impl Into<Option<&'a fence_core::JobId>>,
    error: &(dyn std::error::Error + 'static),
) {
    let Some(suppressed) = admit("store-failure", None) else {
        return;
    };
    tracing::warn!(
        store = which,
        job = job.into().map(tracing::field::display),
        error = %fence_storage::error_chain(error),
        suppressed = (suppressed > 0).then_some(suppressed),
        "the {which} store failed"
    );
}

/// Logs that the upstream `upstream` failed (`error`: its error chain, or how long it was
/// given), rate-limited like refusals: an upstream that is down fails every request, and
/// one line per request would fill a disk at the request rate.
pub fn log_upstream_failure(upstream: &str, error: &dyn std::fmt::Display) {
    let Some(suppressed) = admit("upstream-failure", None) else {
        return;
    };
    tracing::warn!(
        upstream,
        error = %error,
        suppressed = (suppressed > 0).then_some(suppressed),
        "upstream failed"
    );
}

/// Logs that a listener could not accept a connection (out of file descriptors, and the
/// like), rate-limited like refusals: an accept loop that keeps failing tries again every
/// few milliseconds, and would otherwise write a line each time.
pub fn log_accept_failure(error: &std::io::Error) {
    let Some(suppressed) = admit("accept-failure", None) else {
        return;
    };
    tracing::warn!(
        error = %error,
        suppressed = (suppressed > 0).then_some(suppressed),
        "accepting a connection failed"
    );
}

/// Logs a failed TLS handshake from `peer`, rate-limited like refusals.
pub fn log_handshake_failure(peer: SocketAddr, error: &(dyn std::error::Error + 'static)) {
    let Some(suppressed) = admit("tls-handshake", Some(peer.ip())) else {
        return;
    };
    tracing::warn!(
        peer = %peer.ip(),
        error = %fence_storage::error_chain(error),
        suppressed = (suppressed > 0).then_some(suppressed),
        "TLS handshake failed"
    );
}

#[derive(Debug)]
struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

impl Window {
    fn new(now: Instant) -> Self {
        Self {
            start: now,
            logged: 0,
            suppressed: 0,
        }
    }

    /// Starts a new window when this one is over.
    fn roll(&mut self, now: Instant) {
        if now.duration_since(self.start) >= WINDOW {
            self.start = now;
            self.logged = 0;
        }
    }
}

/// The rate limit: a window per kind and peer ([`peer_key`]), and one over all of them, so
/// that many peers (an IPv6 prefix holds plenty) cannot log more than [`ALL_PER_WINDOW`]
/// lines per [`WINDOW`] between them.
#[derive(Debug)]
struct Limiter {
    windows: HashMap<(&'static str, Option<IpAddr>), Window>,
    all: Window,
}

impl Limiter {
    fn new() -> Self {
        Self {
            windows: HashMap::new(),
            all: Window::new(Instant::now()),
        }
    }

    /// `Some(how many were left out since the last logged one)` when an event of `kind`
    /// from `peer` is to be logged now; `None` when it is counted instead.
    fn admit(&mut self, kind: &'static str, peer: Option<IpAddr>, now: Instant) -> Option<u64> {
        let peer = peer.map(peer_key);
        if self.windows.len() >= MAX_TRACKED && !self.windows.contains_key(&(kind, peer)) {
            self.windows.clear();
        }
        self.all.roll(now);
        let w = self
            .windows
            .entry((kind, peer))
            .or_insert_with(|| Window::new(now));
        w.roll(now);
        // The process's own failures (no peer: a store or upstream down, accepts failing)
        // are a few kinds fixed in the code, each within its own limit: they stay out of
        // the budget over all peers, which refusals from many peers could spend first and
        // so hide the first line of an outage.
        let own = peer.is_none();
        if w.logged < PER_WINDOW && (own || self.all.logged < ALL_PER_WINDOW) {
            w.logged += 1;
            if !own {
                self.all.logged += 1;
            }
            Some(std::mem::take(&mut w.suppressed))
        } else {
            if w.logged < PER_WINDOW {
                // Held back by the budget over all peers, not by this peer's own.
                self.all.suppressed += 1;
            }
            w.suppressed += 1;
            None
        }
    }

    /// How many events the budget over all peers has held back since this was last asked.
    fn take_held_back_by_all(&mut self) -> u64 {
        std::mem::take(&mut self.all.suppressed)
    }
}

static LIMIT: LazyLock<Mutex<Limiter>> = LazyLock::new(|| Mutex::new(Limiter::new()));

/// Asks the process's refusal limiter, now: whether an event of `kind` (a fixed
/// name, such as `"fence-push"`) from `peer`, which the caller logs itself, is to be logged
/// now (`Some(how many were left out before it)`) under the limit of [`log`]. An admitted
/// event first says, in an event of its own, how many the budget over all peers held back
/// before it: a flood from many peers leaves that trace even when none of them comes back.
pub fn admit(kind: &'static str, peer: Option<IpAddr>) -> Option<u64> {
    let mut limit = LIMIT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let admitted = limit.admit(kind, peer, Instant::now());
    if admitted.is_some() {
        let held_back = limit.take_held_back_by_all();
        if held_back > 0 {
            tracing::warn!(
                suppressed = held_back,
                "refusal log: {held_back} events from all peers together were left out (at most {ALL_PER_WINDOW} per {WINDOW:?})"
            );
        }
    }
    admitted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detail_is_logged_on_one_line() {
        let one_line = |text| clipped(text, MAX_DETAIL);
        assert_eq!(one_line("plain: as it is"), "plain: as it is");
        assert_eq!(
            one_line("x\r\nWARN forged\u{1b}[2K"),
            "x\\r\\nWARN forged\\u{1b}[2K"
        );
        assert!(matches!(one_line("é ok"), std::borrow::Cow::Borrowed(_)));
    }

    /// A client's 64 KiB path is repeated in a few hundred bytes that say how long it was,
    /// cut at a character, escapes included in the count.
    #[test]
    fn a_long_text_is_cut_and_says_how_long_it_was() {
        let path = format!("/{}", "a".repeat(60_000));
        let cut = clipped(&path, MAX_QUOTED);
        assert!(cut.len() < MAX_QUOTED + 32, "{} bytes", cut.len());
        assert!(cut.starts_with("/aaa"), "{cut}");
        assert!(cut.ends_with("…(60001 bytes in all)"), "{cut}");
        assert_eq!(clipped("ééé", 5), "éé…(6 bytes in all)");
        assert_eq!(clipped("ab\ncd", 3), "ab…(5 bytes in all)");
        assert_eq!(clipped("exactly", 7), "exactly");
        let escapes = "\u{1b}".repeat(10_000);
        assert!(clipped(&escapes, MAX_DETAIL).len() < MAX_DETAIL + 32);
    }

    #[test]
    fn a_flood_from_one_peer_is_counted_not_logged_and_others_are_not_held_back() {
        let mut limit = Limiter::new();
        let now = Instant::now();
        let flooder: IpAddr = "192.0.2.7".parse().unwrap();
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        let kind = "urn:test:flood";
        for _ in 0..PER_WINDOW {
            assert_eq!(limit.admit(kind, Some(flooder), now), Some(0));
        }
        for _ in 0..25 {
            assert_eq!(limit.admit(kind, Some(flooder), now), None);
        }
        assert_eq!(
            limit.admit(kind, Some(other), now),
            Some(0),
            "another peer is logged"
        );
        assert_eq!(
            limit.admit("urn:test:other", Some(flooder), now),
            Some(0),
            "another kind too"
        );
        // The next window's first event says how many were left out.
        let later = now + WINDOW;
        assert_eq!(limit.admit(kind, Some(flooder), later), Some(25));
        assert_eq!(limit.admit(kind, Some(flooder), later), Some(0));
    }

    /// IPv4-mapped IPv6 as IPv4; every other address as it is (an IPv6 /64 may be a
    /// whole cloud subnet, not one host).
    #[test]
    fn a_peer_is_its_address_a_mapped_ipv4_as_ipv4() {
        let key = |ip: &str| peer_key(ip.parse().unwrap()).to_string();
        assert_eq!(key("192.0.2.7"), "192.0.2.7");
        assert_eq!(key("::ffff:192.0.2.7"), "192.0.2.7");
        assert_eq!(
            key("2001:db8:1:2:aaaa:bbbb:cccc:dddd"),
            "2001:db8:1:2:aaaa:bbbb:cccc:dddd"
        );
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff::9"));
        assert_eq!(key("::1"), "::1");
    }

    #[test]
    fn many_peers_together_log_no_more_than_the_global_budget() {
        let mut limit = Limiter::new();
        let now = Instant::now();
        let kind = "urn:test:spread";
        let peer = |i: u32| {
            Some(IpAddr::from(
                (0x2001_0db8_u128 << 96 | u128::from(i) << 64).to_be_bytes(),
            ))
        };
        let mut logged = 0;
        for i in 0..(2 * ALL_PER_WINDOW) {
            logged += u32::from(limit.admit(kind, peer(i), now).is_some());
        }
        assert_eq!(logged, ALL_PER_WINDOW);
        // The process's own failure, after the peers spent the budget, is still logged: the
        // first line of an outage is not hidden behind refusals.
        assert_eq!(limit.admit("store-failure", None, now), Some(0));
        assert_eq!(limit.take_held_back_by_all(), u64::from(ALL_PER_WINDOW));
        assert_eq!(limit.take_held_back_by_all(), 0);
        // Each peer left out hears about it in the next window.
        let later = now + WINDOW;
        assert_eq!(
            limit.admit(kind, peer(2 * ALL_PER_WINDOW - 1), later),
            Some(1)
        );
    }
}
