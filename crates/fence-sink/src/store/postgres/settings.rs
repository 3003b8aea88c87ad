//! The sinks' settings row: whether any of them forgets idle jobs, and the bounds they check.

use std::time::Duration;

use fence_storage::postgres::Checkout;
use tokio_postgres::Row;

use super::{PgStore, StoreError, io, ms};
pub use crate::store::SinkSettings;

/// The columns [`from_row`] reads: the forgetting sinks' own bounds, or, on a
/// row recorded before those were kept, the bounds of every sink.
const RECORDED: &str = "forgetting, coalesce(forgetting_clock_skew_ms, clock_skew_ms), \
     coalesce(forgetting_max_lease_ttl_ms, max_lease_ttl_ms)";

/// What a settings row says ([`RECORDED`]'s columns).
fn from_row(row: &Row) -> Result<SinkSettings, StoreError> {
    let millis = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
    Ok(SinkSettings {
        forgetting: row.try_get(0).map_err(io)?,
        clock_skew: millis(row.try_get(1).map_err(io)?),
        max_lease_ttl: row.try_get::<_, Option<i64>>(2).map_err(io)?.map(millis),
    })
}

impl PgStore {
    /// What the sinks on these tables have recorded, without recording anything (`None`: no
    /// sink has yet): read before a sink records its own, so that one that may not run on
    /// these tables leaves the row as it was.
    ///
    /// # Errors
    /// When the database cannot be reached.
    pub async fn recorded_settings(&self) -> Result<Option<SinkSettings>, StoreError> {
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let row = client
            .query_opt(
                &format!("SELECT {RECORDED} FROM {}", self.tables.settings),
                &[],
            )
            .await;
        client.done();
        row.map_err(io)?.as_ref().map(from_row).transpose()
    }

    /// Records, for the SQL fence's writers, that the sinks on these tables forget idle jobs
    /// (when `forgetting`), the clock skew they allow and the longest lease they accept (one
    /// row for all of them). While they forget, `observe` and `require` without the token's
    /// lease end are refused (SQLSTATE `ZF428`): a stale writer of a forgotten job would
    /// otherwise pass as a new job's first; a lease end later than now plus the longest
    /// lease plus the skew is refused (`ZF403`), as at the sinks (docs/protocol.md section 11).
    ///
    /// What is recorded only ever gets stricter, whoever records it: forgetting, once on,
    /// stays on (a job forgotten before cannot be told from a new one, and a sink started
    /// without `--forget-after` must not switch the check off for the others), and the skew
    /// and the longest lease are the smallest any sink has recorded. To undo it, an operator
    /// deletes the row, knowing that.
    ///
    /// Returns what the row says now ([`SinkSettings`]).
    ///
    /// # Errors
    /// When the database cannot be reached or refuses the write.
    pub async fn announce_forgetting(
        &self,
        forgetting: bool,
        clock_skew: Duration,
        max_lease_ttl: Duration,
    ) -> Result<SinkSettings, StoreError> {
        // Given back only once its statement ended (the settings row may be locked).
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let row = client
            .query_one(
                &format!(
                    "INSERT INTO {settings} AS s (one, forgetting, clock_skew_ms, max_lease_ttl_ms,
                         forgetting_clock_skew_ms, forgetting_max_lease_ttl_ms)
                       VALUES (true, $1::boolean, $2::bigint, $3::bigint,
                         CASE WHEN $1::boolean THEN $2::bigint END,
                         CASE WHEN $1::boolean THEN $3::bigint END)
                     ON CONFLICT (one) DO UPDATE SET
                       forgetting = s.forgetting OR excluded.forgetting,
                       clock_skew_ms = LEAST(s.clock_skew_ms, excluded.clock_skew_ms),
                       max_lease_ttl_ms = LEAST(s.max_lease_ttl_ms, excluded.max_lease_ttl_ms),
                       forgetting_clock_skew_ms =
                         LEAST(s.forgetting_clock_skew_ms, excluded.forgetting_clock_skew_ms),
                       forgetting_max_lease_ttl_ms =
                         LEAST(s.forgetting_max_lease_ttl_ms, excluded.forgetting_max_lease_ttl_ms)
                     RETURNING {RECORDED}",
                    settings = self.tables.settings
                ),
                &[&forgetting, &ms(clock_skew), &ms(max_lease_ttl)],
            )
            .await;
        client.done();
        let recorded = from_row(&row.map_err(io)?)?;
        if recorded.forgetting {
            self.forgetting
                .store(true, std::sync::atomic::Ordering::Release);
        }
        Ok(recorded)
    }

    /// Records that these tables' jobs are forgotten, before this process deletes the
    /// first (a layer that forgets without [`announce_forgetting`](Self::announce_forgetting)
    /// still switches the SQL fence's lease-end check on; the skew and the longest lease
    /// stay as recorded, or the defaults).
    pub(super) async fn forgetting_recorded(&self) -> Result<(), StoreError> {
        if self.forgetting.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        // Given back only once its statement ended (the settings row may be locked).
        let client = Checkout::of(&self.pool).await.map_err(io)?;
        let done = client
            .execute(
                &format!(
                    "INSERT INTO {settings} AS s (one, forgetting, clock_skew_ms)
                       VALUES (true, true, $1)
                     ON CONFLICT (one) DO UPDATE SET forgetting = true",
                    settings = self.tables.settings
                ),
                &[&ms(crate::store::DEFAULT_CLOCK_SKEW)],
            )
            .await;
        client.done();
        done.map_err(io)?;
        self.forgetting
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }
}
