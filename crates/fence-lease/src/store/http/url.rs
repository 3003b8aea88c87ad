//! Server URLs the client refuses, and how an error quotes one: never with its password.

use fence_storage::tls::TlsError;
use http::Uri;

/// A server URL the client cannot use.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// It does not parse as a URL.
    #[error("invalid server URL {url:?}")]
    Invalid {
        /// The URL given, without a user or password.
        url: String,
        /// Why it does not parse.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// It is not `http://host[:port]` or `https://host[:port]`.
    #[error("invalid server URL {url:?}: expected http://host:port or https://host:port")]
    Unsupported {
        /// The URL given, without a user or password.
        url: String,
    },
    /// It has an `@`, so it may name a user or password (`http://user:secret@host`), or the
    /// path may hide one from a parser (`http://user:pa/ss@host`): the lease server takes a
    /// bearer secret (`bearer` of [`HttpOptions`](super::HttpOptions)), never credentials
    /// in the URL. The URL is shown without them.
    #[error(
        "the server URL {url:?} carries a user or password; give the bearer secret as the auth \
         token instead"
    )]
    Credentials {
        /// The URL given, its user and password left out.
        url: String,
    },
    /// TLS for `https://` could not be set up (a CA file that cannot be read, say).
    #[error("cannot set up TLS for {url}")]
    Tls {
        /// The URL given, without a user or password.
        url: String,
        /// Why.
        #[source]
        source: TlsError,
    },
}

/// `url` with anything between its scheme and its last `@` left out, so an error that quotes
/// a URL never quotes a password in it, whatever its syntax: a password with a `/` in it
/// (`http://ops:pa/ss@host`) ends the authority early for a parser, not for this.
fn without_credentials(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_owned();
    };
    // Only a scheme's own characters count as one (`ops:pa://ss@h` has none).
    let scheme = url.split_once("://").map(|(scheme, _)| scheme).filter(|s| {
        s.len() < at
            && s.starts_with(|c: char| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    });
    match scheme {
        Some(scheme) => format!("{scheme}://…@{}", &url[at + 1..]),
        None => format!("…@{}", &url[at + 1..]),
    }
}

/// The servers of `base_url` (one URL, or several separated by commas), each without a
/// trailing `/`, and whether any is `https://`. Any `@` is refused first, before splitting:
/// a password may hold a comma (`http://ops:a,b@host`).
pub(super) fn servers(base_url: &str) -> Result<(Vec<String>, bool), UrlError> {
    if base_url.contains('@') {
        return Err(UrlError::Credentials {
            url: without_credentials(base_url),
        });
    }
    // Past the check above no URL holds an `@`, so the errors below quote it as given.
    let mut servers = Vec::new();
    let mut any_https = false;
    for one in base_url.split(',').map(str::trim) {
        let trimmed = one.trim_end_matches('/');
        let uri: Uri = trimmed.parse().map_err(|source| UrlError::Invalid {
            url: one.to_owned(),
            source,
        })?;
        match uri.scheme_str() {
            Some("https") => any_https = true,
            Some("http") => {}
            _ => {
                return Err(UrlError::Unsupported {
                    url: one.to_owned(),
                });
            }
        }
        if uri.host().is_none() {
            return Err(UrlError::Unsupported {
                url: one.to_owned(),
            });
        }
        servers.push(trimmed.to_owned());
    }
    Ok((servers, any_https))
}
