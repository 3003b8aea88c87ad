//! Idempotency records: fingerprints, stored responses, begin/finish rules and their encoding.
//!
//! The rules of `begin` and `finish` are pure functions shared by every backend that decides
//! in Rust; the byte encoding is sled's.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use sha2::{Digest, Sha256};

use super::{Begin, Finish};

/// SHA-256 over method, path (with query) and body: what makes two requests "the same".
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The fingerprint of a request.
    pub fn of(method: &Method, path_and_query: &str, body: &[u8]) -> Self {
        Self::scoped(method, path_and_query, &[], body)
    }

    /// The fingerprint of a request, with the values of the headers it is scoped by (each
    /// header's values in order; no value at all counts apart from an empty one).
    pub fn scoped(
        method: &Method,
        path_and_query: &str,
        scope: &[Vec<&[u8]>],
        body: &[u8],
    ) -> Self {
        let mut h = Sha256::new();
        h.update(method.as_str().as_bytes());
        h.update([0]);
        h.update(path_and_query.as_bytes());
        h.update([0]);
        h.update(body);
        for values in scope {
            // After the body, with lengths: a fingerprint without scope stays what it was.
            h.update(
                u64::try_from(values.len())
                    .unwrap_or(u64::MAX)
                    .to_be_bytes(),
            );
            for v in values {
                h.update(u64::try_from(v.len()).unwrap_or(u64::MAX).to_be_bytes());
                h.update(v);
            }
        }
        Self(h.finalize().into())
    }
}

impl std::fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…")
    }
}

/// A response kept for replay: status, headers and body, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status.
    pub status: StatusCode,
    /// The headers, in order, repeated ones included.
    pub headers: HeaderMap,
    /// The body.
    pub body: Bytes,
    /// The trailers the body ended with (a gRPC answer's `grpc-status`), if any.
    pub trailers: Option<Box<HeaderMap>>,
}

/// A (job, key) record as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    InFlight {
        fingerprint: Fingerprint,
        until_ms: u64,
        /// The attempt that began it: only that one may finish or forget it (0: written
        /// before attempts were told apart; any attempt with its fingerprint may).
        attempt: u64,
        /// The generation of the token it was admitted with (0: not known).
        generation: u64,
    },
    Done {
        fingerprint: Fingerprint,
        expires_ms: u64,
        response: Option<StoredResponse>,
    },
}

impl Record {
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        match self {
            Self::InFlight { fingerprint, .. } | Self::Done { fingerprint, .. } => fingerprint,
        }
    }

    pub(crate) fn is_live(&self, now_ms: u64) -> bool {
        match self {
            Self::InFlight { until_ms, .. } => now_ms < *until_ms,
            Self::Done { expires_ms, .. } => now_ms < *expires_ms,
        }
    }

    /// Whether it is live at `now`: at its judging time, or in flight while an earlier
    /// process's requests may still run ([`Now::earlier_may_run`]).
    pub(crate) fn is_live_at(&self, now: Now) -> bool {
        (now.earlier_may_run && matches!(self, Self::InFlight { .. })) || self.is_live(now.judge_ms)
    }
}

impl Record {
    /// Whether `attempt` may finish or forget this record: it is in flight, and it began it.
    pub(crate) fn belongs_to(&self, attempt: &super::Attempt<'_>) -> bool {
        match self {
            Self::InFlight {
                attempt: 0,
                fingerprint,
                ..
            } => fingerprint == attempt.fingerprint,
            Self::InFlight { attempt: id, .. } => *id == attempt.id,
            Self::Done { .. } => false,
        }
    }

    /// Whether a newer generation's `attempt` takes this record over: it is in flight for
    /// an older generation, whose request the fence has let go of before admitting the
    /// newer one (it finished, or its unknown outcome's hold ended), so nothing of it can
    /// still be running.
    pub(crate) fn superseded_by(&self, attempt: &super::Attempt<'_>) -> bool {
        // 0: written before generations were kept; its attempt is not known to be over.
        matches!(self, Self::InFlight { generation, .. }
            if *generation != 0 && *generation < attempt.generation.get())
    }
}

/// The in-flight record `attempt` writes when it begins.
pub(crate) fn in_flight(attempt: &super::Attempt<'_>, until_ms: u64) -> Record {
    Record::InFlight {
        fingerprint: *attempt.fingerprint,
        until_ms,
        attempt: attempt.id,
        generation: attempt.generation.get(),
    }
}

/// The time a record is judged and written on: the two differ when a store reads two clocks
/// (the sled store: the wall clock and the wall clock at its open plus the monotonic time
/// since), so that a record lives while either clock says it does. `judge_ms` is the earlier
/// of the two readings, to tell whether a record is live; `stamp_ms` the later, to time a new
/// one from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Now {
    pub(crate) judge_ms: u64,
    pub(crate) stamp_ms: u64,
    /// Every in-flight record is live, whatever its time says: what an earlier process
    /// passed on may still be running at the service (the sled store after a restart, until
    /// the unknown-outcome hold the processes before recorded has passed since its open). A
    /// forward step of the wall clock between a record's begin and the restart would
    /// otherwise expire it at the open while its request can still commit.
    pub(crate) earlier_may_run: bool,
}

