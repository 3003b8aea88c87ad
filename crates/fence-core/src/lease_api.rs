//! The lease server's HTTP API as types: paths, request and answer bodies, lease states.
//!
//! Servers parse request bodies with [`ClaimRequest::from_json`] and friends, which refuse
//! anything but the contract's fields and name the field that is wrong; clients serialise the
//! same types with serde, so both ends agree on every field by construction.
//!
//! ```
//! use fence_core::{Ttl, lease_api::{Action, ClaimRequest, lease_path}, secret::LeaseKey};
//!
//! let job = "invoice-42".parse()?;
//! assert_eq!(lease_path(&job, Some(Action::Claim)), "/v1/leases/invoice-42/claim");
//! let lease_key = LeaseKey::from_random(&[9; 32]); // from the OS's random source, really
//! let body = ClaimRequest { owner: "worker-a".parse()?, lease_key, ttl: Ttl::from_millis(10_000)?, lock_delay: None };
//! let json = serde_json::to_vec(&body)?;
//! assert_eq!(ClaimRequest::from_json(&json)?, body);
//! let err = ClaimRequest::from_json(br#"{"owner": "w", "lease_key": "short"}"#).unwrap_err();
//! assert_eq!(err.to_string(), "lease_key: must be 22 to 128 base64url characters, got 5");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Generation, JobId, Owner, Ttl, secret::LeaseKey};

mod checkpoint;
mod claim;
mod revoke;
mod semaphore;
mod wait;
pub use checkpoint::{
    Checkpoint, CheckpointRequest, DEFAULT_MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_BODY,
    MAX_CHECKPOINT_BYTES,
};
pub use claim::ClaimRequest;
pub use revoke::{MAX_REASON_LEN, RevokeRequest};
pub use semaphore::{
    MAX_RESOURCE_LEN, MAX_SLOTS, ResourceError, SLOT_SEPARATOR, SemaphoreClaimRequest, SlotBody,
    check_resource, reserved, slot_job, slot_of,
};
pub use wait::{MAX_WAIT_MS, WAIT_PATTERN, parse_wait};

/// The largest request body a lease server reads, in bytes.
pub const MAX_REQUEST_BODY: usize = 16 * 1024;

/// An operation on a held lease, and the last segment of its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// `POST /v1/leases/{job}/claim`.
    Claim,
    /// `POST /v1/leases/{job}/renew`.
    Renew,
    /// `POST /v1/leases/{job}/release`.
    Release,
    /// `POST /v1/leases/{job}/complete`.
    Complete,
    /// `POST /v1/leases/{job}/revoke` (an operator's; contract section 11).
    Revoke,
    /// `POST /v1/leases/{job}/checkpoint` (the holder saves its progress; section 14).
    Checkpoint,
}

impl Action {
    /// The action a path segment names.
    pub fn parse(segment: &str) -> Option<Self> {
        match segment {
            "claim" => Some(Self::Claim),
            "renew" => Some(Self::Renew),
            "release" => Some(Self::Release),
            "complete" => Some(Self::Complete),
            "revoke" => Some(Self::Revoke),
            "checkpoint" => Some(Self::Checkpoint),
            _ => None,
        }
    }

    /// The path segment: `claim`, `renew`, `release`, `complete` or `revoke`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Renew => "renew",
            Self::Release => "release",
            Self::Complete => "complete",
            Self::Revoke => "revoke",
            Self::Checkpoint => "checkpoint",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The path of a semaphore claim, `/v1/semaphores/{resource}/claim`, with the resource
/// percent-encoded (contract section 15).
pub fn semaphore_claim_path(resource: &JobId) -> String {
    format!("/v1/semaphores/{}/claim", percent_encode(resource.as_str()))
}

/// The path of a lease operation, `/v1/leases/{job}` plus `/claim`, `/renew`, `/release` or
/// `/complete` (none for the job's record), with the job id percent-encoded.
pub fn lease_path(job: &JobId, action: Option<Action>) -> String {
    let mut path = String::from("/v1/leases/");
    path.push_str(&percent_encode(job.as_str()));
    if let Some(action) = action {
        path.push('/');
        path.push_str(action.as_str());
    }
    path
}

/// A request body the server refuses: `field: what is wrong`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct BodyError {
    /// The field, or `body` for the body as a whole.
    pub field: String,
    /// What is wrong with it.
    pub reason: String,
}

impl BodyError {
    fn new(field: impl Into<String>, reason: impl fmt::Display) -> Self {
        Self {
            field: field.into(),
            reason: reason.to_string(),
        }
    }

