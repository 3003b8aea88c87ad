//! One line of advice for the errors a newcomer meets first, TLS above all.
//!
//! It is printed under the error itself.

/// What to do about the error whose whole chain reads `error`, when it is one of the usual
/// mistakes.
#[must_use]
pub fn hint(error: &str) -> Option<&'static str> {
    const HINTS: &[(&str, &str)] = &[
        (
            "CaUsedAsEndEntity",
            "the server's certificate is marked as a CA (what `openssl req -x509` makes with OpenSSL 3), and a CA certificate is not trusted as a server's, even given as --ca-cert; make a CA and a server certificate with `fence tls init DIR`, serve DIR/server.pem and DIR/server-key.pem, and give clients DIR/ca.pem as --ca-cert",
        ),
        (
            "UnknownIssuer",
            "the server's certificate is not signed by a CA this client trusts: give that CA's certificate with --ca-cert (for `fence tls init DIR`: DIR/ca.pem)",
        ),
        (
            "NotValidForName",
            "the server's certificate does not name the host in --server: connect by a name or address it has, or make one that has it with `fence tls init DIR --name HOST --ip ADDRESS`",
        ),
        (
            "invalid HTTP version parsed",
            "the server answered in TLS: use https:// (and --ca-cert for a private CA)",
        ),
        (
            "InvalidContentType",
            "the server does not speak TLS there: use http://, or start it with --tls-cert and --tls-key",
        ),
    ];
    HINTS
        .iter()
        .find(|(needle, _)| error.contains(needle))
        .map(|(_, hint)| *hint)
}
