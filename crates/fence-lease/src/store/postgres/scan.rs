//! The store's scans of many rows: forgetting idle jobs, and listing.

use std::time::Duration;

use fence_core::JobId;
use fence_storage::postgres::Checkout;

use super::{
    PgLeaseStore, Snapshot,
    deadline::{ended, within},
};
use crate::store::{ListPage, ListQuery, MAX_LIST_SCAN, StoreError, page};

impl PgLeaseStore {
    pub(super) async fn forget_idle_rows(
        &self,
        idle_for: Duration,
        limit: usize,
    ) -> Result<usize, StoreError> {
        let idle = i64::try_from(idle_for.as_millis()).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        // Closed, not pooled, if this is dropped mid-transaction (see `Checkout`).
        let mut client = Checkout::of(&self.pool).await.map_err(StoreError::io)?;
        let row = within(self.statement_deadline, 2, async {
            let tx = client.transaction().await.map_err(StoreError::io)?;
            // The floor first: claims wait for this transaction from here on (every plain
            // claim reads the floor under a share lock, even of a job whose row exists:
            // PostgreSQL computes the INSERT's row before it meets the conflict).
            tx.execute(&self.sql.lock_floor, &[])
                .await
                .map_err(StoreError::io)?;
            let row = tx
                .query_opt(&self.sql.forget, &[&idle, &limit, &self.offset()])
                .await
                .map_err(StoreError::io)?;
            tx.commit().await.map_err(StoreError::io)?;
            Ok(row)
        })
        .await?;
        client.done();
        let gone: i64 = match row {
            Some(row) => row.try_get(0).map_err(StoreError::io)?,
            None => 0,
        };
        Ok(usize::try_from(gone).unwrap_or(0))
    }

    pub(super) async fn list_rows(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        // Rows in job order after `after` with the prefix (a primary key range), the state on
        // the database's clock; a row past what `page` may read tells it there is more (else
        // a filtered page matching few of MAX_LIST_SCAN rows ended with `next` null).
        let prefix = query.prefix.clone().unwrap_or_default();
        let after = query.after.as_ref().map_or("", JobId::as_str);
        let rows_read = match query.state {
            Some(_) => MAX_LIST_SCAN,
            None => query.limit().min(MAX_LIST_SCAN),
        } + 1;
        let scan = i64::try_from(rows_read).unwrap_or(i64::MAX);
        // A request that went away mid-statement closes its connection (see `Checkout`).
        let client = Checkout::of(&self.pool).await.map_err(StoreError::io)?;
        let rows = within(self.statement_deadline, 1, async {
            client
                .query(&self.sql.list, &[&after, &prefix, &scan, &self.offset()])
                .await
                .map_err(StoreError::io)
        })
        .await;
        ended(client, &rows);
        let rows = rows?;
        let records = rows.iter().map(|row| {
            let job: String = row.try_get(5).map_err(StoreError::io)?;
            let job = JobId::new(job).map_err(|_| StoreError::Corrupt {
                job: "(unreadable)".parse().expect("valid job id"),
                reason: "a job id is not visible ASCII",
            })?;
            Ok(Snapshot::from_row(&job, row)?.record(&job))
        });
        page(query, records)
    }
}
