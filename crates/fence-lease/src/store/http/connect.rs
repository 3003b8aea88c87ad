//! A connector whose attempts end at a budget set by the call that needs the connection.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use http::Uri;
use tower_service::Service;

/// The longest one connection attempt may take when there are other servers to try.
pub(super) const MAX_CONNECT_SHARE: Duration = Duration::from_secs(2);

tokio::task_local! {
    /// How long a connection attempt made within this scope may take.
    static CONNECT_WITHIN: Duration;
}

/// Runs `fut` with its connection attempts limited to `budget` (none: no limit of its own).
pub(super) async fn within<F: Future>(budget: Option<Duration>, fut: F) -> F::Output {
    match budget {
        Some(budget) => CONNECT_WITHIN.scope(budget, fut).await,
        None => fut.await,
    }
}

/// Wraps a connector: an attempt started inside [`within`] fails when its budget is spent.
/// The client calls the connector from the request's own task, where the budget is set.
#[derive(Debug, Clone)]
pub(super) struct Budgeted<C>(pub(super) C);

/// The error of an attempt that ran out of its budget.
#[derive(Debug, thiserror::Error)]
#[error("no connection within {0:?}")]
struct OutOfBudget(Duration);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> Service<Uri> for Budgeted<C>
where
    C: Service<Uri>,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let budget = CONNECT_WITHIN.try_with(|b| *b).ok();
        let attempt = self.0.call(uri);
        Box::pin(async move {
            match budget {
                Some(budget) => match tokio::time::timeout(budget, attempt).await {
                    Ok(done) => done.map_err(Into::into),
                    Err(_) => Err(Box::new(OutOfBudget(budget)) as BoxError),
                },
                None => attempt.await.map_err(Into::into),
            }
        })
    }
}
