//! Middleware that rejects stale fencing tokens at the destination.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! use fence_sink::{FenceLayer, Fenced, MemoryStore, RequestBody};
//! use http::{Request, Response};
//! use tower::{Service, ServiceBuilder, ServiceExt, service_fn};
//!
//! let mut svc = ServiceBuilder::new().layer(FenceLayer::new(MemoryStore::new())).service(service_fn(
//!     |req: Request<RequestBody<String>>| async move {
//!         let fenced = req.extensions().get::<Fenced>().cloned();
//!         Ok::<_, std::convert::Infallible>(Response::new(format!("{fenced:?}")))
//!     },
//! ));
//! let req = |token: &str| {
//!     Request::post("/charge").header("x-fencing-job", "job-1").header("x-fencing-token", token).body(String::new())
//! };
//! assert_eq!(svc.ready().await?.call(req("8")?).await?.status(), 200);
//! assert_eq!(svc.ready().await?.call(req("7")?).await?.status(), 409); // stale
//! # Ok(()) }
//! ```

mod advance;
mod future;
mod layer;
mod maintenance;
mod service;
mod shared;
mod signature;

pub use future::ResponseFuture;
pub use layer::{FenceLayer, FencePredicate, ForgetError};
pub use maintenance::Maintenance;
pub use service::{Fence, Fenced};
