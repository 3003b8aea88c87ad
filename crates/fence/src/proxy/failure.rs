//! How an upstream call failed, in fixed words for the client: never where, never the error's text.
//!
//! An error's own text may name the upstream (rustls: `certificate not valid for name
//! "billing.internal"`, a resolver naming the host): the proxy's clients need not learn its
//! inner topology, so its answer says only which kind of failure it was, and the whole chain
//! goes to the proxy's rate-limited log.

use std::{error::Error, io::ErrorKind};

/// The detail of a 502 for a connection or call that failed with `e`.
pub(super) fn how_it_failed(e: &(dyn Error + 'static)) -> &'static str {
    let mut kind = Kind::Other;
    visit(e, &mut |e| kind = kind.max(Kind::of(e)));
    match kind {
        Kind::Certificate => {
            "the TLS handshake with the upstream failed: its certificate was not accepted"
        }
        Kind::Tls => "the TLS handshake with the upstream failed",
        Kind::NoHttp2 => "the upstream does not speak HTTP/2 (gRPC needs it)",
        Kind::TimedOut => "the connection to the upstream timed out",
        Kind::Refused => "the upstream refused the connection",
        Kind::Closed => "the upstream closed or reset the connection",
        Kind::NotHttp => "the upstream's answer was not HTTP the proxy could read",
        Kind::Other => "the connection to the upstream failed",
    }
}

/// The kinds, least telling first: the most telling one found in the chain is said.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Other,
    NotHttp,
    Closed,
    Refused,
    TimedOut,
    NoHttp2,
    Tls,
    Certificate,
}

impl Kind {
    fn of(e: &(dyn Error + 'static)) -> Self {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return match tls {
                rustls::Error::InvalidCertificate(_) => Self::Certificate,
                _ => Self::Tls,
            };
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                ErrorKind::ConnectionRefused => Self::Refused,
                ErrorKind::TimedOut => Self::TimedOut,
                ErrorKind::Unsupported => Self::NoHttp2,
                ErrorKind::ConnectionReset
                | ErrorKind::ConnectionAborted
                | ErrorKind::BrokenPipe
                | ErrorKind::UnexpectedEof => Self::Closed,
                _ => Self::Other,
            };
        }
        if let Some(hyper) = e.downcast_ref::<hyper::Error>() {
            if hyper.is_timeout() {
                return Self::TimedOut;
            }
            if hyper.is_incomplete_message() || hyper.is_closed() || hyper.is_canceled() {
                return Self::Closed;
            }
            if hyper.is_parse() {
                return Self::NotHttp;
            }
        }
        Self::Other
    }
}

/// Calls `f` on `e` and every error under it, the inner error of an `io::Error` included
/// (its `source()` skips that one: a TLS error wrapped by tokio-rustls).
pub(super) fn visit(e: &(dyn Error + 'static), f: &mut impl FnMut(&(dyn Error + 'static))) {
    let mut next = Some(e);
    // Bounded, should a chain ever loop.
    for _ in 0..32 {
        let Some(e) = next else { return };
        f(e);
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
        {
            visit(inner, f);
        }
        next = e.source();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_in_fixed_words_that_name_no_host() {
        use rustls::{CertificateError, Error as Tls};
        let io =
            |kind: ErrorKind, inner: Box<dyn Error + Send + Sync>| std::io::Error::new(kind, inner);
        let name_mismatch = io(
            ErrorKind::InvalidData,
            Box::new(Tls::InvalidCertificate(CertificateError::NotValidForName)),
        );
        let cases: Vec<(Box<dyn Error + Send + Sync>, &str)> = vec![
            (Box::new(name_mismatch), "its certificate was not accepted"),
            (
                Box::new(io(
                    ErrorKind::InvalidData,
                    Box::new(Tls::HandshakeNotComplete),
                )),
                "TLS handshake with the upstream failed",
            ),
            (
                Box::new(std::io::Error::from(ErrorKind::ConnectionRefused)),
                "refused the connection",
            ),
            (
                Box::new(std::io::Error::new(
                    ErrorKind::TimedOut,
                    "10.0.0.7:80 timed out",
                )),
                "timed out",
            ),
            (
                Box::new(std::io::Error::from(ErrorKind::ConnectionReset)),
                "closed or reset",
            ),
            (
                "failed to look up billing.internal".into(),
                "the connection to the upstream failed",
            ),
        ];
        for (e, want) in cases {
            let said = how_it_failed(e.as_ref());
            assert!(said.contains(want), "{e}: {said}");
            assert!(
                !said.contains("internal") && !said.contains("10.0"),
                "{said}"
            );
        }
    }
}
