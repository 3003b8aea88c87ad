//! A request's idempotency statements, on a connection its caller checked out.
//!
//! The caller gives the connection back (`Checkout::done`) only once they have ended.

use std::time::Duration;

use super::{PgStore, io, ms, now_ms, signed};
use crate::store::{Attempt, Begin, Finish, StoreError, record::Record};

impl PgStore {
    /// [`IdempotencyStore::begin`] on `client`.
    pub(super) async fn begin_on(
        &self,
        client: &tokio_postgres::Client,
        attempt: Attempt<'_>,
        in_flight: Duration,
    ) -> Result<Begin, StoreError> {
        let t = &self.tables.idempotency;
        let record = crate::store::record::in_flight(&attempt, 0).encode();
        // One statement decides: a new record, one that is no longer live, or one in flight
        // for an older generation that can no longer be running, is taken over. Several
        // processes share these tables, and the fence of this one drained only the requests
        // it admitted: the older attempt may be running through another (or through this
        // one's process before a restart) until `settles_ms`, which the process that began
        // it set from its own longest request and hold (`Attempt::settled_after`).
        let started = client
            .query_opt(
                &format!(
                    "INSERT INTO {t} AS i (job, key, fingerprint, in_flight, record, live_until_ms, attempt, generation, settles_ms)
                     VALUES ($1, $2, $3, true, $4, {now} + $5::bigint, $7, $8::text::numeric, {now} + $9::bigint)
                     ON CONFLICT (job, key) DO UPDATE SET fingerprint = excluded.fingerprint, in_flight = true,
                       record = excluded.record, live_until_ms = excluded.live_until_ms,
                       attempt = excluded.attempt, generation = excluded.generation,
                       settles_ms = excluded.settles_ms
                     WHERE i.live_until_ms <= {now}
                        OR (i.in_flight AND i.generation > 0 AND i.generation < excluded.generation
                            AND i.settles_ms > 0 AND i.settles_ms <= {now})
                     RETURNING 1",
                    now = now_ms(6)
                ),
                &[
                    &attempt.job.as_str(),
                    &attempt.key.as_str(),
                    &&attempt.fingerprint.0[..],
                    &record,
                    &ms(in_flight),
                    &self.offset(),
                    &signed(attempt.id),
                    &attempt.generation.get().to_string(),
                    &ms(attempt.settled_after),
                ],
            )
            .await
            .map_err(io)?;
        if started.is_some() {
            return Ok(Begin::Started);
        }
        let row = client
            .query_opt(
                &format!("SELECT record FROM {t} WHERE job = $1 AND key = $2"),
                &[&attempt.job.as_str(), &attempt.key.as_str()],
            )
            .await
            .map_err(io)?;
        let Some(row) = row else {
            // Deleted in between (a forgotten 5xx): the next attempt starts it.
            return Ok(Begin::InFlight);
        };
        let bytes: Vec<u8> = row.try_get(0).map_err(io)?;
        let record = Record::decode(&bytes).map_err(|reason| StoreError::Corrupt {
            job: attempt.job.clone(),
            reason,
        })?;
        if let Record::InFlight { generation, .. } = record
            && generation != 0
            && generation < attempt.generation.get()
        {
            // An older generation's attempt that may still be running: this one waits for
            // it, whatever its own body (a newer holder's request for the same step may
            // differ), rather than being told the key was used for another request.
            return Ok(Begin::InFlight);
        }
        Ok(if record.fingerprint() != attempt.fingerprint {
            Begin::Mismatch
        } else {
            match record {
                Record::InFlight { .. } => Begin::InFlight,
                Record::Done {
                    response: Some(r), ..
                } => Begin::Replay(r),
                Record::Done { response: None, .. } => Begin::NotReplayable,
            }
        })
    }

    /// [`IdempotencyStore::finish`] on `client`.
    pub(super) async fn finish_on(
        &self,
        client: &tokio_postgres::Client,
        attempt: Attempt<'_>,
        outcome: Finish,
    ) -> Result<(), StoreError> {
        let t = &self.tables.idempotency;
        // This attempt's in-flight record: one it began, or one from before attempts were
        // kept with its fingerprint.
        let mine = "job = $1 AND key = $2 AND in_flight
                    AND (attempt = $7 OR (attempt = 0 AND fingerprint = $3))";
        let (job_s, key_s, fp_s) = (
            attempt.job.as_str(),
            attempt.key.as_str(),
            &attempt.fingerprint.0[..],
        );
        let id = signed(attempt.id);
        let response = match outcome {
            Finish::Forget => {
                client
                    .execute(
                        &format!("DELETE FROM {t} WHERE {}", mine.replace("$7", "$4")),
                        &[&job_s, &key_s, &fp_s, &id],
                    )
                    .await
                    .map_err(io)?;
                return Ok(());
            }
            Finish::Store {
                response,
                retention,
            } => (Some(response), retention),
            Finish::TooLarge { retention } => (None, retention),
        };
        let (response, retention) = response;
        let record = Record::Done {
            fingerprint: *attempt.fingerprint,
            expires_ms: 0,
            response,
        }
        .encode();
        client
            .execute(
                &format!(
                    "UPDATE {t} SET in_flight = false, record = $4, live_until_ms = {now} + $5::bigint WHERE {mine}",
                    now = now_ms(6)
                ),
                &[
                    &job_s,
                    &key_s,
                    &fp_s,
                    &record,
                    &ms(retention),
                    &self.offset(),
                    &id,
                ],
            )
            .await
            .map_err(io)?;
        Ok(())
    }
}
