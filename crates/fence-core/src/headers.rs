//! Header names and codecs of `docs/protocol.md` section 2, shared by the sending and receiving ends.
//!
//! ```
//! use fence_core::headers::{self, FencingHeaders, HeaderError};
//! use http::HeaderMap;
//!
//! let mut map = HeaderMap::new();
//! assert_eq!(FencingHeaders::from_headers(&map), Ok(None)); // missing: 428 at a sink
//! map.insert(headers::X_FENCING_JOB, "job-1".parse()?);
//! assert!(matches!(FencingHeaders::from_headers(&map), Err(HeaderError::Incomplete { .. })));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{FencingToken, JobId, ParseIdError, ParseTokenError};

/// `X-Fencing-Job`: the job id a request writes on behalf of.
pub const X_FENCING_JOB: HeaderName = HeaderName::from_static("x-fencing-job");
/// `X-Fencing-Token`: the generation of the sender's lease on that job.
pub const X_FENCING_TOKEN: HeaderName = HeaderName::from_static("x-fencing-token");
/// `Idempotency-Key`: names one logical operation of a job, so a retry can be replayed.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `Idempotent-Replayed`: set to `true` on a response replayed from an idempotency record.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The longest idempotency key, in characters.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Why the fencing or idempotency headers of a request are malformed (400 at a sink).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum HeaderError {
    /// A header appeared more than once.
    Repeated {
        /// Its name.
        header: HeaderName,
    },
    /// A gRPC binary header named like ours (`x-fencing-token-bin`, ...): fencing metadata
    /// is ASCII, and a token sent that way must not pass as "no token".
    Binary {
        /// The ASCII name it stands for.
        header: HeaderName,
    },
    /// A header was present with an empty value.
    Empty {
        /// Its name.
        header: HeaderName,
    },
    /// Only one of `X-Fencing-Job` and `X-Fencing-Token` was present.
    Incomplete {
        /// The one present.
        present: HeaderName,
        /// The one missing.
        missing: HeaderName,
    },
    /// `X-Fencing-Job` is not a valid job id.
    Job(ParseIdError),
    /// The generation of `X-Fencing-Token` is not a valid token.
    Token(ParseTokenError),
    /// `X-Fencing-Token` is neither a plain token nor `<generation>.<expires_at_ms>.<signature>`.
    Signed {
        /// What is wrong with it.
        reason: &'static str,
    },
    /// `Idempotency-Key` is neither an sf-string nor a bare token of 1 to 255 visible ASCII characters.
    IdempotencyKey {
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Repeated { header } => {
                write!(f, "header {} appears more than once", display_name(header))
            }
            Self::Empty { header } => write!(f, "header {} is empty", display_name(header)),
            Self::Binary { header } => write!(
                f,
                "header {}-Bin: fencing metadata is ASCII; send {} instead of the binary form",
                display_name(header),
                display_name(header)
            ),
            Self::Incomplete { present, missing } => write!(
                f,
                "header {} is present but {} is missing; send both or neither",
                display_name(present),
                display_name(missing)
            ),
            Self::Job(e) => write!(f, "header X-Fencing-Job: {e}"),
            Self::Token(e) => write!(f, "header X-Fencing-Token: {e}"),
            Self::Signed { reason } => write!(
                f,
                "header X-Fencing-Token: {reason}; a token is a plain generation or <generation>.<expires_at_ms>.<signature>"
            ),
            Self::IdempotencyKey { reason } => write!(f, "header Idempotency-Key: {reason}"),
        }
    }
}

impl std::error::Error for HeaderError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Job(e) => Some(e),
            Self::Token(e) => Some(e),
            _ => None,
        }
    }
}

fn display_name(h: &HeaderName) -> &'static str {
    match h.as_str() {
        "x-fencing-job" => "X-Fencing-Job",
        "x-fencing-token" => "X-Fencing-Token",
        "idempotency-key" => "Idempotency-Key",
        _ => "(other)",
    }
}