impl Now {
    /// One clock: both the same reading.
    pub(crate) fn at(ms: u64) -> Self {
        Self {
            judge_ms: ms,
            stamp_ms: ms,
            earlier_may_run: false,
        }
    }

    /// Two readings of the time: judged on the earlier, stamped on the later.
    pub(crate) fn of(a: u64, b: u64) -> Self {
        Self {
            judge_ms: a.min(b),
            stamp_ms: a.max(b),
            earlier_may_run: false,
        }
    }

    /// The same time, with every in-flight record live while `earlier_may_run`.
    pub(crate) fn holding_in_flight(self, earlier_may_run: bool) -> Self {
        Self {
            earlier_may_run,
            ..self
        }
    }
}

/// The decision of `begin`: what to write (if anything) and the answer.
pub(crate) fn begin(
    cur: Option<&Record>,
    attempt: &super::Attempt<'_>,
    in_flight_ms: u64,
    now: Now,
) -> (Option<Record>, Begin) {
    let fingerprint = attempt.fingerprint;
    match cur {
        // While an earlier process's requests may still run, no record is taken over: the
        // fence drained only this process's, and after a forward step of the wall clock
        // across the restart its wait for the earlier ones is shortened by the step.
        Some(r) if r.is_live_at(now) && (now.earlier_may_run || !r.superseded_by(attempt)) => {
            let answer = if r.fingerprint() != fingerprint {
                Begin::Mismatch
            } else {
                match r {
                    Record::InFlight { .. } => Begin::InFlight,
                    Record::Done {
                        response: Some(resp),
                        ..
                    } => Begin::Replay(resp.clone()),
                    Record::Done { response: None, .. } => Begin::NotReplayable,
                }
            };
            (None, answer)
        }
        _ => (
            Some(in_flight(
                attempt,
                now.stamp_ms.saturating_add(in_flight_ms),
            )),
            Begin::Started,
        ),
    }
}

/// What `finish` does to the stored record: `None` leaves it alone (it is not ours: another
/// attempt began it, or it is done), `Some(None)` deletes it, `Some(Some(r))` writes `r`.
pub(crate) fn finish(
    cur: Option<&Record>,
    attempt: &super::Attempt<'_>,
    outcome: Finish,
    now: Now,
) -> Option<Option<Record>> {
    let fingerprint = attempt.fingerprint;
    match cur {
        Some(r) if r.belongs_to(attempt) => {
            let (response, retention) = match outcome {
                Finish::Store {
                    response,
                    retention,
                } => (Some(response), retention),
                Finish::TooLarge { retention } => (None, retention),
                Finish::Forget => return Some(None),
            };
            Some(Some(Record::Done {
                fingerprint: *fingerprint,
                expires_ms: now.stamp_ms.saturating_add(super::ms(retention)),
                response,
            }))
        }
        _ => None,
    }
}

impl Record {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64);
        match self {
            Self::InFlight {
                fingerprint,
                until_ms,
                attempt,
                generation,
            } => {
                out.push(1);
                out.extend_from_slice(&fingerprint.0);
                out.extend_from_slice(&until_ms.to_be_bytes());
                // Records written before attempts were kept end here (41 bytes).
                out.extend_from_slice(&attempt.to_be_bytes());
                out.extend_from_slice(&generation.to_be_bytes());
            }
            Self::Done {
                fingerprint,
                expires_ms,
                response,
            } => {
                out.push(2);
                out.extend_from_slice(&fingerprint.0);
                out.extend_from_slice(&expires_ms.to_be_bytes());
                if let Some(r) = response {
                    out.extend_from_slice(&r.status.as_u16().to_be_bytes());
                    put_headers(&mut out, &r.headers);
                    put(&mut out, &r.body);
                    // Trailers last, when there are any: a record written before trailers
                    // were kept ends after the body and decodes as having none.
                    if let Some(trailers) = &r.trailers {
                        put_headers(&mut out, trailers);
                    }
                }
            }
        }
        out
    }

    /// Whether the record encoded in `bytes` is live at `now`, from its head alone (a
    /// tag, the fingerprint, its time): a sweep need not copy every stored answer. A head
    /// that does not decode is not live.
    pub(crate) fn live_at(bytes: &[u8], now: Now) -> bool {
        let (Some(&tag @ (1 | 2)), Some(time)) = (bytes.first(), bytes.get(33..41)) else {
            return false;
        };
        (now.earlier_may_run && tag == 1)
            || <[u8; 8]>::try_from(time).is_ok_and(|time| now.judge_ms < u64::from_be_bytes(time))
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, &'static str> {
        let mut r = Reader(bytes);
        let tag = r.take(1)?[0];
        let fingerprint = Fingerprint(r.take(32)?.try_into().map_err(|_| "short fingerprint")?);
        let time = r.u64()?;
        match tag {
            1 if r.0.is_empty() => Ok(Self::InFlight {
                fingerprint,
                until_ms: time,
                attempt: 0,
                generation: 0,
            }),
            1 => Ok(Self::InFlight {
                fingerprint,
                until_ms: time,
                attempt: r.u64()?,
                generation: r.u64()?,
            }),
            2 if r.0.is_empty() => Ok(Self::Done {
                fingerprint,
                expires_ms: time,
                response: None,
            }),
            2 => {
                let status = StatusCode::from_u16(u16::from_be_bytes(
                    r.take(2)?.try_into().map_err(|_| "status")?,
                ))
                .map_err(|_| "invalid status")?;
                let headers = r.headers()?;
                let body = Bytes::copy_from_slice(r.chunk()?);
                let trailers = if r.0.is_empty() {
                    None
                } else {
                    Some(Box::new(r.headers()?))
                };
                Ok(Self::Done {
                    fingerprint,
                    expires_ms: time,
                    response: Some(StoredResponse {
                        status,
                        headers,
                        body,
                        trailers,
                    }),
                })
            }
            _ => Err("unknown record tag"),
        }
    }
}

