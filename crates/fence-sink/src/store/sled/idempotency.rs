//! The idempotency records of the sled store: one per (job, key), in tree `idempotency`.

use std::time::Duration;

use fence_core::{JobId, headers::IdempotencyKey};

use super::{SledStore, Write, io};
use crate::store::{
    Attempt, Begin, Finish, IdempotencyStore, StoreError, ms, record, stored::entry_len,
};

/// The job of a [`record_key`]: its bytes before the 0.
pub(super) fn record_job(key: &[u8]) -> &[u8] {
    key.iter()
        .position(|&b| b == 0)
        .map_or(key, |end| &key[..end])
}

pub(super) fn record_key(job: &JobId, key: &IdempotencyKey) -> Vec<u8> {
    // A job id is visible ASCII, so 0x00 cannot occur in it and separates unambiguously.
    let mut k = Vec::with_capacity(job.as_str().len() + 1 + key.as_str().len());
    k.extend_from_slice(job.as_str().as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_str().as_bytes());
    k
}

impl IdempotencyStore for SledStore {
    async fn begin(&self, attempt: Attempt<'_>, in_flight: Duration) -> Result<Begin, StoreError> {
        let k = record_key(attempt.job, attempt.key);
        // On disk before the request goes on: a crash after the service acted must leave the
        // record in flight, so a retry gets 409 instead of running the effect again. (It
        // was not waited on once, to save a sync; the fault harness's duplicate check then
        // found writes applied twice after a proxy was killed.) Group commit shares the
        // sync among the requests of the moment.
        self.update_record(attempt.job, &k, Write::Decision, |cur| {
            let (write, answer) = record::begin(cur, &attempt, ms(in_flight), self.records_now());
            (write.map(Some), answer)
        })
        .await
    }

    async fn finish(&self, attempt: Attempt<'_>, outcome: Finish) -> Result<(), StoreError> {
        let k = record_key(attempt.job, attempt.key);
        self.update_record(attempt.job, &k, Write::Outcome, |cur| {
            let now = self.records_now();
            (record::finish(cur, &attempt, outcome.clone(), now), ())
        })
        .await
    }

    async fn purge_expired(&self) -> Result<usize, StoreError> {
        let now = self.records_now();
        // A walk of every record (millions, at a steady rate and a day's retention) runs
        // on a blocking thread, not the runtime's (a current-thread runtime would stall for
        // all of it), and reads each record's head only, not its stored answer.
        let (records, stored) = (self.records.clone(), self.stored.clone());
        let purged = tokio::task::spawn_blocking(move || {
            let mut purged = 0;
            for item in records.iter() {
                let (k, v) = item.map_err(io)?;
                let len = entry_len(&k, Some(&v));
                if !record::Record::live_at(&v, now)
                    && records
                        .compare_and_swap(&k, Some(v), None::<&[u8]>)
                        .map_err(io)?
                        .is_ok()
                {
                    stored.replaced(record_job(&k), len, None);
                    purged += 1;
                }
            }
            Ok::<usize, StoreError>(purged)
        })
        .await
        .map_err(io)??;
        if purged > 0 {
            self.db.commit().await.map_err(io)?;
        }
        Ok(purged)
    }

    fn stored_bytes(&self) -> Option<u64> {
        Some(self.stored.get())
    }

    fn job_stored_bytes(&self, job: &JobId) -> Option<u64> {
        Some(self.stored.of(job.as_str().as_bytes()))
    }
}
