// A writer in Go that fences its own database writes with the SQL fence.
//
// It writes one effect (a charge) for a job at a fencing token, in one transaction that
// first calls require(job, token): when a newer holder of the job has already written
// (through this fence, a fence proxy or the Rust layer on the same database), the fence
// raises SQLSTATE ZF409 and the transaction, the charge with it, rolls back. TOKEN is the
// token as the lease server returned it: a plain generation, or a signed token
// G.EXPIRES_AT_MS.SIGNATURE, whose lease end is then passed too (require(job, token,
// expires_at_ms): stale once the lease has ended, which the fence needs while its sinks
// forget idle jobs).
//
//	go run sql_writer.go DSN SCHEMA JOB TOKEN AMOUNT
//
// Exit codes: 0 written, 3 refused as stale, 1 any other error. Uses pgx v4 (Debian:
// golang-github-jackc-pgx-v4-dev, built with GO111MODULE=off GOPATH=/usr/share/gocode).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// charge writes the charge under the fence; false when the token is stale (nothing written).
// A transaction aborted by a lock wait past the fence's 2 s timeout (55P03: another writer
// holds the job's row), a serialization failure (40001) or a deadlock (40P01) kept nothing,
// and is asked again after a pause, up to 10 times.
func charge(ctx context.Context, conn *pgx.Conn, schema, job string, token uint64, expiresAtMs *uint64, amount int64) (bool, error) {
	pause := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		written, err := chargeOnce(ctx, conn, schema, job, token, expiresAtMs, amount)
		var pgErr *pgconn.PgError
		retried := errors.As(err, &pgErr) && (pgErr.Code == "55P03" || pgErr.Code == "40001" || pgErr.Code == "40P01")
		if !retried || attempt == 10 {
			return written, err
		}
		time.Sleep(pause)
		if pause *= 2; pause > time.Second {
			pause = time.Second
		}
	}
}

// chargeOnce is one attempt of charge.
func chargeOnce(ctx context.Context, conn *pgx.Conn, schema, job string, token uint64, expiresAtMs *uint64, amount int64) (bool, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) // a no-op after Commit
	// First in the transaction: the job's fence row stays locked until COMMIT.
	if expiresAtMs == nil {
		_, err = tx.Exec(ctx, "SELECT "+schema+".require($1, $2::text::numeric)", job, strconv.FormatUint(token, 10))
	} else {
		_, err = tx.Exec(ctx, "SELECT "+schema+".require($1, $2::text::numeric, $3::text::bigint)",
			job, strconv.FormatUint(token, 10), strconv.FormatUint(*expiresAtMs, 10))
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "ZF409" {
		fmt.Fprintln(os.Stderr, "stale:", pgErr.Message)
		return false, nil
	}
	if err != nil {
		return false, err
	}
	_, err = tx.Exec(ctx, "INSERT INTO "+schema+".charges (job, token, amount) VALUES ($1, $2, $3)", job, int64(token), amount)
	if err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

func main() {
	if len(os.Args) != 6 {
		fmt.Fprintln(os.Stderr, "usage: sql_writer DSN SCHEMA JOB TOKEN AMOUNT")
		os.Exit(1)
	}
	parts := strings.Split(os.Args[4], ".")
	token, err1 := strconv.ParseUint(parts[0], 10, 64)
	var expiresAtMs *uint64
	if len(parts) == 3 {
		e, err := strconv.ParseUint(parts[1], 10, 64)
		if err != nil {
			err1 = err
		}
		expiresAtMs = &e
	} else if len(parts) != 1 {
		err1 = errors.New("a token has one part or three")
	}
	amount, err2 := strconv.ParseInt(os.Args[5], 10, 64)
	if err1 != nil || err2 != nil {
		fmt.Fprintln(os.Stderr, "TOKEN is a generation or a signed token, AMOUNT an integer")
		os.Exit(1)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close(ctx)
	written, err := charge(ctx, conn, os.Args[2], os.Args[3], token, expiresAtMs, amount)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if !written {
		os.Exit(3)
	}
}