/// `x-fencing-job-bin`, the gRPC binary form of [`X_FENCING_JOB`]: refused, never read.
/// The three binary forms are constants: a lookup by `&str` would parse and validate the
/// name on every request.
pub const X_FENCING_JOB_BIN: HeaderName = HeaderName::from_static("x-fencing-job-bin");
/// `x-fencing-token-bin`, the gRPC binary form of [`X_FENCING_TOKEN`]: refused, never read.
pub const X_FENCING_TOKEN_BIN: HeaderName = HeaderName::from_static("x-fencing-token-bin");
/// `idempotency-key-bin`, the gRPC binary form of [`IDEMPOTENCY_KEY`]: refused, never read.
pub const IDEMPOTENCY_KEY_BIN: HeaderName = HeaderName::from_static("idempotency-key-bin");

/// The single non-empty value of `name`, `Ok(None)` when absent; its gRPC binary form
/// `binary` (`name-bin`) is refused.
fn single<'a>(
    map: &'a HeaderMap,
    name: &HeaderName,
    binary: &HeaderName,
) -> Result<Option<&'a HeaderValue>, HeaderError> {
    if map.contains_key(binary) {
        return Err(HeaderError::Binary {
            header: name.clone(),
        });
    }
    let mut values = map.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(HeaderError::Repeated {
            header: name.clone(),
        });
    }
    if first.is_empty() {
        return Err(HeaderError::Empty {
            header: name.clone(),
        });
    }
    Ok(Some(first))
}

/// The job and token a request carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencingHeaders {
    /// `X-Fencing-Job`.
    pub job: JobId,
    /// `X-Fencing-Token`: the generation part.
    pub token: FencingToken,
    /// The rest of a signed token, as sent; checked only by a destination that requires
    /// signatures (contract section 6).
    pub signed: Option<Signed>,
}

/// What a signed token adds to its generation: the end of its lease and the signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed {
    /// When the lease the token belongs to ends, on the lease server's clock, in ms since
    /// the Unix epoch.
    pub expires_at_ms: u64,
    /// The signature: 86 base64url characters (whether it verifies is for a verifier to say).
    pub signature: Box<str>,
}

impl FencingHeaders {
    /// Reads both headers. `Ok(None)` means neither is present (missing, 428 at a sink).
    ///
    /// # Errors
    /// When either is repeated, empty or invalid, or only one of the two is present.
    pub fn from_headers(map: &HeaderMap) -> Result<Option<Self>, HeaderError> {
        let job = single(map, &X_FENCING_JOB, &X_FENCING_JOB_BIN)?;
        let token = single(map, &X_FENCING_TOKEN, &X_FENCING_TOKEN_BIN)?;
        match (job, token) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(HeaderError::Incomplete {
                present: X_FENCING_JOB,
                missing: X_FENCING_TOKEN,
            }),
            (None, Some(_)) => Err(HeaderError::Incomplete {
                present: X_FENCING_TOKEN,
                missing: X_FENCING_JOB,
            }),
            (Some(job), Some(token)) => {
                let job = JobId::from_bytes(job.as_bytes()).map_err(HeaderError::Job)?;
                let (token, signed) = parse_token(token.as_bytes())?;
                Ok(Some(Self { job, token, signed }))
            }
        }
    }
}

