//! A lease store that is a `fence server` elsewhere: every verb is one HTTP call of the lease
//! API, and the server's clock decides.

use std::time::Duration;

use bytes::Bytes;
use fence_core::{
    Generation, JobId, Owner, Problem, ProblemType,
    lease_api::{LeaseBody, RecordBody, lease_path},
};
use http::{Method, Request, StatusCode, Uri, header::CONTENT_TYPE};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

use super::{
    ClaimOutcome, FinishOutcome, Grant, LeaseRecord, LeaseState, LeaseStore, RenewOutcome,
    StoreError,
};
use crate::Ttl;

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

/// The largest answer the client reads from a server.
const MAX_ANSWER: usize = 64 * 1024;

impl HttpLeaseStore {
    /// A store at `base_url` (`http://host:port`), with a 10 s timeout per call.
    ///
    /// # Errors
    /// When `base_url` is not an `http://` URL with a host.
    pub fn new(base_url: &str) -> Result<Self, StoreError> {
        let trimmed = base_url.trim_end_matches('/');
        let uri: Uri = trimmed
            .parse()
            .map_err(|e| StoreError::Protocol(format!("invalid server URL {base_url:?}: {e}")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(StoreError::Protocol(format!(
                "invalid server URL {base_url:?}: expected http://host:port (https is not supported)"
            )));
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

    async fn call(
        &self,
        method: Method,
        job: &JobId,
        op: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(StatusCode, Bytes), StoreError> {
        let uri = format!("{}{}", self.base, lease_path(job, op));
        let mut req = Request::builder().method(method).uri(uri);
        let body = match body {
            Some(v) => {
                req = req.header(CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::new(Bytes::new()),
        };
        let req = req
            .body(body)
            .map_err(|e| StoreError::Protocol(e.to_string()))?;
        let exchange = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| StoreError::Io(Box::new(e)))?;
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

fn problem(status: StatusCode, body: &[u8], kind: ProblemType) -> Result<Problem, StoreError> {
    match serde_json::from_slice::<Problem>(body) {
        Ok(p) if p.kind == kind => Ok(p),
        _ => Err(unexpected(status, body)),
    }
}

fn grant(status: StatusCode, body: &[u8]) -> Result<Grant, StoreError> {
    let lease: LeaseBody = decode(status, body)?;
    let ttl = Ttl::from_millis(lease.ttl_ms)
        .map_err(|e| StoreError::Protocol(format!("server granted an invalid ttl: {e}")))?;
    Ok(Grant {
        generation: Generation::new(lease.generation),
        ttl,
        expires_at_ms: lease.expires_at_ms,
        token: lease.token,
    })
}

fn lost(status: StatusCode, body: &[u8]) -> Result<(Option<Owner>, Generation), StoreError> {
    let p = problem(status, body, ProblemType::LeaseLost)?;
    Ok((p.owner, Generation::new(p.generation.unwrap_or(0))))
}

pub(crate) fn record(status: StatusCode, body: &[u8]) -> Result<LeaseRecord, StoreError> {
    let r: RecordBody = decode(status, body)?;
    let state = match r.state.as_str() {
        "free" => LeaseState::Free,
        "held" => LeaseState::Held,
        "expired" => LeaseState::Expired,
        "completed" => LeaseState::Completed,
        other => {
            return Err(StoreError::Protocol(format!(
                "unknown lease state {other:?}"
            )));
        }
    };
    Ok(LeaseRecord {
        job: r.job,
        owner: r.owner,
        generation: Generation::new(r.generation),
        state,
        expires_in: Duration::from_millis(r.expires_in_ms),
    })
}

impl LeaseStore for HttpLeaseStore {
    async fn claim(
        &self,
        job: &JobId,
        owner: &Owner,
        ttl: Ttl,
    ) -> Result<ClaimOutcome, StoreError> {
        let body = serde_json::json!({ "owner": owner, "ttl_ms": ttl.as_millis() });
        let (status, bytes) = self.call(Method::POST, job, "claim", Some(body)).await?;
        match status {
            StatusCode::OK => Ok(ClaimOutcome::Granted(grant(status, &bytes)?)),
            StatusCode::CONFLICT => {
                let p = problem(status, &bytes, ProblemType::LeaseHeld)?;
                let holder = p
                    .owner
                    .ok_or_else(|| StoreError::Protocol("lease-held without an owner".into()))?;
                Ok(ClaimOutcome::Held {
                    owner: holder,
                    expires_in: Duration::from_millis(p.expires_in_ms.unwrap_or(0)),
                })
            }
            StatusCode::GONE => {
                let p = problem(status, &bytes, ProblemType::JobCompleted)?;
                Ok(ClaimOutcome::Completed {
                    owner: p.owner,
                    generation: Generation::new(p.generation.unwrap_or(0)),
                })
            }
            _ => Err(unexpected(status, &bytes)),
        }
    }

    async fn renew(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        ttl: Ttl,
    ) -> Result<RenewOutcome, StoreError> {
        let body = serde_json::json!({ "owner": owner, "generation": generation.get(), "ttl_ms": ttl.as_millis() });
        let (status, bytes) = self.call(Method::POST, job, "renew", Some(body)).await?;
        match status {
            StatusCode::OK => Ok(RenewOutcome::Renewed(grant(status, &bytes)?)),
            StatusCode::CONFLICT => {
                let (owner, generation) = lost(status, &bytes)?;
                Ok(RenewOutcome::Lost { owner, generation })
            }
            _ => Err(unexpected(status, &bytes)),
        }
    }

    async fn release(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.finish(job, owner, generation, "release").await
    }

    async fn complete(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
    ) -> Result<FinishOutcome, StoreError> {
        self.finish(job, owner, generation, "complete").await
    }

    async fn get(&self, job: &JobId) -> Result<Option<LeaseRecord>, StoreError> {
        let (status, bytes) = self.call(Method::GET, job, "", None).await?;
        match status {
            StatusCode::OK => Ok(Some(record(status, &bytes)?)),
            StatusCode::NOT_FOUND => {
                problem(status, &bytes, ProblemType::UnknownJob)?;
                Ok(None)
            }
            _ => Err(unexpected(status, &bytes)),
        }
    }
}

impl HttpLeaseStore {
    async fn finish(
        &self,
        job: &JobId,
        owner: &Owner,
        generation: Generation,
        op: &str,
    ) -> Result<FinishOutcome, StoreError> {
        let body = serde_json::json!({ "owner": owner, "generation": generation.get() });
        let (status, bytes) = self.call(Method::POST, job, op, Some(body)).await?;
        match status {
            StatusCode::OK => Ok(FinishOutcome::Done(record(status, &bytes)?)),
            StatusCode::CONFLICT => {
                let (owner, generation) = lost(status, &bytes)?;
                Ok(FinishOutcome::Lost { owner, generation })
            }
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