    /// About a field or parameter the request named: shown as given when it is visible
    /// ASCII, else quoted and escaped (`"a\nb"`), so that no name can break a log line in
    /// two or forge one.
    fn given(name: &str, reason: impl fmt::Display) -> Self {
        let plain = name
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\');
        if plain {
            Self::new(name, reason)
        } else {
            Self::new(format!("{name:?}"), reason)
        }
    }
}

/// A JSON object holding only the fields a request may have.
struct Fields(Map<String, Value>);

/// A top-level JSON object whose keys are each given once: a repeated one is refused rather
/// than read as the last (strict bodies, docs/protocol.md section 4).
struct UniqueObject(Result<Map<String, Value>, String>);

impl<'de> serde::Deserialize<'de> for UniqueObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = UniqueObject;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut access: A,
            ) -> Result<UniqueObject, A::Error> {
                let mut map = Map::new();
                let mut repeated = None;
                while let Some((key, value)) = access.next_entry::<String, Value>()? {
                    if map.contains_key(&key) {
                        repeated.get_or_insert(key);
                    } else {
                        map.insert(key, value);
                    }
                }
                Ok(UniqueObject(repeated.map_or(Ok(map), Err)))
            }
        }
        d.deserialize_any(Visit)
    }
}

/// A JSON number that is a whole number from 0 to 2^64-1: `7`, and also `7.0` as JSON
/// Schema's `integer` admits it, but a number written with a fraction or an exponent only
/// below 2^53, where it is exactly the integer its text says (`9007199254740993.0` is not
/// read as ...992). Above that, such a number is refused although JSON Schema would call it
/// an integer: exactness of a generation matters more (docs/protocol.md section 4).
fn whole_number(n: &serde_json::Number) -> Option<u64> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    n.as_u64().or_else(|| {
        n.as_f64()
            .filter(|f| f.fract() == 0.0 && (0.0..EXACT).contains(f))
            // In range and whole, so the cast is exact.
            .map(|f| f as u64)
    })
}

impl Fields {
    fn parse(bytes: &[u8], allowed: &[&str]) -> Result<Self, BodyError> {
        let object: UniqueObject = serde_json::from_slice(bytes).map_err(|e| {
            if e.is_data() {
                BodyError::new("body", "must be a JSON object")
            } else {
                BodyError::new("body", format!("not valid JSON: {e}"))
            }
        })?;
        let map = object
            .0
            .map_err(|key| BodyError::given(&key, "given twice; each field at most once"))?;
        if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(BodyError::given(
                unknown,
                format!("unknown field; allowed: {}", allowed.join(", ")),
            ));
        }
        Ok(Self(map))
    }

    fn owner(&self) -> Result<Owner, BodyError> {
        match self.0.get("owner") {
            None => Err(BodyError::new("owner", "missing")),
            Some(Value::String(s)) => {
                Owner::new(s.as_str()).map_err(|e| BodyError::new("owner", e))
            }
            Some(_) => Err(BodyError::new("owner", "must be a string")),
        }
    }

    fn lease_key(&self) -> Result<LeaseKey, BodyError> {
        match self.0.get("lease_key") {
            None => Err(BodyError::new("lease_key", "missing")),
            Some(Value::String(s)) => LeaseKey::new(s).map_err(|e| BodyError::new("lease_key", e)),
            Some(_) => Err(BodyError::new("lease_key", "must be a string")),
        }
    }

    fn u64(&self, field: &str) -> Result<Option<u64>, BodyError> {
        match self.0.get(field) {
            None => Ok(None),
            Some(Value::Number(n)) => whole_number(n).map(Some).ok_or_else(|| {
                BodyError::new(
                    field,
                    format!("must be an integer from 0 to 18446744073709551615, got {n}"),
                )
            }),
            Some(_) => Err(BodyError::new(field, "must be an integer")),
        }
    }

    fn generation(&self) -> Result<Generation, BodyError> {
        self.u64("generation")?
            .map(Generation::new)
            .ok_or_else(|| BodyError::new("generation", "missing"))
    }

    fn ttl(&self) -> Result<Ttl, BodyError> {
        match self.0.get("ttl_ms") {
            None => Ok(Ttl::DEFAULT),
            Some(Value::Number(n)) => match whole_number(n) {
                Some(ms) => Ttl::from_millis(ms).map_err(|e| BodyError::new("ttl_ms", e)),
                None => Err(BodyError::new(
                    "ttl_ms",
                    format!(
                        "must be an integer from {} to {} (milliseconds), got {n}",
                        Ttl::MIN.as_millis(),
                        Ttl::MAX.as_millis()
                    ),
                )),
            },
            Some(_) => Err(BodyError::new("ttl_ms", "must be an integer")),
        }
    }
}

