#!/usr/bin/env python3
"""A writer in Python that fences its own database writes with the SQL fence.

It writes one effect (a charge) for a job at a fencing token, in one transaction that first
calls `require(job, token)`: when a newer holder of the job has already written (through
this fence, a `fence proxy` or the Rust layer on the same database), the fence raises
SQLSTATE ZF409 and the transaction, the charge with it, rolls back. TOKEN is the token as the
lease server returned it: a plain generation, or a signed token `G.EXPIRES_AT_MS.SIGNATURE`,
whose lease end is then passed too (`require(job, token, expires_at_ms)`: stale once the
lease has ended, which the fence needs while its sinks forget idle jobs).

    python3 sql_writer.py DSN SCHEMA JOB TOKEN AMOUNT [HOLD_SECONDS]

Exit codes: 0 written, 3 refused as stale, 1 any other error. HOLD_SECONDS keeps the
transaction open after the check (the job's fence row stays locked), to show that a newer
writer waits for it. The fence waits for a job's row at most 2 s, then raises 55P03: the
whole transaction is then asked again after a pause, as after a serialization failure
(40001) or a deadlock (40P01), up to 10 times. Needs psycopg 3 (`pip install "psycopg[binary]"`).
"""

import sys
import time

import psycopg

# Asked again: the fence's lock timeout, a serialization failure, a deadlock. Nothing of the
# aborted transaction was kept.
RETRIED = {"55P03", "40001", "40P01"}
ATTEMPTS = 10


def parse_token(token):
    """(generation, lease end in ms or None) of a plain or signed token string."""
    parts = token.split(".")
    if len(parts) == 3:
        return int(parts[0]), int(parts[1])
    return int(token), None


def charge(conn, schema, job, token, amount, hold=0.0):
    """Writes the charge under the fence; False when the token is stale (nothing written).
    A transaction aborted by a lock wait past the fence's timeout (another writer holds the
    job's row), a serialization failure or a deadlock is asked again after a pause."""
    for attempt in range(ATTEMPTS):
        try:
            return charge_once(conn, schema, job, token, amount, hold)
        except psycopg.Error as e:
            if e.sqlstate not in RETRIED or attempt == ATTEMPTS - 1:
                raise
            time.sleep(min(0.05 * 2**attempt, 1.0))
    raise AssertionError("unreachable")


def charge_once(conn, schema, job, token, amount, hold):
    """One attempt of `charge`."""
    generation, expires_at_ms = parse_token(str(token))
    try:
        with conn.transaction():
            # First in the transaction: the job's fence row stays locked until COMMIT.
            if expires_at_ms is None:
                conn.execute(f"SELECT {schema}.require(%s, %s)", (job, generation))
            else:
                conn.execute(
                    f"SELECT {schema}.require(%s, %s, %s)", (job, generation, expires_at_ms)
                )
            time.sleep(hold)
            conn.execute(
                f"INSERT INTO {schema}.charges (job, token, amount) VALUES (%s, %s, %s)",
                (job, generation, amount),
            )
        return True
    except psycopg.Error as e:
        if e.sqlstate == "ZF409":
            print(f"stale: {e.diag.message_primary}", file=sys.stderr)
            return False
        raise


def main():
    dsn, schema, job, token, amount = sys.argv[1:6]
    hold = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        written = charge(conn, schema, job, token, int(amount), hold)
    sys.exit(0 if written else 3)


if __name__ == "__main__":
    main()
