//! Header rewriting on the way through: hop-by-hop headers out, `X-Forwarded-*` in.

use std::net::SocketAddr;

use fence_core::headers::{IDEMPOTENCY_KEY, X_FENCING_JOB, X_FENCING_TOKEN};
use http::{
    HeaderMap, HeaderName, HeaderValue, Uri, Version,
    header::{HOST, VIA},
    request::Parts,
};

use super::config::Target;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
pub(super) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

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

/// The client's IP as `X-Forwarded-For` writes it, made once per connection and put into
/// each request's extensions (with the rest of what is known of its connection,
/// `ClientStreams`).
#[derive(Debug, Clone)]
pub(super) struct ClientAddr(HeaderValue);

impl ClientAddr {
    pub(super) fn new(peer: SocketAddr) -> Self {
        let ip = peer.ip().to_canonical().to_string();
        // An IP address is digits, letters, dots and colons: always a valid header value.
        Self(HeaderValue::from_str(&ip).unwrap_or(HeaderValue::from_static("unknown")))
    }
}

/// Turns a client's request head into the upstream's: hop-by-hop headers removed, `Host`
/// set (the upstream's, or the client's with `preserve_host`), `X-Forwarded-For`, `-Host`
/// and `-Proto` added, `Via` appended (with `via`), the target `uri` and HTTP/1.1.
pub(super) fn to_upstream(
    parts: &mut Parts,
    (uri, client): (Uri, Option<&ClientAddr>),
    target: &Target,
    preserve_host: bool,
    via: bool,
) {
    let original_host = parts.headers.get(HOST).cloned().or_else(|| {
        parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    });
    strip_hop_by_hop(&mut parts.headers, true);
    strip_lookalikes(&mut parts.headers);
    // The client's `Expect: 100-continue` was answered here (hyper sends the 100 when the
    // body is first read) and the upstream gets the body without waiting: passed on, it
    // would only invite an upstream that waits for its own 100 to read the body otherwise
    // (as nginx does, the proxy does not forward it).
    parts.headers.remove(http::header::EXPECT);
    let headers = &mut parts.headers;
    if preserve_host {
        // HTTP/1.1 needs a Host: an HTTP/1.0 client without one gets the upstream's.
        headers.insert(HOST, original_host.unwrap_or_else(|| target.host.clone()));
    } else {
        headers.insert(HOST, target.host.clone());
        match original_host {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST, host);
            }
            None => {
                headers.remove(X_FORWARDED_HOST);
            }
        }
    }
    if let Some(ClientAddr(ip)) = client {
        append_forwarded_for(headers, ip);
    }
    if via {
        append_via(headers, parts.version);
    }
    if parts.version == Version::HTTP_2 {
        join_cookies(headers);
    }
    parts.uri = uri;
    // The upstream connections speak HTTP/1.1, whatever the client spoke to us.
    parts.version = Version::HTTP_11;
}

/// Joins an HTTP/2 client's cookie fields into one, with `; ` (RFC 9113 section 8.2.3): an
/// HTTP/2 client may send each cookie as a field of its own, and an HTTP/1.1 request must
/// carry at most one `Cookie` field (RFC 6265 section 5.4), which many servers read alone.
fn join_cookies(headers: &mut HeaderMap) {
    use http::header::COOKIE;
    let mut fields = headers.get_all(COOKIE).iter();
    if fields.next().is_none() || fields.next().is_none() {
        return;
    }
    let mut joined: Vec<u8> = Vec::new();
    for field in headers.get_all(COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(field.as_bytes());
    }
    // Joined from valid field values with "; ": valid too.
    if let Ok(joined) = HeaderValue::from_bytes(&joined) {
        headers.insert(COOKIE, joined);
    }
}

/// Removes the hop-by-hop headers and every header the `Connection` header names. On a
/// request the fencing and idempotency headers stay even when named: the fence already
/// acted on them, and the upstream must see the token it accepted.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap, request: bool) {
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