/// Parses a token: a plain generation, or `<generation>.<expires_at_ms>.<signature>` with a
/// signature of exactly 86 base64url characters. Anything else is malformed, whoever reads it.
///
/// ```
/// # use fence_core::headers::parse_token;
/// let signed = format!("7.1700000030000.{}", "A".repeat(86));
/// assert_eq!(parse_token(signed.as_bytes())?.1.unwrap().expires_at_ms, 1_700_000_030_000);
/// for bad in ["1.5", "7.", "7.x", "7.1.short", "7.01.AAAA"] {
///     assert!(parse_token(bad.as_bytes()).is_err(), "{bad}");
/// }
/// # Ok::<(), fence_core::headers::HeaderError>(())
/// ```
///
/// # Errors
/// When the value is neither form.
pub fn parse_token(value: &[u8]) -> Result<(FencingToken, Option<Signed>), HeaderError> {
    let bad = |reason| HeaderError::Signed { reason };
    let mut parts = value.split(|&b| b == b'.');
    let generation = parts.next().unwrap_or_default();
    let (Some(expires), Some(signature), None) = (parts.next(), parts.next(), parts.next()) else {
        return match value.iter().filter(|&&b| b == b'.').count() {
            0 => Ok((
                FencingToken::from_bytes(value).map_err(HeaderError::Token)?,
                None,
            )),
            _ => Err(bad("it has a '.' but not three parts")),
        };
    };
    let token = FencingToken::from_bytes(generation).map_err(HeaderError::Token)?;
    let canonical = !expires.is_empty()
        && expires.len() <= 20
        && expires.iter().all(u8::is_ascii_digit)
        && (expires == b"0" || expires[0] != b'0');
    let expires_at_ms = std::str::from_utf8(expires)
        .ok()
        .filter(|_| canonical)
        .and_then(|e| e.parse::<u64>().ok())
        .ok_or(bad(
            "the lease end (second part) is not a decimal number of milliseconds",
        ))?;
    if signature.len() != crate::SIGNATURE_LEN
        || !signature
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
    {
        return Err(bad(
            "the signature (third part) is not 86 base64url characters",
        ));
    }
    // Base64url is ASCII, which is valid UTF-8.
    let signature = std::str::from_utf8(signature).unwrap_or_default().into();
    Ok((
        token,
        Some(Signed {
            expires_at_ms,
            signature,
        }),
    ))
}

/// Sets `X-Fencing-Job` and `X-Fencing-Token`, replacing any earlier values.
pub fn insert_fencing(map: &mut HeaderMap, job: &JobId, token: FencingToken) {
    map.insert(X_FENCING_JOB, job_header_value(job));
    map.insert(X_FENCING_TOKEN, HeaderValue::from(token.get()));
}

/// A job id as a header value.
pub fn job_header_value(job: &JobId) -> HeaderValue {
    // A job id is visible ASCII, which is always a valid header value.
    HeaderValue::from_str(job.as_str()).expect("visible ASCII is a valid header value")
}

/// An idempotency key, normalised: `"abc"` (sf-string) and `abc` (bare) are the same key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Box<str>);

