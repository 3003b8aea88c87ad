//! Reading what is left of a refused HTTP/2 request's body before the refusal is answered.

use bytes::Bytes;
use std::time::Duration;

use crate::body::FenceBody;

/// How much of a refused HTTP/2 request's body [`discard`] reads at most.
pub(crate) const DISCARD_BYTES: usize = 64 << 10;

/// How long [`discard`] waits for a refused HTTP/2 request's body at most.
pub(crate) const DISCARD_WAIT: Duration = Duration::from_secs(1);

/// Reads and drops what is left of a refused HTTP/2 request's body (at most
/// [`DISCARD_BYTES`], for at most [`DISCARD_WAIT`]), so that the refusal follows the request's
/// end. Answering first closes the stream under a client that is still sending, and some
/// clients then fail the whole exchange instead of reading the answer (curl 7.88, Debian 12's:
/// "(92) Stream error in the HTTP/2 framing layer"). nginx discards a refused body the same
/// way. HTTP/1.1 needs none of it (hyper reads or closes after the answer), and reading a body
/// there would send a `100 Continue` the client waited for. gRPC calls are answered at once
/// (their clients read an early answer, and a stream's body may not end while they wait).
pub(crate) async fn discard<B: FenceBody>(version: http::Version, body: B) {
    use http_body_util::BodyExt;
    if version != http::Version::HTTP_2 || body.is_end_stream() {
        return;
    }
    let read = async {
        let mut body = std::pin::pin!(body);
        let mut left = DISCARD_BYTES;
        while let Some(Ok(frame)) = body.frame().await {
            let len = frame.data_ref().map_or(0, Bytes::len);
            left = match left.checked_sub(len) {
                Some(left) if left > 0 => left,
                _ => return,
            };
        }
    };
    let _ = tokio::time::timeout(DISCARD_WAIT, read).await;
}
