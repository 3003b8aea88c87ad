//! A lease store that is a `fence server` elsewhere, over its HTTP API.
//!
//! Every decision is one HTTP call of the lease API, and the server's clock decides.

use std::time::Duration;

use bytes::Bytes;
use fence_core::{
    Generation, JobId, Problem, ProblemType, Ttl,
    lease_api::{
        Action, ClaimRequest, FinishRequest, LeaseBody, RecordBody, RenewRequest, lease_path,
    },
};
use http::{Method, Request, StatusCode, Uri, header::CONTENT_TYPE};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use super::{Grant, LeaseOp, LeaseRecord, LeaseStore, Outcome, StoreError};

/// The lease API of a `fence server`, as a [`LeaseStore`].
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use fence_lease::{HttpLeaseStore, LeaseClient};
///
/// let client = LeaseClient::new(HttpLeaseStore::new("http://127.0.0.1:7700")?);
/// let lease = client.claim("invoice-42".parse()?).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct HttpLeaseStore {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
}

/// A server URL the client cannot use.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// It does not parse as a URL.
    #[error("invalid server URL {url:?}")]
    Invalid {
        /// The URL given.
        url: String,
        /// Why it does not parse.
        #[source]
        source: http::uri::InvalidUri,
    },
    /// It is not `http://host[:port]`.
    #[error("invalid server URL {url:?}: expected http://host:port (https is not supported)")]
    Unsupported {
        /// The URL given.
        url: String,
    },
}

/// The largest answer the client reads from a server.
const MAX_ANSWER: usize = 64 * 1024;