/// A count, then each (name, value) in order, repeated names included.
fn put_headers(out: &mut Vec<u8>, headers: &HeaderMap) {
    out.extend_from_slice(
        &u32::try_from(headers.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    for (name, value) in headers {
        put(out, name.as_str().as_bytes());
        put(out, value.as_bytes());
    }
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    /// What [`put_headers`] wrote.
    fn headers(&mut self) -> Result<HeaderMap, &'static str> {
        let count = u32::from_be_bytes(self.take(4)?.try_into().map_err(|_| "count")?);
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let name = HeaderName::from_bytes(self.chunk()?).map_err(|_| "invalid header name")?;
            let value =
                HeaderValue::from_bytes(self.chunk()?).map_err(|_| "invalid header value")?;
            headers.append(name, value);
        }
        Ok(headers)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("record is truncated");
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }

    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().map_err(|_| "u64")?,
        ))
    }

    fn chunk(&mut self) -> Result<&'a [u8], &'static str> {
        let len = u32::from_be_bytes(self.take(4)?.try_into().map_err(|_| "len")?);
        self.take(usize::try_from(len).map_err(|_| "len")?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codec_round_trips() {
        let fp = Fingerprint::of(&Method::POST, "/a?b", b"body");
        let mut headers = HeaderMap::new();
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        headers.append(
            "content-type",
            HeaderValue::from_bytes(b"text/\xffplain").unwrap(),
        );
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        let resp = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\0\x01hello"),
            trailers: None,
        };
        let with_trailers = StoredResponse {
            trailers: Some(Box::new(trailers)),
            ..resp.clone()
        };
        for rec in [
            Record::InFlight {
                fingerprint: fp,
                until_ms: 9,
                attempt: 7,
                generation: 3,
            },
            Record::Done {
                fingerprint: fp,
                expires_ms: 10,
                response: None,
            },
            Record::Done {
                fingerprint: fp,
                expires_ms: 11,
                response: Some(resp),
            },
            Record::Done {
                fingerprint: fp,
                expires_ms: 12,
                response: Some(with_trailers),
            },
        ] {
            assert_eq!(Record::decode(&rec.encode()).unwrap(), rec);
            let enc = rec.encode();
            for cut in 0..enc.len() {
                let _ = Record::decode(&enc[..cut]); // never panics
                let _ = Record::live_at(&enc[..cut], Now::at(0));
            }
            // The sweep's look at the head alone agrees with the whole record.
            for now in 0..14 {
                for held in [false, true] {
                    let now = Now::at(now).holding_in_flight(held);
                    assert_eq!(
                        Record::live_at(&enc, now),
                        rec.is_live_at(now),
                        "{rec:?} at {now:?}"
                    );
                }
            }
        }
        assert!(Record::decode(&[9; 41]).is_err());
        assert!(!Record::live_at(
            &[9; 41],
            Now::at(0).holding_in_flight(true)
        ));
        assert!(!Record::live_at(
            &[1; 40],
            Now::at(0).holding_in_flight(true)
        ));
    }

    #[test]
    fn fingerprints_separate_method_path_and_body() {
        let f = |m: Method, p: &str, b: &[u8]| Fingerprint::of(&m, p, b);
        assert_eq!(f(Method::POST, "/a", b"x"), f(Method::POST, "/a", b"x"));
        assert_ne!(f(Method::POST, "/a", b"x"), f(Method::PUT, "/a", b"x"));
        assert_ne!(f(Method::POST, "/a", b"x"), f(Method::POST, "/b", b"x"));
        assert_ne!(f(Method::POST, "/a", b"x"), f(Method::POST, "/a", b"y"));
        assert_ne!(f(Method::POST, "/a", b""), f(Method::POST, "/a\0", b""));
    }
}
