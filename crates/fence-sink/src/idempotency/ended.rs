//! How a call of whole messages ended, where its status travels in the body.
//!
//! gRPC-Web sends its trailers as the body's last message (flag `0x80`, HTTP/1-style header
//! lines), and Connect's streaming calls end with a message flagged `0x02` whose JSON names
//! an `error` when the call failed; both answer HTTP 200 either way. gRPC proper puts its
//! status in HTTP trailers, read elsewhere.

use http::HeaderValue;

use crate::reject::starts_with_ignore_case;

/// Connect's error codes, by gRPC number (Connect's are gRPC's, named).
const CONNECT_CODES: [&str; 17] = [
    "ok",
    "canceled",
    "unknown",
    "invalid_argument",
    "deadline_exceeded",
    "not_found",
    "already_exists",
    "permission_denied",
    "resource_exhausted",
    "failed_precondition",
    "aborted",
    "out_of_range",
    "unimplemented",
    "internal",
    "unavailable",
    "data_loss",
    "unauthenticated",
];

/// The gRPC status a gRPC-Web or Connect streaming answer's `body` ends with, as a
/// `grpc-status` value (`"0"` for none failed); `None` for another kind of answer, or one
/// whose body does not end so (then nothing is known from it). `content_type` is the
/// answer's.
pub(crate) fn status_in_body(
    content_type: Option<&HeaderValue>,
    body: &[u8],
) -> Option<HeaderValue> {
    let kind = content_type?.as_bytes();
    let starts = |prefix: &[u8]| starts_with_ignore_case(kind, prefix);
    // `application/grpc-web-text` is base64 and is not read.
    if starts(b"application/grpc-web-text") {
        None
    } else if starts(b"application/grpc-web") {
        let (_, trailers) = last_message(body).filter(|(flag, _)| flag & 0x80 != 0)?;
        grpc_web_status(trailers)
    } else if starts(b"application/connect+") {
        let (_, end) = last_message(body).filter(|(flag, _)| flag & 0x02 != 0)?;
        connect_status(end)
    } else {
        None
    }
}

/// The flag and payload of the body's last message (5-byte prefix: flag, big-endian length),
/// when the body is whole messages; `None` for one that is not.
fn last_message(mut body: &[u8]) -> Option<(u8, &[u8])> {
    let mut last = None;
    while !body.is_empty() {
        let (&flag, rest) = body.split_first()?;
        let len = u32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
        let len = usize::try_from(len).ok()?;
        let payload = rest.get(4..4usize.checked_add(len)?)?;
        last = Some((flag, payload));
        body = &rest[4 + len..];
    }
    last
}

/// `grpc-status` from gRPC-Web's trailer lines (`name: value\r\n`).
fn grpc_web_status(trailers: &[u8]) -> Option<HeaderValue> {
    trailers.split(|&b| b == b'\n').find_map(|line| {
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        name.trim_ascii()
            .eq_ignore_ascii_case(b"grpc-status")
            .then(|| HeaderValue::from_bytes(value.trim_ascii()).ok())?
    })
}

/// The status of Connect's end-of-stream message: `{"error": {"code": "..."}}` when the
/// call failed, else `"0"`.
fn connect_status(end: &[u8]) -> Option<HeaderValue> {
    let value: serde_json::Value = serde_json::from_slice(end).ok()?;
    let Some(error) = value.get("error").filter(|e| !e.is_null()) else {
        return Some(HeaderValue::from_static("0"));
    };
    // A failure whose code is unknown here counts as 2, UNKNOWN: a failure.
    let code = error
        .get("code")
        .and_then(serde_json::Value::as_str)
        .and_then(|name| CONNECT_CODES.iter().position(|c| *c == name))
        .filter(|&n| n != 0)
        .unwrap_or(2);
    Some(HeaderValue::from(code))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(flag: u8, payload: &[u8]) -> Vec<u8> {
        let mut m = vec![flag];
        m.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    fn status(kind: &'static str, body: &[u8]) -> Option<String> {
        status_in_body(Some(&HeaderValue::from_static(kind)), body)
            .map(|v| v.to_str().unwrap().to_owned())
    }

    #[test]
    fn grpc_web_trailers_and_connect_end_of_stream_carry_the_status() {
        let mut web = message(0, b"\x08\x01");
        web.extend(message(0x80, b"grpc-status: 4\r\ngrpc-message: late\r\n"));
        assert_eq!(
            status("application/grpc-web+proto", &web).as_deref(),
            Some("4")
        );
        let ok = [message(0, b"x"), message(0x80, b"Grpc-Status:0\r\n")].concat();
        assert_eq!(status("application/grpc-web", &ok).as_deref(), Some("0"));
        let failed = [
            message(0, b"{}"),
            message(2, br#"{"error":{"code":"unavailable","message":"down"}}"#),
        ]
        .concat();
        assert_eq!(
            status("application/connect+json", &failed).as_deref(),
            Some("14")
        );
        let odd = message(2, br#"{"error":{"code":"teapot"}}"#);
        assert_eq!(
            status("application/connect+proto", &odd).as_deref(),
            Some("2")
        );
        let done = message(2, br#"{"metadata":{}}"#);
        assert_eq!(
            status("application/connect+proto", &done).as_deref(),
            Some("0")
        );
    }

    #[test]
    fn what_is_not_read_is_not_known() {
        // No trailer message; a cut message; another content type; base64 gRPC-Web.
        assert_eq!(status("application/grpc-web", &message(0, b"x")), None);
        assert_eq!(status("application/grpc-web", b"\x80\0\0\0\x09grpc"), None);
        let web = message(0x80, b"grpc-status: 4\r\n");
        assert_eq!(status("application/json", &web), None);
        assert_eq!(status("application/grpc-web-text", &web), None);
        assert_eq!(status_in_body(None, &web), None);
        assert_eq!(status("application/grpc-web", &[0xff; 3]), None);
    }
}