/// `POST /v1/leases/{job}/renew`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RenewRequest {
    /// The holder.
    pub owner: Owner,
    /// The generation it holds.
    pub generation: Generation,
    /// The key it claimed with.
    pub lease_key: LeaseKey,
    /// How long the lease should last from now (`ttl_ms`; 30 s when left out).
    #[serde(rename = "ttl_ms")]
    pub ttl: Ttl,
}

impl RenewRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "generation", "lease_key", "ttl_ms"])?;
        Ok(Self {
            owner: f.owner()?,
            generation: f.generation()?,
            lease_key: f.lease_key()?,
            ttl: f.ttl()?,
        })
    }
}

/// `POST /v1/leases/{job}/release` and `/complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FinishRequest {
    /// The holder.
    pub owner: Owner,
    /// The generation it holds.
    pub generation: Generation,
    /// The key it claimed with.
    pub lease_key: LeaseKey,
}

impl FinishRequest {
    /// Parses a request body, strictly.
    ///
    /// # Errors
    /// When it is not a JSON object of exactly these fields with valid values.
    pub fn from_json(bytes: &[u8]) -> Result<Self, BodyError> {
        let f = Fields::parse(bytes, &["owner", "generation", "lease_key"])?;
        Ok(Self {
            owner: f.owner()?,
            generation: f.generation()?,
            lease_key: f.lease_key()?,
        })
    }
}

/// A granted lease: the answer to a successful claim or renewal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseBody {
    /// The job.
    pub job: JobId,
    /// The holder.
    pub owner: Owner,
    /// The generation: the fencing token.
    pub generation: Generation,
    /// The duration granted.
    pub ttl_ms: u64,
    /// When it expires on the server's clock, in ms since the Unix epoch.
    pub expires_at_ms: u64,
    /// The signed token string, when the server signs tokens (contract section 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// A claim's answer: the job's last checkpoint and the generation that saved it, if any
    /// (contract section 14).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<Checkpoint>,
}

/// The state of a job's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum LeaseState {
    /// Never claimed, or released: nobody holds it.
    Free,
    /// An unexpired lease.
    Held,
    /// The lease ran out and nobody has claimed since.
    Expired,
    /// Completed; it can never be claimed again.
    Completed,
}

impl LeaseState {
    /// The contract's name: `free`, `held`, `expired` or `completed`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Free => "free",
            Self::Held => "held",
            Self::Expired => "expired",
            Self::Completed => "completed",
        }
    }
}

impl fmt::Display for LeaseState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A job's lease record: the answer to release, complete and status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordBody {
    /// The job.
    pub job: JobId,
    /// The holder, last holder or completer; null when free.
    pub owner: Option<Owner>,
    /// The generation of the last claim.
    pub generation: Generation,
    /// The state.
    pub state: LeaseState,
    /// How long the lease has left (0 unless held).
    pub expires_in_ms: u64,
    /// Only in a revoke's answer from a server that signs tokens: the signed token of the
    /// raised generation, for `fence revoke --sink` to push to sinks (contract section 11).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// `GET /v1/leases?state=S&prefix=P&after=JOB&limit=N`: a page of leases in job id order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListQuery {
    /// Only leases in this state.
    pub state: Option<LeaseState>,
    /// Only jobs whose id starts with this.
    pub prefix: Option<String>,
    /// Only jobs after this one (the previous page's `next`).
    pub after: Option<JobId>,
    /// At most this many leases: 1 to [`MAX_LIST_LIMIT`], [`DEFAULT_LIST_LIMIT`] when left out.
    pub limit: Option<u16>,
}

/// The most leases one page may hold.
pub const MAX_LIST_LIMIT: u16 = 1_000;
/// How many leases a page holds when the query does not say.
pub const DEFAULT_LIST_LIMIT: u16 = 100;

impl ListQuery {
    /// How many leases the page may hold.
    pub fn limit(&self) -> usize {
        usize::from(self.limit.unwrap_or(DEFAULT_LIST_LIMIT))
    }

