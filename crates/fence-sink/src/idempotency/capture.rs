//! A service's answer read whole, to keep under its key, within a size and a deadline.

use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use fence_storage::BoxError;
use http::HeaderMap;
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::{body::FenceBody, budget::Reservation};

/// How reading an answer whole ended.
pub(super) enum Captured<B> {
    /// All of it: the data, and the trailers it ended with.
    Whole(Bytes, Option<HeaderMap>),
    /// The prefix read, trailers if the body ended with them, and the rest of the body.
    TooLarge(Bytes, Option<HeaderMap>, Pin<Box<B>>),
    Failed(BoxError),
}

/// Reads a response body up to `limit` bytes and until `by`, each byte taken from `held`
/// under `max`: all of it (with the trailers it ended with: a gRPC answer's status), or what
/// was read so far and the rest of the body to stream on (the body is then not stored: a
/// retry gets 409 not-replayable). Trailers are a body's last frame, so data then trailers
/// replays it faithfully; a body that goes on after its trailers has failed.
pub(super) async fn capture<B>(
    body: B,
    (limit, by): (usize, Instant),
    held: &mut Reservation,
    max: usize,
) -> Captured<B>
where
    B: FenceBody,
{
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let trailers = loop {
        let Ok(frame) = tokio::time::timeout_at(by, body.frame()).await else {
            return Captured::TooLarge(buf.freeze(), None, body);
        };
        match frame {
            None => return Captured::Whole(buf.freeze(), None),
            Some(Err(e)) => return Captured::Failed(e.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    let fits =
                        buf.len() + data.len() <= limit && held.take(data.len(), max).is_ok();
                    buf.extend_from_slice(&data);
                    if !fits {
                        return Captured::TooLarge(buf.freeze(), None, body);
                    }
                }
                Err(frame) => break frame.into_trailers().ok(),
            },
        }
    };
    // Trailers end a body: anything after them breaks the protocol.
    match tokio::time::timeout_at(by, body.frame()).await {
        Ok(None) => Captured::Whole(buf.freeze(), trailers),
        Ok(Some(Err(e))) => Captured::Failed(e.into()),
        Ok(Some(Ok(_))) => Captured::Failed("a frame after the trailers".into()),
        Err(_) => Captured::Failed("no end after the trailers within the body deadline".into()),
    }
}