/// The headers the fence judges or the proxy sets, whose underscore spellings a CGI-style
/// upstream (WSGI, Rack, PHP: `HTTP_X_FENCING_TOKEN`) merges with the real ones.
const JUDGED_OR_SET: [HeaderName; 7] = [
    X_FENCING_JOB,
    X_FENCING_TOKEN,
    IDEMPOTENCY_KEY,
    X_FORWARDED_FOR,
    X_FORWARDED_HOST,
    X_FORWARDED_PROTO,
    http::header::FORWARDED,
];

/// Removes the underscore spellings of the headers the fence judges or the proxy sets
/// (`X_Fencing_Token`): a CGI-style upstream reads both spellings as one, so one the fence
/// never judged could stand in for, or be joined to, the token it accepted (nginx drops
/// every header with an underscore by default).
fn strip_lookalikes(headers: &mut HeaderMap) {
    if !headers.keys().any(has_underscore) {
        return;
    }
    let lookalikes: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            has_underscore(name)
                && JUDGED_OR_SET.iter().any(|judged| {
                    let (judged, name) = (judged.as_str(), name.as_str());
                    judged.len() == name.len()
                        && judged
                            .bytes()
                            .zip(name.bytes())
                            .all(|(j, n)| j == n || (j == b'-' && n == b'_'))
                })
        })
        .cloned()
        .collect();
    for name in lookalikes {
        headers.remove(name);
    }
}

/// Whether a header name has an underscore. A byte loop: `str::contains` goes through
/// `memchr`, whose setup costs more than the few bytes of a name, and every name of every
/// request is looked at.
fn has_underscore(name: &HeaderName) -> bool {
    name.as_str().bytes().any(|b| b == b'_')
}

/// Appends this proxy to `Via` as `<the client's protocol version> fence` (RFC 9110 section
/// 7.6.3), after any earlier proxies, joined into one line.
fn append_via(headers: &mut HeaderMap, version: Version) {
    // Constants: `HeaderValue::from_static` checks its bytes where it runs, at compile
    // time here rather than on every request.
    const VIA_09: HeaderValue = HeaderValue::from_static("0.9 fence");
    const VIA_10: HeaderValue = HeaderValue::from_static("1.0 fence");
    const VIA_11: HeaderValue = HeaderValue::from_static("1.1 fence");
    const VIA_2: HeaderValue = HeaderValue::from_static("2 fence");
    const VIA_3: HeaderValue = HeaderValue::from_static("3 fence");
    let ours = match version {
        Version::HTTP_09 => VIA_09,
        Version::HTTP_10 => VIA_10,
        Version::HTTP_2 => VIA_2,
        Version::HTTP_3 => VIA_3,
        _ => VIA_11,
    };
    append_joined(headers, &VIA, &ours);
}

/// Appends the client's IP to `X-Forwarded-For`, joining earlier values into one line.
fn append_forwarded_for(headers: &mut HeaderMap, ip: &HeaderValue) {
    append_joined(headers, &X_FORWARDED_FOR, ip);
}

/// Appends `value` to the list header `name`, joining earlier values into one line.
fn append_joined(headers: &mut HeaderMap, name: &HeaderName, value: &HeaderValue) {
    if !headers.contains_key(name) {
        headers.insert(name.clone(), value.clone());
        return;
    }
    let mut joined: Vec<u8> = Vec::new();
    for earlier in headers.get_all(name) {
        let earlier = earlier.as_bytes().trim_ascii();
        if !earlier.is_empty() {
            joined.extend_from_slice(earlier);
            joined.extend_from_slice(b", ");
        }
    }
    joined.extend_from_slice(value.as_bytes());
    match HeaderValue::from_bytes(&joined) {
        Ok(joined) => {
            headers.insert(name.clone(), joined);
        }
        Err(_) => {
            // Earlier values were valid header bytes, so this cannot happen; still, never
            // lose what is appended.
            headers.append(name.clone(), value.clone());
        }
    }
}
