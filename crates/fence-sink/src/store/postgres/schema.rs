//! The DDL of the sink's PostgreSQL store: its tables, and the SQL fence's functions.

use super::{PgTables, STAMP_AHEAD_MS, ms};
use crate::store::{DEFAULT_CLOCK_SKEW, DEFAULT_MAX_LEASE_TTL};

/// What [`PgStore::migrate`](super::PgStore::migrate) runs: idempotent, in one transaction.
pub(super) fn ddl(tables: &PgTables) -> String {
    let PgTables {
        generations,
        idempotency,
        schema: _,
        observe_fn,
        require_fn,
        accept_fn,
        settings,
    } = tables;
    let now = fence_storage::postgres::NOW_MS;
    let half = STAMP_AHEAD_MS / 2;
    let default_max_lease_ttl_ms = ms(DEFAULT_MAX_LEASE_TTL);
    let default_skew_ms = ms(DEFAULT_CLOCK_SKEW);
    // Each function waits for a job's row at most as long as the fence's own sessions do,
    // whatever the writer's session allows (lock_timeout 0, PostgreSQL's default, waits for
    // ever): a newer writer behind an older one's stalled transaction gets SQLSTATE 55P03 and
    // can retry. The search path is fixed: the functions run as their owner.
    let config = format!(
        "SET search_path = pg_catalog, pg_temp SET lock_timeout = '{}ms'",
        fence_storage::postgres::SESSION_LOCK_TIMEOUT.as_millis()
    );
    // An index name is unqualified and lives in the table's schema.
    let stamps_index = format!(
        "{}_stamps",
        generations.rsplit('.').next().unwrap_or(generations)
    );
    // Every function the writers call checks its input first, so that a malformed job or
    // token is SQLSTATE 22023 before any other answer (forgetting's ZF428, an expired or
    // too-long-lived lease end), as the contract says.
    let check_input =
        "IF p_job IS NULL OR p_token IS NULL OR octet_length(p_job) NOT BETWEEN 1 AND 256
              OR p_job !~ '^[\x21-\x7e]+$' OR p_token < 1 OR p_token > 18446744073709551615
              OR p_token <> trunc(p_token) THEN
             RAISE EXCEPTION 'malformed fencing job or token: job %, token %', p_job, p_token
               USING ERRCODE = '22023';
           END IF;
";
    let ddl = format!(
        "CREATE TABLE IF NOT EXISTS {generations} (
           job text PRIMARY KEY,
           highest numeric(20, 0) NOT NULL CHECK (highest >= 0 AND highest <= 18446744073709551615),
           touched_ms bigint NOT NULL DEFAULT 0
         );
         ALTER TABLE {generations} ADD COLUMN IF NOT EXISTS touched_ms bigint NOT NULL DEFAULT 0;
         -- When highest was last raised (0: before this column, then the stamp counts).
         ALTER TABLE {generations} ADD COLUMN IF NOT EXISTS raised_ms bigint NOT NULL DEFAULT 0;
         CREATE INDEX IF NOT EXISTS {stamps_index} ON {generations} (touched_ms, job);
         CREATE TABLE IF NOT EXISTS {idempotency} (
           job text NOT NULL,
           key text NOT NULL,
           fingerprint bytea NOT NULL,
           in_flight boolean NOT NULL,
           record bytea NOT NULL,
           live_until_ms bigint NOT NULL,
           PRIMARY KEY (job, key)
         );
         -- The attempt that began an in-flight record (0: before attempts were kept),
         -- and the generation it was admitted with.
         ALTER TABLE {idempotency} ADD COLUMN IF NOT EXISTS attempt bigint NOT NULL DEFAULT 0;
         ALTER TABLE {idempotency} ADD COLUMN IF NOT EXISTS generation numeric(20, 0) NOT NULL DEFAULT 0;
         -- When the in-flight record's attempt can no longer be running, by the settings of
         -- the process that began it (0: before this column): a newer generation takes it
         -- over only from then on.
         ALTER TABLE {idempotency} ADD COLUMN IF NOT EXISTS settles_ms bigint NOT NULL DEFAULT 0;
         -- Whether the sinks on these tables forget idle jobs (then a check needs the
         -- token's lease end), and their allowed clock skew: one row, kept by them.
         CREATE TABLE IF NOT EXISTS {settings} (
           one boolean PRIMARY KEY DEFAULT true CHECK (one),
           forgetting boolean NOT NULL,
           clock_skew_ms bigint NOT NULL
         );
         -- The longest lease any of them accepts (NULL: the default, 24 h): a lease end
         -- beyond it is refused, as at the sinks.
         ALTER TABLE {settings} ADD COLUMN IF NOT EXISTS max_lease_ttl_ms bigint;
         -- The same, of the sinks that forget only (NULL: none recorded since these were
         -- kept): every sink on the tables checks expiry at least as strictly as they do.
         ALTER TABLE {settings} ADD COLUMN IF NOT EXISTS forgetting_clock_skew_ms bigint;
         ALTER TABLE {settings} ADD COLUMN IF NOT EXISTS forgetting_max_lease_ttl_ms bigint;
         -- The SQL fence (contract section 11): the store's decision, on the same table,
         -- for writers in any language. The functions run as their owner (the fence's
         -- role) with a fixed search_path: a writer needs EXECUTE on them and nothing
         -- on the tables, so it cannot lower the fence. Nobody but the owner may call
         -- the shared decision itself.
         CREATE OR REPLACE FUNCTION {accept_fn}(p_job text, p_token numeric) RETURNS boolean
         LANGUAGE plpgsql SECURITY DEFINER {config} AS $fence$
         DECLARE h numeric;
         BEGIN
{check_input}           -- Stale by what is committed: refused without a lock, so a stale check neither
           -- waits for the current holder's open transaction nor holds the row for its
           -- own. Safe: highest only rises, and a forgotten job's row held expired tokens.
           SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job;
           IF h > p_token THEN
             RETURN false;
           END IF;
           -- The row is written whenever the token is accepted, even when nothing changes
           -- (then only `highest`, to itself: no indexed column, so no index entry): a newer
           -- holder's transaction under REPEATABLE READ or SERIALIZABLE, whose snapshot was
           -- taken before this one committed, then fails on the row with 40001 instead of
           -- accepting its token on a snapshot that misses this holder's effect (PostgreSQL
           -- raises it for a row another transaction updated, not for one it only locked).
           -- Under READ COMMITTED it takes the row as this one left it and reads on.
           INSERT INTO {generations} AS g (job, highest, touched_ms, raised_ms)
               VALUES (p_job, p_token, {now} + {STAMP_AHEAD_MS}, {now})
             ON CONFLICT (job) DO UPDATE SET highest = excluded.highest,
               touched_ms = CASE WHEN g.highest < excluded.highest
                   OR g.touched_ms < excluded.touched_ms - {half}
                 THEN excluded.touched_ms ELSE g.touched_ms END,
               raised_ms = CASE WHEN g.highest < excluded.highest THEN excluded.raised_ms ELSE g.raised_ms END
             WHERE g.highest <= excluded.highest;
           IF FOUND THEN
             RETURN true;
           END IF;
           SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job FOR SHARE;
           RETURN h <= p_token;
         END
         $fence$;
         REVOKE ALL ON FUNCTION {accept_fn}(text, numeric) FROM PUBLIC;
         CREATE OR REPLACE FUNCTION {observe_fn}(p_job text, p_token numeric) RETURNS boolean
         LANGUAGE plpgsql SECURITY DEFINER {config} AS $fence$
         BEGIN
           {check_input}           IF EXISTS (SELECT 1 FROM {settings} WHERE forgetting) THEN
             RAISE EXCEPTION 'the sinks on this fence forget idle jobs: a check needs the token''s lease end (%(job, token, expires_at_ms))', 'observe'
               USING ERRCODE = 'ZF428';
           END IF;
           IF NOT {accept_fn}(p_job, p_token) THEN
             RETURN false;
           END IF;
           -- Forgetting may have been switched on, and this job forgotten, since the check
           -- above: the row just written would then be a stale token's, as the forgotten
           -- job's first. Looked at again (a new snapshot: the delete committed before the
           -- write, and the setting before the delete), the raise rolls the write back.
           IF EXISTS (SELECT 1 FROM {settings} WHERE forgetting) THEN
             RAISE EXCEPTION 'the sinks on this fence forget idle jobs: a check needs the token''s lease end (%(job, token, expires_at_ms))', 'observe'
               USING ERRCODE = 'ZF428';
           END IF;
           RETURN true;
         END
         $fence$;
         CREATE OR REPLACE FUNCTION {observe_fn}(p_job text, p_token numeric, p_expires_at_ms bigint)
         RETURNS boolean
         LANGUAGE plpgsql SECURITY DEFINER {config} AS $fence$
         DECLARE skew bigint; longest bigint; latest numeric;
         BEGIN
           {check_input}           IF p_expires_at_ms IS NULL OR p_expires_at_ms < 0 THEN
             RAISE EXCEPTION 'malformed lease end: %', p_expires_at_ms USING ERRCODE = '22023';
           END IF;
           SELECT s.clock_skew_ms, s.max_lease_ttl_ms INTO skew, longest FROM {settings} s;
           skew := coalesce(skew, {default_skew_ms});
           -- Neither side overflows a bigint, however late the lease end (both are >= 0): a
           -- lease end near 2^63 is refused as too long-lived below, not an error 22003.
           IF p_expires_at_ms < {now} - skew THEN
             RETURN false; -- the token's lease ended: stale, as at the sinks
           END IF;
           -- No lease the sinks accept ends later: a token claiming one could outlive the
           -- window they forget by (contract section 8). In numeric, for the same reason.
           latest := {now}::numeric + coalesce(longest, {default_max_lease_ttl_ms}) + skew;
           IF p_expires_at_ms > latest THEN
             RAISE EXCEPTION 'fencing token of job % claims a lease ending at % ms, after % ms, the latest the sinks accept (now plus their longest lease TTL plus the clock skew)', p_job, p_expires_at_ms, latest
               USING ERRCODE = 'ZF403';
           END IF;
           RETURN {accept_fn}(p_job, p_token);
         END
         $fence$;
         CREATE OR REPLACE FUNCTION {require_fn}(p_job text, p_token numeric) RETURNS void
         LANGUAGE plpgsql SECURITY DEFINER {config} AS $fence$
         DECLARE h numeric;
         BEGIN
           IF NOT {observe_fn}(p_job, p_token) THEN
             SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job;
             RAISE EXCEPTION 'stale fencing token: job %, token %, highest %', p_job, p_token, h
               USING ERRCODE = 'ZF409';
           END IF;
         END
         $fence$;
         CREATE OR REPLACE FUNCTION {require_fn}(p_job text, p_token numeric, p_expires_at_ms bigint)
         RETURNS void
         LANGUAGE plpgsql SECURITY DEFINER {config} AS $fence$
         DECLARE h numeric;
         BEGIN
           IF NOT {observe_fn}(p_job, p_token, p_expires_at_ms) THEN
             SELECT g.highest INTO h FROM {generations} g WHERE g.job = p_job;
             IF h IS NULL OR h <= p_token THEN
               RAISE EXCEPTION 'expired fencing token: job %, token %, its lease ended at % ms', p_job, p_token, p_expires_at_ms
                 USING ERRCODE = 'ZF409';
             END IF;
             RAISE EXCEPTION 'stale fencing token: job %, token %, highest %', p_job, p_token, h
               USING ERRCODE = 'ZF409';
           END IF;
         END
         $fence$;
         REVOKE ALL ON FUNCTION {observe_fn}(text, numeric) FROM PUBLIC;
         REVOKE ALL ON FUNCTION {observe_fn}(text, numeric, bigint) FROM PUBLIC;
         REVOKE ALL ON FUNCTION {require_fn}(text, numeric) FROM PUBLIC;
         REVOKE ALL ON FUNCTION {require_fn}(text, numeric, bigint) FROM PUBLIC;"
    );
    ddl
}
