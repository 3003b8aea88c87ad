//! A lease store that is a `fence server` elsewhere, over its HTTP API.
//!
//! Every decision is one HTTP call of the lease API, and the server's clock decides.

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use fence_core::{
    JobId, Owner, Problem, ProblemType,
    lease_api::{
        Action, CheckpointRequest, ClaimRequest, FinishRequest, ListBody, ListQuery, RecordBody,
        RenewRequest, RevokeRequest, SemaphoreClaimRequest, SlotBody, lease_path,
        semaphore_claim_path, slot_of,
    },
    secret::LeaseKey,
};
use http::{
    HeaderValue, Method, Request, StatusCode,
    header::{AUTHORIZATION, CONTENT_TYPE},
};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};

mod answers;
mod connect;
mod url;

use answers::{decode, from_body, grant, granted_slot, record, refused, unexpected};
use connect::{Budgeted, MAX_CONNECT_SHARE};
pub use url::UrlError;

use super::{
    ClaimTerms, LeaseOp, LeaseRecord, LeaseStore, ListPage, Outcome, Revocation, SlotClaim,
    StoreError, bearer::BearerToken,
};

/// The lease API of a `fence server`, as a [`LeaseStore`], over `http://` or `https://`.
///
/// ```no_run
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use fence_lease::{BearerToken, HttpLeaseStore, HttpOptions, LeaseClient};
///
/// let options = HttpOptions {
///     bearer: Some(BearerToken::new(std::env::var("FENCE_AUTH_TOKEN")?)?),
///     ..HttpOptions::default()
/// };
/// let store = HttpLeaseStore::with_options("https://leases.internal:7700", options)?;
/// let lease = LeaseClient::new(store).claim("invoice-42".parse()?).await?;
/// # Ok(()) }
/// ```
///
/// Several servers that share one database act as one lease service: give their URLs
/// separated by commas (`http://a:7700,http://b:7700`). A call goes to the server that
/// answered last; it moves on to the next only when a connection could not be made (refused,
/// unreachable, TLS handshake failed, or none of these done within the attempt's share of the
/// timeout, at most 2 s), never once a request may have reached a server, so no decision is
/// ever asked of two servers.
#[derive(Debug, Clone)]
pub struct HttpLeaseStore {
    /// What was given, for messages: one URL or several, comma-separated.
    base: String,
    /// Each server's base URL, without a trailing slash.
    servers: Arc<[String]>,
    /// The index of the server that answered last.
    preferred: Arc<AtomicUsize>,
    client: Client<Budgeted<HttpsConnector<HttpConnector>>, Full<Bytes>>,
    bearer: Option<HeaderValue>,
    timeout: Duration,
}

/// How [`HttpLeaseStore`] talks to its server.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Trust only this CA (PEM) for `https://` servers, instead of the system's roots.
    pub ca_cert: Option<PathBuf>,
    /// Send this secret as `Authorization: Bearer` (a server with `--auth-file` needs it).
    pub bearer: Option<BearerToken>,
    /// Give each call this long (default 10 s; `Duration::MAX`: no limit).
    pub timeout: Duration,
}

impl Default for HttpOptions {
    fn default() -> Self {
        Self {
            ca_cert: None,
            bearer: None,
            timeout: Duration::from_secs(10),
        }
    }
}

/// The largest answer the client reads from a server.
const MAX_ANSWER: usize = fence_core::lease_api::MAX_CHECKPOINT_BODY + 4096;

impl HttpLeaseStore {
    /// A store at `base_url` (`http://host:port` or `https://host:port`, verified against
    /// the system's roots), with a 10 s timeout per call and no bearer secret.
    ///
    /// # Errors
    /// When `base_url` is not such a URL.
    pub fn new(base_url: &str) -> Result<Self, UrlError> {
        Self::with_options(base_url, HttpOptions::default())
    }

