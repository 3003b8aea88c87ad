//! Helpers shared by fence's examples and cross-crate tests: a tiny HTTP server to send
//! fenced requests to, child processes that are killed when the test ends, and the ledger
//! gRPC service.

pub mod ledger;

use std::{convert::Infallible, net::SocketAddr, process::Child};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, sync::mpsc};

/// The fencing headers one request carried, as an echo server saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// `X-Fencing-Job`, if any.
    pub job: Option<String>,
    /// `X-Fencing-Token`, if any.
    pub token: Option<String>,
}

/// Serves HTTP/1 on 127.0.0.1 (an ephemeral port), answering 200 to everything and
/// reporting the fencing headers of each request on the returned channel.
///
/// # Errors
/// When the port cannot be bound.
pub async fn spawn_echo_server() -> std::io::Result<(SocketAddr, mpsc::UnboundedReceiver<Seen>)> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let header = |name: &str| {
                        req.headers()
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned)
                    };
                    let _ = tx.send(Seen {
                        job: header("x-fencing-job"),
                        token: header("x-fencing-token"),
                    });
                    async {
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((addr, rx))
}

/// A child process killed (SIGKILL) and reaped when dropped, so a failing test leaves none behind.
#[derive(Debug)]
pub struct ChildGuard(pub Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This process's resident set in bytes, from `/proc/self/status` (Linux); `None` where that
/// cannot be read. Used by the benchmark examples.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    let kb: u64 = kb.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kb * 1024)
}
