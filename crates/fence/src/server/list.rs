//! `GET /v1/leases`: pages of lease records, each client seeing only its own jobs.
//!
//! A client restricted by its patterns is listed scope by scope (one store query per prefix
//! pattern, one read per exact job), and the pages are merged: the store never reads, and
//! the `next` cursor never names, a job outside the client's patterns.

use std::{sync::Arc, time::Instant};

use axum::{
    extract::{RawQuery, State},
    http::HeaderMap,
    response::Response,
};
use fence_core::{
    JobId,
    lease_api::{DEFAULT_LIST_LIMIT, ListBody, ListQuery},
};
use fence_lease::{LeaseStore, ListPage, StoreError};

use super::{
    AppState,
    answer::{Answer, bad, finish, json, record_body, store_read_failed},
    guard::authorize,
};
use crate::auth::Scope;

/// `GET /v1/leases?state=S&prefix=P&after=JOB&limit=N`.
pub(super) async fn list<S: LeaseStore>(
    State(app): State<Arc<AppState<S>>>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let started = Instant::now();
    let answer: Answer = async {
        let caller = authorize(app.options.auth.as_ref(), &headers, None)?;
        let query = ListQuery::from_query(query.as_deref().unwrap_or_default())
            .map_err(|e| bad(e.to_string()))?;
        let page = match caller {
            None => app.store.list(&query).await,
            Some(caller) => {
                let scopes = caller.client().scopes(query.prefix.as_deref());
                scoped(&*app.store, &query, &scopes).await
            }
        }
        .map_err(|e| store_read_failed(None, &e))?;
        Ok(json(&ListBody {
            leases: page.leases.iter().map(record_body).collect(),
            next: page.next,
        }))
    }
    .await;
    finish("list", started, answer)
}

/// The page of `query` within `scopes`: each scope's first page, merged in job order.
/// Every scope's page holds its first jobs after the cursor up to `limit` or up to where it
/// stopped (its `next`); cut at the lowest such stop, the merge holds the first jobs of the
/// union with none skipped.
async fn scoped<S: LeaseStore>(
    store: &S,
    query: &ListQuery,
    scopes: &[Scope],
) -> Result<ListPage, StoreError> {
    let limit = usize::from(query.limit.unwrap_or(DEFAULT_LIST_LIMIT));
    let mut leases = Vec::new();
    let mut cut: Option<JobId> = None;
    for scope in scopes {
        match scope {
            Scope::Prefix(prefix) => {
                let sub = ListQuery {
                    prefix: Some(prefix.clone()),
                    ..query.clone()
                };
                let page = store.list(&sub).await?;
                if let Some(next) = page.next {
                    cut = Some(cut.map_or(next.clone(), |c| c.min(next)));
                }
                leases.extend(page.leases);
            }
            Scope::Exact(job) => {
                if query.after.as_ref().is_some_and(|after| job <= after) {
                    continue;
                }
                if let Some(record) = store.get(job).await?
                    && query.state.is_none_or(|s| s == record.state)
                {
                    leases.push(record);
                }
            }
        }
    }
    if let Some(cut) = &cut {
        leases.retain(|r| &r.job <= cut);
    }
    leases.sort_by(|a, b| a.job.cmp(&b.job));
    leases.dedup_by(|a, b| a.job == b.job);
    let next = if leases.len() > limit {
        leases.truncate(limit);
        leases.last().map(|r| r.job.clone())
    } else {
        cut
    };
    Ok(ListPage { leases, next })
}