    /// A store at `base_url` with `options`: one URL, or several separated by commas for
    /// servers that share one database (see [`HttpLeaseStore`] for when a call moves on).
    ///
    /// # Errors
    /// When an entry of `base_url` is not an `http://` or `https://` URL with a host, or TLS
    /// cannot be set up from `options.ca_cert`.
    pub fn with_options(base_url: &str, options: HttpOptions) -> Result<Self, UrlError> {
        let (servers, any_https) = url::servers(base_url)?;
        let tls_error = |source| UrlError::Tls {
            url: base_url.to_owned(), // with no @ (see `url::servers`)
            source,
        };
        // Roots are read only when needed: an http:// store needs none on the machine.
        let tls = if any_https {
            fence_storage::tls::client_config(options.ca_cert.as_deref(), &[]).map_err(tls_error)?
        } else {
            fence_storage::tls::encrypt_only_config().map_err(tls_error)?
        };
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        // Connection attempts, TLS handshake included, end at the budget each call sets (see
        // `send_within`): a server that takes the connection but never answers the handshake
        // (a stopped process) is passed over like one that never answers a SYN. Nothing of
        // the request is sent before the handshake ends, so moving on is safe.
        let client = Client::builder(TokioExecutor::new()).build(Budgeted(connector));
        let bearer = options.bearer.map(|b| {
            let mut value = HeaderValue::from_str(&format!("Bearer {}", b.expose()))
                .unwrap_or(HeaderValue::from_static("Bearer"));
            value.set_sensitive(true);
            value
        });
        Ok(Self {
            base: servers.join(","),
            servers: servers.into(),
            preferred: Arc::new(AtomicUsize::new(0)),
            client,
            bearer,
            timeout: options.timeout,
        })
    }

