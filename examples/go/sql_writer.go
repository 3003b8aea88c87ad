// A writer in Go that fences its own database writes with the SQL fence.
//
// It writes one effect (a charge) for a job at a fencing token, in one transaction that
// first calls require(job, token): when a newer holder of the job has already written
// (through this fence, a fence proxy or the Rust layer on the same database), the fence
// raises SQLSTATE ZF409 and the transaction, the charge with it, rolls back.
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

	"github.com/jackc/pgconn"
	"github.com/jackc/pgx/v4"
)

// charge writes the charge under the fence; false when the token is stale (nothing written).
func charge(ctx context.Context, conn *pgx.Conn, schema, job string, token uint64, amount int64) (bool, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) // a no-op after Commit
	// First in the transaction: the job's fence row stays locked until COMMIT.
	_, err = tx.Exec(ctx, "SELECT "+schema+".require($1, $2::text::numeric)", job, strconv.FormatUint(token, 10))
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
	token, err1 := strconv.ParseUint(os.Args[4], 10, 64)
	amount, err2 := strconv.ParseInt(os.Args[5], 10, 64)
	if err1 != nil || err2 != nil {
		fmt.Fprintln(os.Stderr, "TOKEN and AMOUNT are integers")
		os.Exit(1)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer conn.Close(ctx)
	written, err := charge(ctx, conn, os.Args[2], os.Args[3], token, amount)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if !written {
		os.Exit(3)
	}
}
