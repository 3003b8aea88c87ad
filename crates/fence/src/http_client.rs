//! A minimal JSON-over-HTTP client for the command-line lease calls, which print the
//! server's answer exactly as it came.

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::{Method, Request, StatusCode, header::CONTENT_TYPE};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

/// Sends one request and returns the status and body.
///
/// # Errors
/// When the server cannot be reached, does not answer within `timeout`, or answers more
/// than 1 MiB.
pub async fn call(
    method: Method,
    url: &str,
    body: Option<serde_json::Value>,
    timeout: Duration,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut req = Request::builder().method(method).uri(url);
    let body = match body {
        Some(v) => {
            req = req.header(CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(v.to_string()))
        }
        None => Full::new(Bytes::new()),
    };
    let req = req
        .body(body)
        .with_context(|| format!("invalid URL {url:?}"))?;
    let exchange = async {
        let resp = client
            .request(req)
            .await
            .with_context(|| format!("cannot reach {url}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading the answer of {url} failed: {e}"))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("{url} did not answer within {timeout:?}"))?
}
