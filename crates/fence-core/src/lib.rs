//! Protocol types shared by every part of fence: the words of the wire contract.
//!
//! A lease holder sends its job id and fencing token to a destination in two headers;
//! the destination parses them with the same types, so the two ends cannot drift apart.
//!
//! ```
//! use fence_core::{FencingToken, JobId, headers};
//!
//! let job: JobId = "invoice-42".parse()?;
//! let token: FencingToken = "7".parse()?;
//! let mut request = http::Request::new(());
//! headers::insert_fencing(request.headers_mut(), &job, token);
//! let parsed = headers::FencingHeaders::from_headers(request.headers())?;
//! assert_eq!(parsed, Some(headers::FencingHeaders { job, token, signed: None }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The crate does no I/O and keeps no state: it depends on `http`, `serde`, `thiserror`,
//! `base64`, `sha2` and `subtle` (and, for signed tokens, `ed25519-dalek`).

mod generation;
pub mod headers;
mod ident;
pub mod lease_api;
pub mod problem;
pub mod secret;
#[cfg(feature = "signing")]
pub mod signing;
pub mod sink_api;
mod ttl;

pub use generation::{FencingToken, Generation, ParseTokenError};
pub use ident::{JobId, MAX_ID_LEN, Owner, ParseIdError};
pub use problem::{Problem, ProblemType};
pub use ttl::{Ttl, TtlError};

/// The length of a token's signature: 64 bytes in base64url without padding.
pub const SIGNATURE_LEN: usize = 86;
