#!/usr/bin/env python3
"""A writer in Python that fences its own database writes with the SQL fence.

It writes one effect (a charge) for a job at a fencing token, in one transaction that first
calls `require(job, token)`: when a newer holder of the job has already written (through
this fence, a `fence proxy` or the Rust layer on the same database), the fence raises
SQLSTATE ZF409 and the transaction, the charge with it, rolls back.

    python3 sql_writer.py DSN SCHEMA JOB TOKEN AMOUNT [HOLD_SECONDS]

Exit codes: 0 written, 3 refused as stale, 1 any other error. HOLD_SECONDS keeps the
transaction open after the check (the job's fence row stays locked), to show that a newer
writer waits for it. Needs psycopg 3 (`pip install "psycopg[binary]"`).
"""

import sys
import time

import psycopg


def charge(conn, schema, job, token, amount, hold=0.0):
    """Writes the charge under the fence; False when the token is stale (nothing written)."""
    try:
        with conn.transaction():
            # First in the transaction: the job's fence row stays locked until COMMIT.
            conn.execute(f"SELECT {schema}.require(%s, %s)", (job, token))
            time.sleep(hold)
            conn.execute(
                f"INSERT INTO {schema}.charges (job, token, amount) VALUES (%s, %s, %s)",
                (job, token, amount),
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
        written = charge(conn, schema, job, int(token), int(amount), hold)
    sys.exit(0 if written else 3)


if __name__ == "__main__":
    main()