impl HttpLeaseStore {
    /// A store at `base_url` (`http://host:port`), with a 10 s timeout per call.
    ///
    /// # Errors
    /// When `base_url` is not an `http://` URL with a host.
    pub fn new(base_url: &str) -> Result<Self, UrlError> {
        let trimmed = base_url.trim_end_matches('/');
        let uri: Uri = trimmed.parse().map_err(|source| UrlError::Invalid {
            url: base_url.to_owned(),
            source,
        })?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(UrlError::Unsupported {
                url: base_url.to_owned(),
            });
        }
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(Self {
            base: trimmed.to_owned(),
            client,
            timeout: Duration::from_secs(10),
        })
    }

    /// Gives each call `timeout` instead of 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The server's base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// One call of the lease API: `POST` of `body` to `action`'s path, or `GET` of the
    /// job's record without one. Returns the answer as the server sent it, for tools that
    /// show it; [`LeaseStore::apply`] interprets it.
    ///
    /// # Errors
    /// When the server cannot be reached, does not answer within the timeout, or answers
    /// more than 64 KiB.
    pub async fn call(
        &self,
        job: &JobId,
        action: Option<Action>,
        body: Option<&impl serde::Serialize>,
    ) -> Result<(StatusCode, Bytes), StoreError> {
        let uri = format!("{}{}", self.base, lease_path(job, action));
        let mut req = Request::builder().uri(uri);
        let body = match body {
            Some(v) => {
                req = req
                    .method(Method::POST)
                    .header(CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(serde_json::to_vec(v).map_err(StoreError::io)?))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req.body(body).map_err(StoreError::io)?;
        let exchange = async {
            let resp = self.client.request(req).await.map_err(StoreError::io)?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(StoreError::Io)?
                .to_bytes();
            Ok((status, bytes))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }
}

fn unexpected(status: StatusCode, body: &[u8]) -> StoreError {
    match serde_json::from_slice::<Problem>(body) {
        Ok(p) => StoreError::Protocol(format!("{status}: {} ({})", p.detail, p.kind)),
        Err(_) => StoreError::Protocol(format!(
            "{status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        )),
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    status: StatusCode,
    body: &[u8],
) -> Result<T, StoreError> {
    serde_json::from_slice(body)
        .map_err(|e| StoreError::Protocol(format!("{status} with an unreadable body: {e}")))
}

fn grant(status: StatusCode, body: &[u8]) -> Result<Grant, StoreError> {
    let lease: LeaseBody = decode(status, body)?;
    let ttl = Ttl::from_millis(lease.ttl_ms)
        .map_err(|e| StoreError::Protocol(format!("server granted an invalid ttl: {e}")))?;
    Ok(Grant {
        generation: lease.generation,
        ttl,
        expires_at_ms: lease.expires_at_ms,
        token: lease.token,
    })
}

fn record(status: StatusCode, body: &[u8]) -> Result<LeaseRecord, StoreError> {
    let r: RecordBody = decode(status, body)?;
    Ok(LeaseRecord {
        job: r.job,
        owner: r.owner,
        generation: r.generation,
        state: r.state,
        expires_in: Duration::from_millis(r.expires_in_ms),
    })
}

/// The outcome a refusal stands for, by its problem type.
fn refused(status: StatusCode, body: &[u8]) -> Result<Outcome, StoreError> {
    let Ok(p) = serde_json::from_slice::<Problem>(body) else {
        return Err(unexpected(status, body));
    };
    let generation = Generation::new(p.generation.unwrap_or(0));
    match p.kind {
        ProblemType::LeaseHeld => Ok(Outcome::Held {
            owner: p
                .owner
                .ok_or_else(|| StoreError::Protocol("lease-held without an owner".into()))?,
            expires_in: Duration::from_millis(p.expires_in_ms.unwrap_or(0)),
        }),
        ProblemType::JobCompleted => Ok(Outcome::Completed {
            owner: p.owner,
            generation,
        }),
        ProblemType::LeaseLost => Ok(Outcome::Lost {
            owner: p.owner,
            generation,
        }),
        _ => Err(unexpected(status, body)),
    }
}

impl LeaseStore for HttpLeaseStore {
    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        // A claim or renewal answers a lease; a release or completion, the record.
        let grants = matches!(op, LeaseOp::Claim { .. } | LeaseOp::Renew { .. });
        let (status, bytes) = match op {
            LeaseOp::Claim { owner, ttl } => {
                let body = ClaimRequest { owner, ttl };
                self.call(job, Some(Action::Claim), Some(&body)).await?
            }
            LeaseOp::Renew {
                owner,
                generation,
                ttl,
            } => {
                let body = RenewRequest {
                    owner,
                    generation,
                    ttl,
                };
                self.call(job, Some(Action::Renew), Some(&body)).await?
            }
            LeaseOp::Release { owner, generation } => {
                let body = FinishRequest { owner, generation };
                self.call(job, Some(Action::Release), Some(&body)).await?
            }
            LeaseOp::Complete { owner, generation } => {
                let body = FinishRequest { owner, generation };
                self.call(job, Some(Action::Complete), Some(&body)).await?
            }
        };
        match status {
            StatusCode::OK if grants => Ok(Outcome::Granted(grant(status, &bytes)?)),
            StatusCode::OK => Ok(Outcome::Done(record(status, &bytes)?)),
            StatusCode::CONFLICT | StatusCode::GONE => refused(status, &bytes),
            _ => Err(unexpected(status, &bytes)),
        }
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        let (status, bytes) = self.call(job, None, None::<&()>).await?;
        match status {
            StatusCode::OK => Ok(Some(record(status, &bytes)?)),
            StatusCode::NOT_FOUND => match serde_json::from_slice::<Problem>(&bytes) {
                Ok(p) if p.kind == ProblemType::UnknownJob => Ok(None),
                _ => Err(unexpected(status, &bytes)),
            },
            _ => Err(unexpected(status, &bytes)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_urls_are_refused_with_a_reason() {
        for bad in ["", "127.0.0.1:7700", "https://x", "ftp://x", "http://"] {
            assert!(HttpLeaseStore::new(bad).is_err(), "{bad}");
        }
        assert_eq!(
            HttpLeaseStore::new("http://127.0.0.1:7700/")
                .unwrap()
                .base_url(),
            "http://127.0.0.1:7700"
        );
    }
}