    /// Parses a query string (without the `?`), strictly.
    ///
    /// ```
    /// # use fence_core::lease_api::{LeaseState, ListQuery};
    /// let q = ListQuery::from_query("state=held&prefix=inv%2D&limit=10")?;
    /// assert_eq!((q.state, q.prefix.as_deref(), q.limit()), (Some(LeaseState::Held), Some("inv-"), 10));
    /// assert!(ListQuery::from_query("limit=0").is_err());
    /// assert_eq!(ListQuery::from_query(&q.to_query())?, q);
    /// # Ok::<(), fence_core::lease_api::BodyError>(())
    /// ```
    ///
    /// # Errors
    /// On an unknown or repeated parameter, or a value out of range, naming it.
    pub fn from_query(query: &str) -> Result<Self, BodyError> {
        let mut q = Self::default();
        let mut seen: Vec<String> = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, raw) = pair.split_once('=').unwrap_or((pair, ""));
            let key = percent_decode(key, true).map_err(|e| BodyError::new("query", e))?;
            let value = percent_decode(raw, true).map_err(|e| BodyError::given(&key, e))?;
            if seen.contains(&key) {
                return Err(BodyError::given(&key, "given more than once"));
            }
            seen.push(key.clone());
            match key.as_str() {
                "state" => {
                    q.state = Some(
                        serde_json::from_value(Value::String(value.clone())).map_err(|_| {
                            BodyError::new(
                                "state",
                                format!("{value:?} is not free, held, expired or completed"),
                            )
                        })?,
                    );
                }
                "prefix" => {
                    if value.len() > crate::MAX_ID_LEN
                        || value.bytes().any(|b| !(0x21..=0x7e).contains(&b))
                    {
                        return Err(BodyError::new(
                            "prefix",
                            "must be at most 256 bytes of visible ASCII",
                        ));
                    }
                    q.prefix = Some(value);
                }
                "after" => {
                    q.after = Some(JobId::new(value).map_err(|e| BodyError::new("after", e))?);
                }
                "limit" => {
                    q.limit = Some(
                        Some(value.as_str())
                            .filter(|v| v.bytes().all(|b| b.is_ascii_digit()))
                            .and_then(|v| v.parse::<u16>().ok())
                            .filter(|n| (1..=MAX_LIST_LIMIT).contains(n))
                            .ok_or_else(|| {
                                BodyError::new(
                                    "limit",
                                    format!("must be an integer from 1 to {MAX_LIST_LIMIT}, got {value:?}"),
                                )
                            })?,
                    );
                }
                other => {
                    return Err(BodyError::given(
                        other,
                        "unknown parameter; allowed: state, prefix, after, limit",
                    ));
                }
            }
        }
        Ok(q)
    }

    /// The query string (without the `?`) a client sends.
    pub fn to_query(&self) -> String {
        let mut parts = Vec::new();
        if let Some(state) = self.state {
            parts.push(format!("state={state}"));
        }
        if let Some(prefix) = &self.prefix {
            parts.push(format!("prefix={}", percent_encode(prefix)));
        }
        if let Some(after) = &self.after {
            parts.push(format!("after={}", percent_encode(after.as_str())));
        }
        if let Some(limit) = self.limit {
            parts.push(format!("limit={limit}"));
        }
        parts.join("&")
    }
}

/// A page of `GET /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListBody {
    /// The leases, in job id order.
    pub leases: Vec<RecordBody>,
    /// Pass it as `after` for the next page; null when there is none.
    pub next: Option<JobId>,
}

/// Everything but unreserved characters, percent-encoded.
pub(crate) fn percent_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A percent-encoded path segment (a job id in `/v1/leases/{job}` or the proxy's
/// `/v1/fence/{job}`), decoded: `%XX` sequences, no `+` for space.
///
/// # Errors
/// A `%` not followed by two hex digits, or bytes that are not UTF-8 once decoded.
pub fn decode_path_segment(s: &str) -> Result<String, &'static str> {
    percent_decode(s, false)
}

/// One name or value of a query string, decoded: `%XX` sequences, and `+` as a space.
///
/// # Errors
/// A malformed `%` sequence, or bytes that are not UTF-8.
pub fn decode_query_component(s: &str) -> Result<String, &'static str> {
    percent_decode(s, true)
}

/// `%XX` sequences decoded, and `+` as a space when `plus_is_space` (a query).
fn percent_decode(s: &str, plus_is_space: bool) -> Result<String, &'static str> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = bytes
                    .get(i + 1..i + 3)
                    .and_then(|h| std::str::from_utf8(h).ok())
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or("a '%' not followed by two hex digits")?;
                out.push(hex);
                i += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| "not UTF-8 once decoded")
}

#[cfg(test)]
mod tests;