impl IdempotencyKey {
    /// The key of one step of a job, the same for every holder of every generation:
    /// `fence-` and the unpadded base64url SHA-256 of `fence-step-v1`, a zero byte, the job
    /// id, a zero byte and the step name (49 characters). A new holder that repeats a step a
    /// stale holder already sent to a third-party API with this key is deduplicated by that
    /// API for as long as it keeps keys. Any language can compute it:
    ///
    /// ```
    /// # use fence_core::{JobId, headers::IdempotencyKey};
    /// let job: JobId = "invoice-42".parse()?;
    /// let key = IdempotencyKey::for_step(&job, "charge");
    /// assert_eq!(key.as_str(), "fence-94_3LSyI-83UpFvMYZSTMad586VO_w3O3VjtR9m8yGY");
    /// assert_ne!(key, IdempotencyKey::for_step(&job, "refund"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn for_step(job: &JobId, step: &str) -> Self {
        use base64::{Engine, engine::general_purpose::URL_SAFE_NO_PAD};
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        hash.update(b"fence-step-v1\0");
        hash.update(job.as_str().as_bytes());
        hash.update(b"\0");
        hash.update(step.as_bytes());
        let digest = URL_SAFE_NO_PAD.encode(hash.finalize());
        Self(format!("fence-{digest}").into_boxed_str())
    }

    /// Parses a header value: an RFC 8941 sf-string or a bare token of 1 to 255 visible
    /// ASCII characters.
    ///
    /// ```
    /// # use fence_core::headers::IdempotencyKey;
    /// assert_eq!(IdempotencyKey::from_bytes(b"\"abc\"")?, IdempotencyKey::from_bytes(b"abc")?);
    /// assert_eq!(IdempotencyKey::from_bytes(br#""a \"q\"""#)?.as_str(), "a \"q\"");
    /// # Ok::<(), fence_core::headers::HeaderError>(())
    /// ```
    ///
    /// # Errors
    /// When the value is neither form, or longer than 255 characters.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HeaderError> {
        let bad = |reason| HeaderError::IdempotencyKey { reason };
        let key = if let Some(rest) = bytes.strip_prefix(b"\"") {
            let mut out = String::with_capacity(rest.len());
            let mut iter = rest.iter();
            loop {
                match iter.next() {
                    None => return Err(bad("sf-string has no closing quote")),
                    Some(b'"') => break,
                    Some(b'\\') => match iter.next() {
                        Some(&c @ (b'"' | b'\\')) => out.push(char::from(c)),
                        _ => return Err(bad("sf-string escapes only \\\" and \\\\")),
                    },
                    Some(&c @ 0x20..=0x7E) => out.push(char::from(c)),
                    Some(_) => return Err(bad("sf-string holds a byte outside printable ASCII")),
                }
            }
            if iter.next().is_some() {
                return Err(bad("bytes follow the closing quote of the sf-string"));
            }
            out
        } else {
            if bytes.iter().any(|b| !(0x21..=0x7E).contains(b)) {
                return Err(bad("a bare key must be visible ASCII (0x21 to 0x7E)"));
            }
            String::from_utf8(bytes.to_vec()).map_err(|_| bad("not ASCII"))?
        };
        if key.is_empty() {
            return Err(bad("key is empty"));
        }
        if key.len() > MAX_IDEMPOTENCY_KEY_LEN {
            return Err(bad("key is longer than 255 characters"));
        }
        Ok(Self(key.into_boxed_str()))
    }

    /// Reads `Idempotency-Key`; `Ok(None)` when absent.
    ///
    /// # Errors
    /// When it is repeated, empty or malformed.
    pub fn from_headers(map: &HeaderMap) -> Result<Option<Self>, HeaderError> {
        single(map, &IDEMPOTENCY_KEY, &IDEMPOTENCY_KEY_BIN)?
            .map(|v| Self::from_bytes(v.as_bytes()))
            .transpose()
    }

    /// The key, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&HeaderName, &[u8])]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.append((*k).clone(), HeaderValue::from_bytes(v).unwrap());
        }
        m
    }

    #[test]
    fn fencing_header_cases() {
        let (j, t) = (&X_FENCING_JOB, &X_FENCING_TOKEN);
        let ok = FencingHeaders {
            job: "j".parse().unwrap(),
            token: FencingToken::new(7).unwrap(),
            signed: None,
        };
        let sig = "a-_Z".repeat(21) + "AQ";
        let signed = FencingHeaders {
            signed: Some(Signed {
                expires_at_ms: 1_700_000_030_000,
                signature: sig.clone().into(),
            }),
            ..ok.clone()
        };
        let signed_value = format!("7.1700000030000.{sig}");
        assert_eq!(
            FencingHeaders::from_headers(&map(&[(j, b"j"), (t, signed_value.as_bytes())])),
            Ok(Some(signed))
        );
        assert_eq!(FencingHeaders::from_headers(&map(&[])), Ok(None));
        assert_eq!(
            FencingHeaders::from_headers(&map(&[(j, b"j"), (t, b"7")])),
            Ok(Some(ok))
        );
        let with = |expires: &str, signature: &str| format!("7.{expires}.{signature}");
        let (short, long) = (sig[..85].to_owned(), format!("{sig}A"));
        let owned: Vec<(String, &str)> = vec![
            (with("0", &sig), ""),
            (with("18446744073709551615", &sig), ""),
            (with("01", &sig), "lease end"),
            (with("", &sig), "lease end"),
            (with("-1", &sig), "lease end"),
            (with("18446744073709551616", &sig), "lease end"),
            (with("1", &short), "86 base64url"),
            (with("1", &long), "86 base64url"),
            (with("1", &sig.replace('a', "+")), "86 base64url"),
            (format!("7.{sig}"), "not three parts"),
            (format!("{}.{sig}", with("1", &sig)), "not three parts"),
        ];
        for (value, want) in &owned {
            let got = FencingHeaders::from_headers(&map(&[(j, b"j"), (t, value.as_bytes())]));
            match (want.is_empty(), got) {
                (true, Ok(Some(_))) => {}
                (false, Err(e)) => assert!(e.to_string().contains(want), "{value}: {e}"),
                (_, got) => panic!("{value}: {got:?}"),
            }
        }
        type Pairs<'a> = &'a [(&'a HeaderName, &'a [u8])];
        let bad: &[(Pairs<'_>, &str)] = &[
            (
                &[(j, b"j")],
                "X-Fencing-Job is present but X-Fencing-Token is missing",
            ),
            (
                &[(t, b"7")],
                "X-Fencing-Token is present but X-Fencing-Job is missing",
            ),
            (
                &[(j, b"j"), (j, b"j"), (t, b"7")],
                "X-Fencing-Job appears more than once",
            ),
            (
                &[(j, b"j"), (t, b"7"), (t, b"7")],
                "X-Fencing-Token appears more than once",
            ),
            (&[(j, b""), (t, b"7")], "X-Fencing-Job is empty"),
            (&[(j, b"j"), (t, b"")], "X-Fencing-Token is empty"),
            (
                &[(j, b"a b"), (t, b"7")],
                "X-Fencing-Job: job id has byte 0x20",
            ),
            (&[(j, b"\xc3\xa9"), (t, b"7")], "byte 0xC3"),
            (&[(j, b"j"), (t, b"07")], "leading zero"),
            (&[(j, b"j"), (t, b"0")], "is 0"),
            (&[(j, b"j"), (t, b"-1")], "0x2D"),
            (&[(j, b"j"), (t, b"18446744073709551616")], "above"),
            (&[(j, b"j"), (t, b"1.5")], "not three parts"),
            (&[(j, b"j"), (t, b"7.")], "not three parts"),
            (&[(j, b"j"), (t, b"7.x")], "not three parts"),
            (&[(j, b"j"), (t, b".abc")], "not three parts"),
            (&[(j, b"j"), (t, b"07.1.abc")], "leading zero"),
        ];
        for (pairs, want) in bad {
            let e = FencingHeaders::from_headers(&map(pairs)).unwrap_err();
            assert!(
                e.to_string().contains(want),
                "{pairs:?}: {e} lacks {want:?}"
            );
        }
    }

    #[test]
    fn insert_round_trips() {
        let mut m = HeaderMap::new();
        let job: JobId = "job/1".parse().unwrap();
        insert_fencing(&mut m, &job, FencingToken::new(u64::MAX).unwrap());
        insert_fencing(&mut m, &job, FencingToken::new(3).unwrap());
        assert_eq!(
            m.get_all(X_FENCING_TOKEN).iter().count(),
            1,
            "insert replaces"
        );
        let got = FencingHeaders::from_headers(&m).unwrap().unwrap();
        assert_eq!((got.job, got.token.get()), (job, 3));
    }

    #[test]
    fn idempotency_keys() {
        let k = |b: &[u8]| IdempotencyKey::from_bytes(b).map(|k| k.as_str().to_owned());
        assert_eq!(k(b"abc"), Ok("abc".into()));
        assert_eq!(k(b"\"abc\""), Ok("abc".into()));
        assert_eq!(k(b"\"a b\""), Ok("a b".into()));
        assert_eq!(k(br#""\\""#), Ok("\\".into()));
        assert_eq!(k(&[b'x'; 255]), Ok("x".repeat(255)));
        for bad in [
            &b""[..],
            b"\"\"",
            b"\"abc",
            b"\"ab\"c",
            b"\"a\\nb\"",
            b"a b",
            b"\xc3\xa9",
            b"\"\xc3\xa9\"",
            &[b'x'; 256],
        ] {
            assert!(k(bad).is_err(), "{bad:?} accepted");
        }
        let two = map(&[(&IDEMPOTENCY_KEY, b"a"), (&IDEMPOTENCY_KEY, b"b")]);
        assert!(matches!(
            IdempotencyKey::from_headers(&two),
            Err(HeaderError::Repeated { .. })
        ));
        assert_eq!(IdempotencyKey::from_headers(&HeaderMap::new()), Ok(None));
        let key = IdempotencyKey::from_bytes(b"order-7").unwrap();
        assert_eq!(
            (key.to_string(), format!("{key:?}")),
            ("order-7".into(), r#""order-7""#.into())
        );
        let e = IdempotencyKey::from_headers(&map(&[(&IDEMPOTENCY_KEY, b"")])).unwrap_err();
        assert_eq!(e.to_string(), "header Idempotency-Key is empty");
    }

    /// gRPC clients may send any metadata in binary form (`name-bin`): for the fencing
    /// headers and the key that form is refused by name, with or without the ASCII one, so a
    /// client is told what to send instead of being treated as unfenced.
    #[test]
    fn binary_forms_are_refused_by_name() {
        let bin = |name: &'static str| HeaderName::from_static(name);
        let cases = [
            (bin("x-fencing-job-bin"), "header X-Fencing-Job-Bin"),
            (bin("x-fencing-token-bin"), "header X-Fencing-Token-Bin"),
        ];
        for (name, want) in cases {
            for with_ascii in [false, true] {
                let mut m = map(&[(&name, b"AAAA")]);
                if with_ascii {
                    insert_fencing(&mut m, &"j".parse().unwrap(), FencingToken::new(7).unwrap());
                }
                let e = FencingHeaders::from_headers(&m).unwrap_err();
                assert!(matches!(e, HeaderError::Binary { .. }), "{name}: {e:?}");
                assert!(e.to_string().starts_with(want), "{name}: {e}");
            }
        }
        let m = map(&[(&bin("idempotency-key-bin"), b"AAAA")]);
        let e = IdempotencyKey::from_headers(&m).unwrap_err();
        assert!(
            e.to_string().starts_with("header Idempotency-Key-Bin"),
            "{e}"
        );
        // Other binary metadata is none of the fence's business.
        let m = map(&[(&bin("trace-bin"), b"AAAA")]);
        assert_eq!(FencingHeaders::from_headers(&m), Ok(None));
        assert_eq!(IdempotencyKey::from_headers(&m), Ok(None));
    }

    /// The parse errors of the job and the token stay reachable as the error's source.
    #[test]
    fn parse_errors_keep_their_source() {
        use std::error::Error as _;
        let (j, t) = (&X_FENCING_JOB, &X_FENCING_TOKEN);
        let job = FencingHeaders::from_headers(&map(&[(j, b"a b"), (t, b"7")])).unwrap_err();
        let token = FencingHeaders::from_headers(&map(&[(j, b"j"), (t, b"0")])).unwrap_err();
        for (e, source) in [(&job, "job id has byte 0x20"), (&token, "is 0")] {
            let got = e.source().map(ToString::to_string).unwrap_or_default();
            assert!(got.contains(source), "{e}: source {got:?}");
        }
        let empty = FencingHeaders::from_headers(&map(&[(j, b""), (t, b"7")])).unwrap_err();
        assert!(empty.source().is_none(), "{empty}");
    }
}