    /// Gives each call `timeout` instead of what it had.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The server's base URL (the servers', comma-separated, when several were given).
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
        let path = lease_path(job, action);
        self.send(&path, body).await
    }

    /// One call of the lease API at `path` (with its query): `POST` of `body`, or `GET`.
    ///
    /// # Errors
    /// As [`call`](Self::call).
    pub async fn send(
        &self,
        path: &str,
        body: Option<&impl serde::Serialize>,
    ) -> Result<(StatusCode, Bytes), StoreError> {
        self.send_within(path, body, self.timeout).await
    }

    /// [`send`](Self::send) with its own timeout.
    async fn send_within(
        &self,
        path: &str,
        body: Option<&impl serde::Serialize>,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), StoreError> {
        let body = match body {
            Some(v) => Some(Bytes::from(serde_json::to_vec(v).map_err(StoreError::io)?)),
            None => None,
        };
        let request = |server: &str| {
            let mut req = Request::builder().uri(format!("{server}{path}"));
            if let Some(bearer) = &self.bearer {
                req = req.header(AUTHORIZATION, bearer.clone());
            }
            let body = match &body {
                Some(bytes) => {
                    req = req
                        .method(Method::POST)
                        .header(CONTENT_TYPE, "application/json");
                    Full::new(bytes.clone())
                }
                None => Full::new(Bytes::new()),
            };
            req.body(body).map_err(StoreError::io)
        };
        let deadline = crate::later(tokio::time::Instant::now(), timeout);
        let exchange = async {
            let n = self.servers.len();
            let first = self.preferred.load(Ordering::Relaxed) % n;
            let mut tried = 0;
            let resp = loop {
                let i = (first + tried) % n;
                // A silent server must not use up the call while others are left to try:
                // its share of what is left, at most 2 s; the last one may take it all.
                let left_to_try = u32::try_from(n - tried).unwrap_or(u32::MAX);
                let budget = (left_to_try > 1).then(|| {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    (left / left_to_try).min(MAX_CONNECT_SHARE)
                });
                let sent = connect::within(budget, self.client.request(request(&self.servers[i])?));
                match sent.await {
                    Ok(resp) => {
                        if tried > 0 {
                            self.preferred.store(i, Ordering::Relaxed);
                        }
                        break resp;
                    }
                    // No connection was made, so no request reached this server: the next
                    // one may be asked. Any other failure may have reached it: never.
                    Err(e) if e.is_connect() && tried + 1 < n => tried += 1,
                    Err(e) => return Err(StoreError::io(e)),
                }
            };
            let status = resp.status();
            let retry_after = resp.headers().get(http::header::RETRY_AFTER).cloned();
            let bytes = Limited::new(resp.into_body(), MAX_ANSWER)
                .collect()
                .await
                .map_err(StoreError::Io)?
                .to_bytes();
            let refused = answers::unavailable(status, retry_after.as_ref(), &bytes)
                .or_else(|| answers::crowded(status, retry_after.as_ref(), &bytes));
            match refused {
                Some(refused) => Err(refused),
                None => Ok((status, bytes)),
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .map_err(|_| StoreError::Timeout(timeout))?
    }
}

impl HttpLeaseStore {
    /// [`LeaseOp::Revoke`] with a reason for the server's log. Needs a bearer secret allowed
    /// to revoke when the server has an auth file.
    ///
    /// # Errors
    /// As [`LeaseStore::apply`]: the server unreachable, refusing this client, or answering
    /// something else than the contract.
    pub async fn revoke(&self, job: &JobId, reason: Option<String>) -> Result<Outcome, StoreError> {
        let body = RevokeRequest { reason };
        let (status, bytes) = self.call(job, Some(Action::Revoke), Some(&body)).await?;
        match status {
            StatusCode::OK => {
                let body: RecordBody = decode(status, &bytes)?;
                // A signed token says when the revoked lease ends (the contract's token parser).
                let expires_at_ms = body
                    .token
                    .as_deref()
                    .and_then(|t| fence_core::headers::parse_token(t.as_bytes()).ok())
                    .and_then(|(_, signed)| signed)
                    .map(|s| s.expires_at_ms);
                let token = body.token.clone();
                Ok(Outcome::Revoked(Revocation {
                    record: from_body(body),
                    expires_at_ms,
                    token,
                }))
            }
            StatusCode::CONFLICT | StatusCode::GONE | StatusCode::NOT_FOUND => {
                refused(status, &bytes)
            }
            _ => Err(unexpected(status, &bytes)),
        }
    }
}

impl LeaseStore for HttpLeaseStore {
    /// The server decides for every client that reaches it.
    fn is_shared(&self) -> bool {
        true
    }

    /// The server's waiting claim (`?wait=`), as long as the server allows (60 s) per
    /// request; a longer wait asks again with what is left. Waiting places full (429) it asks
    /// again after `Retry-After` (1 s) within the wait, which ends so, the job still held at a
    /// last plain claim, as [`StoreError::TooManyWaiters`]: the caller can say why.
    async fn claim_waiting(
        &self,
        job: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        wait: Duration,
    ) -> Result<Outcome, StoreError> {
        const MOST: Duration = Duration::from_secs(60);
        const MIN_PAUSE: Duration = Duration::from_millis(50);
        let end = crate::later(tokio::time::Instant::now(), wait);
        // The server's last answer, when it had no waiting place for this claim.
        let mut crowded = None;
        loop {
            let left = end.saturating_duration_since(tokio::time::Instant::now());
            let this = left.min(MOST);
            if this.is_zero() {
                let last = self.apply(job, terms.op(owner, key)).await?;
                // Held by a holder: the full places were why it could not wait (a lock-delay
                // is its own answer).
                let held = matches!(last, Outcome::Held { lock_delay, .. } if !lock_delay);
                return crowded.filter(|_| held).map_or(Ok(last), Err);
            }
            let body = ClaimRequest {
                owner: owner.clone(),
                lease_key: key.clone(),
                ttl: terms.ttl,
                lock_delay: terms.lock_delay,
            };
            let path = format!(
                "{}?wait={}ms",
                lease_path(job, Some(Action::Claim)),
                this.as_millis()
            );
            let asked = tokio::time::Instant::now();
            let (status, bytes) = match self
                .send_within(&path, Some(&body), self.timeout.saturating_add(this))
                .await
            {
                Err(full @ StoreError::TooManyWaiters { retry_after, .. }) => {
                    let pause = retry_after.unwrap_or(Duration::from_secs(1)).max(MIN_PAUSE);
                    tokio::time::sleep_until((asked + pause).min(end)).await;
                    crowded = Some(full);
                    continue;
                }
                answered => answered?,
            };
            crowded = None;
            let outcome = match status {
                StatusCode::OK => Outcome::Granted(grant(status, &bytes)?),
                StatusCode::CONFLICT | StatusCode::GONE => refused(status, &bytes)?,
                _ => return Err(unexpected(status, &bytes)),
            };
            // Still held: ask again with what is left, also when the server held the claim
            // for less than asked (its --max-claim-wait); never more than 20 times a second.
            let now = tokio::time::Instant::now();
            if !matches!(outcome, Outcome::Held { .. }) || now >= end {
                return Ok(outcome);
            }
            let pause = (asked + MIN_PAUSE).min(end);
            if pause > now {
                tokio::time::sleep_until(pause).await;
            }
        }
    }

    async fn apply(&self, job: &JobId, op: LeaseOp) -> Result<Outcome, StoreError> {
        // What no server takes is refused here, as every store refuses it.
        op.check(job)?;
        // A claim or renewal answers a lease; a release or completion, the record.
        let grants = matches!(op, LeaseOp::Claim { .. } | LeaseOp::Renew { .. });
        let finish = if matches!(op, LeaseOp::Complete { .. }) {
            Action::Complete
        } else {
            Action::Release
        };
        let (status, bytes) = match op {
            LeaseOp::Claim {
                owner,
                key,
                ttl,
                lock_delay,
            } => {
                let body = ClaimRequest {
                    owner,
                    lease_key: key,
                    ttl,
                    lock_delay,
                };
                self.call(job, Some(Action::Claim), Some(&body)).await?
            }
            LeaseOp::Renew {
                owner,
                generation,
                key,
                ttl,
            } => {
                let body = RenewRequest {
                    owner,
                    generation,
                    lease_key: key,
                    ttl,
                };
                self.call(job, Some(Action::Renew), Some(&body)).await?
            }
            LeaseOp::Release {
                owner,
                generation,
                key,
            }
            | LeaseOp::Complete {
                owner,
                generation,
                key,
            } => {
                let action = finish;
                let body = FinishRequest {
                    owner,
                    generation,
                    lease_key: key,
                };
                self.call(job, Some(action), Some(&body)).await?
            }
            LeaseOp::Checkpoint {
                owner,
                generation,
                key,
                data,
            } => {
                let body = CheckpointRequest {
                    owner,
                    generation,
                    lease_key: key,
                    checkpoint: data,
                };
                self.call(job, Some(Action::Checkpoint), Some(&body))
                    .await?
            }
            LeaseOp::Revoke => return self.revoke(job, None).await,
        };
        match status {
            StatusCode::OK if grants => Ok(Outcome::Granted(grant(status, &bytes)?)),
            StatusCode::OK => Ok(Outcome::Done(record(status, &bytes)?)),
            StatusCode::CONFLICT | StatusCode::GONE | StatusCode::FORBIDDEN => {
                refused(status, &bytes)
            }
            _ => Err(unexpected(status, &bytes)),
        }
    }

    /// `POST /v1/semaphores/{resource}/claim`.
    async fn claim_slot(
        &self,
        resource: &JobId,
        owner: &Owner,
        key: &LeaseKey,
        terms: ClaimTerms,
        slots: u32,
    ) -> Result<SlotClaim, StoreError> {
        super::check_slot_claim(resource, slots).map_err(super::refused_before_sending)?;
        let body = SemaphoreClaimRequest {
            claim: ClaimRequest {
                owner: owner.clone(),
                lease_key: key.clone(),
                ttl: terms.ttl,
                lock_delay: terms.lock_delay,
            },
            slots,
        };
        let path = semaphore_claim_path(resource);
        let (status, bytes) = self.send(&path, Some(&body)).await?;
        if status == StatusCode::OK {
            let answer: SlotBody = decode(status, &bytes)?;
            return Ok(SlotClaim {
                slot: Some(granted_slot(resource, slots, &answer)?),
                outcome: Outcome::Granted(grant(status, &bytes)?),
            });
        }
        if !matches!(status, StatusCode::CONFLICT | StatusCode::GONE) {
            return Err(unexpected(status, &bytes));
        }
        let outcome = refused(status, &bytes)?;
        // A refusal names the slot it is about (the one that frees first), if any.
        let slot = serde_json::from_slice::<Problem>(&bytes)
            .ok()
            .and_then(|p| p.job)
            .and_then(|job| {
                slot_of(&job).and_then(|(of, slot)| (of == resource.as_str()).then_some(slot))
            });
        Ok(SlotClaim { slot, outcome })
    }

    async fn list(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let path = format!("/v1/leases?{}", query.to_query());
        let (status, bytes) = self.send(&path, None::<&()>).await?;
        if status != StatusCode::OK {
            return Err(unexpected(status, &bytes));
        }
        let body: ListBody = decode(status, &bytes)?;
        Ok(ListPage {
            leases: body.leases.into_iter().map(from_body).collect(),
            next: body.next,
        })
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
        for bad in ["", "127.0.0.1:7700", "ftp://x", "http://", "https://"] {
            assert!(HttpLeaseStore::new(bad).is_err(), "{bad}");
        }
        assert_eq!(
            HttpLeaseStore::new("http://127.0.0.1:7700/")
                .unwrap()
                .base_url(),
            "http://127.0.0.1:7700"
        );
        let two = HttpLeaseStore::new("http://a:7700/, https://b:7700").unwrap();
        assert_eq!(two.base_url(), "http://a:7700,https://b:7700");
        for bad in ["http://a:7700,", "http://a:7700,ftp://b", ",http://a"] {
            assert!(HttpLeaseStore::new(bad).is_err(), "{bad}");
        }
    }

    /// A URL with a user or password is refused, and the refusal does not quote the
    /// password, whatever the password holds (a `/`, a comma, a bad percent sign).
    #[test]
    fn a_url_with_credentials_is_refused_and_no_error_quotes_them() {
        for url in [
            "http://ops:hunter2-secret@127.0.0.1:7700",
            "https://hunter2-secret@leases.internal",
            "http://a:7700, http://ops:hunter2-secret@b:7700/path",
            "ftp://ops:hunter2-secret@b",
            "http://ops:hunter2-secret@b:notaport",
            "http://ops:pa/hunter2-secret@127.0.0.1:7700",
            "ftp://ops:pa/hunter2-secret@b/x",
        ] {
            let Err(e) = HttpLeaseStore::new(url) else {
                panic!("{url} was taken");
            };
            let said = format!("{e} {e:?}");
            assert!(!said.contains("hunter2"), "{url}: {said}");
        }
        // A password with a comma: the first entry alone has no @, and quoted whole, it was
        // the password's first half.
        for url in ["http://ops:hunter2,x@h", "http://ops:hunter2%w,d@h"] {
            let e = HttpLeaseStore::new(url).err().map(|e| e.to_string());
            assert!(
                e.as_ref().is_some_and(|e| !e.contains("hunter2")),
                "{url}: {e:?}"
            );
        }
        let e = HttpLeaseStore::new("http://ops:hunter2-secret@127.0.0.1:7700/x").unwrap_err();
        assert!(
            matches!(&e, UrlError::Credentials { url } if url == "http://…@127.0.0.1:7700/x"),
            "{e:?}"
        );
    }
}
