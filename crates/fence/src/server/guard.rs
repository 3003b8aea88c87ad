//! The bearer check of every `/v1/` request: 401 without a known secret, 403 outside its jobs.

use axum::http::HeaderMap;
use fence_core::{JobId, Problem, ProblemType};

use crate::auth::{AuthFile, Client};

/// Who is asking, when the server checks: the auth file as of the request, and the client
/// that matched in it.
pub(super) struct Caller {
    file: std::sync::Arc<AuthFile>,
    index: usize,
}

impl Caller {
    pub(super) fn client(&self) -> &Client {
        self.file.client(self.index)
    }
}

/// The caller of a request with `headers`, when the server has an auth file; `Ok(None)`
/// when it has none. With `job`, the caller must be allowed it.
///
/// # Errors
/// 401 `unauthenticated` without `Authorization: Bearer <known secret>`, 403 `forbidden`
/// for a job outside the caller's patterns.
pub(super) fn authorize(
    auth: Option<&crate::auth::Auth>,
    headers: &HeaderMap,
    job: Option<&JobId>,
) -> Result<Option<Caller>, Problem> {
    let Some(auth) = auth else {
        return Ok(None);
    };
    let Some(secret) = crate::auth::bearer_secret(headers) else {
        return Err(Problem::new(
            ProblemType::Unauthenticated,
            "this server needs a client secret: send Authorization: Bearer <secret> (fence commands read it from --auth-token-file or FENCE_AUTH_TOKEN)",
        ));
    };
    let file = auth.current();
    let Some(index) = file.index_of(secret) else {
        return Err(Problem::new(
            ProblemType::Unauthenticated,
            "the bearer secret is not one this server knows",
        ));
    };
    let caller = Caller { file, index };
    if let Some(job) = job
        && !caller.client().may(job)
    {
        return Err(Problem::new(
            ProblemType::Forbidden,
            format!(
                "client {} may not act on job {job}: it is outside the client's job patterns",
                caller.client().name()
            ),
        )
        .with_job(job.clone()));
    }
    Ok(Some(caller))
}
