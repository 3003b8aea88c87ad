//! A client-side deadline on the store's statements, for a database that stops answering.

use std::time::Duration;

use fence_storage::postgres::Checkout;

use super::StoreError;

/// How long this process waits for one statement of a session with `statement_timeout`
/// (`None`: off): that timeout, which the database enforces, and a second for the round
/// trip; a minute with none. The database cannot enforce it when it is not there to answer:
/// a host that went away without a reset (a failover by address takeover, a partition)
/// leaves the socket waiting on TCP's retransmissions for some 15 minutes, and every
/// request that took a pooled connection with it. Past this deadline the call fails as a
/// timeout (503) and its connection is never pooled again.
pub(super) fn statement_deadline(statement_timeout: Option<Duration>) -> Duration {
    statement_timeout.map_or(Duration::from_secs(60), |timeout| {
        timeout.saturating_add(Duration::from_secs(1))
    })
}

/// `work`, `statements` statements on a checked-out connection, within `per_statement` each.
pub(super) async fn within<T>(
    per_statement: Duration,
    statements: u32,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let deadline = per_statement.saturating_mul(statements);
    tokio::time::timeout(deadline, work)
        .await
        .unwrap_or(Err(StoreError::Timeout(deadline)))
}

/// Gives `client` back to the pool after its statement ended, answered or refused; takes it
/// out of the pool after one that ran past its deadline (it may still be waiting, on the
/// database or on the network, until TCP gives up).
pub(super) fn ended<T>(client: Checkout, result: &Result<T, StoreError>) {
    if !matches!(result, Err(StoreError::Timeout(_))) {
        client.done();
    }
}
