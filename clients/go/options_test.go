// Auth, TLS, waiting claims, refusals as errors, job-id checks, derived idempotency keys.

package fence

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const secret = "s3cret-s3cret-s3cret"

func TestBearerTokenAndCAFile(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	cert, key := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	out, err := exec.Command("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
		"-keyout", key, "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1").CombinedOutput()
	if err != nil {
		t.Fatalf("openssl: %v %s", err, out)
	}
	auth := filepath.Join(dir, "auth")
	if err := os.WriteFile(auth, []byte("workers "+secret+" tls-*\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("  "+secret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := newStack(t, stackOpts{noProxy: true, scheme: "https", serverArgs: []string{"--tls-cert", cert, "--tls-key", key, "--auth-file", auth}})
	t.Setenv("FENCE_AUTH_TOKEN", "")
	t.Setenv("FENCE_CA_CERT", "")
	noop := func(context.Context, *Lease) error { return nil }

	if err := mustClient(t, s.serverURL, Options{AuthToken: secret, CAFile: cert, TTL: time.Second}).Run(ctx, "tls-1", noop, RunOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := mustClient(t, s.serverURL, Options{AuthTokenFile: tokenFile, CAFile: cert}).Run(ctx, "tls-2", noop, RunOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Setenv("FENCE_AUTH_TOKEN", secret+"\n") // a Kubernetes secret's newline is no part of it
	t.Setenv("FENCE_CA_CERT", cert)
	env := mustClient(t, s.serverURL, Options{})
	if err := env.Run(ctx, "tls-3", noop, RunOptions{}); err != nil {
		t.Fatal(err)
	}
	if rec, err := env.Status(ctx, "tls-3"); err != nil || rec.State != "completed" {
		t.Fatalf("%+v %v", rec, err)
	}
	var pe *ProblemError
	if _, err := env.Claim(ctx, "other-job"); !errors.As(err, &pe) || pe.Status != 403 || pe.Type != "urn:fence:forbidden" {
		t.Fatalf("outside the patterns: %v", err)
	}
	t.Setenv("FENCE_AUTH_TOKEN", "")
	// One a header cannot carry is refused at once, and never repeated in the error.
	for _, bad := range []string{secret + "\x01", secret[:8] + " " + secret[8:]} {
		if _, err := NewClient(s.serverURL, Options{AuthToken: bad}); err == nil || !strings.Contains(err.Error(), "Options.AuthToken") || strings.Contains(err.Error(), secret[:8]) {
			t.Fatalf("a secret a header cannot carry: %v", err)
		}
	}
	if _, err := mustClient(t, s.serverURL, Options{}).Claim(ctx, "tls-4"); !errors.As(err, &pe) || pe.Status != 401 || pe.Type != "urn:fence:unauthenticated" {
		t.Fatalf("without a token: %v", err)
	}
	t.Setenv("FENCE_CA_CERT", "")
	_, err = mustClient(t, s.serverURL, Options{AuthToken: secret}).Claim(ctx, "tls-5") // the system roots do not know it
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("without the CA file: %v", err)
	}
}

func TestWaitingClaimAndRefusals(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	holder := mustClient(t, s.serverURL, Options{Owner: "holder", TTL: time.Second})
	waiter := mustClient(t, s.serverURL, Options{Owner: "waiter", TTL: 1500 * time.Millisecond})
	held, err := holder.Claim(ctx, "wait-job")
	if err != nil {
		t.Fatal(err)
	}
	held.Abandon() // stops renewing: it runs out at the server in about a second
	var pe *ProblemError
	_, err = waiter.Claim(ctx, "wait-job")
	if !errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) || pe.Status != 409 || pe.Owner != "holder" || pe.ExpiresInMs == 0 || pe.ExpiresInMs > 1000 {
		t.Fatalf("a held job: %v %+v", err, pe)
	}
	started := time.Now()
	lease, err := waiter.ClaimWaiting(ctx, "wait-job", 5*time.Second)
	took := time.Since(started)
	if err != nil || lease.Generation() != 2 || took < 500*time.Millisecond || took > 2*time.Second {
		t.Fatalf("waiting claim: %v after %v", err, took)
	}
	// It waited most of a second of its 1.35 s of usable time: renewed at once, so the
	// deadline counts from that renewal, not from the claim sent a second ago.
	if left := time.Until(lease.Deadline()); left < 900*time.Millisecond {
		t.Fatalf("only %v left after a waiting claim", left)
	}
	if _, err := lease.Complete(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := waiter.ClaimWaiting(ctx, "wait-job", time.Second); !errors.Is(err, ErrJobCompleted) || !errors.As(err, &pe) || pe.Status != 410 || pe.Generation != 2 {
		t.Fatalf("a completed job: %v", err)
	}
	if _, err := waiter.Status(ctx, "never-claimed"); !errors.As(err, &pe) || pe.Status != 404 || pe.Type != "urn:fence:unknown-job" {
		t.Fatalf("an unknown job: %v", err)
	}
}

func TestLockDelayKeepsAnExpiredJobAndAWaitingClaimWaitsItOut(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	stalled := mustClient(t, s.serverURL, Options{Owner: "stalled", TTL: time.Second, LockDelay: 2 * time.Second})
	next := mustClient(t, s.serverURL, Options{Owner: "next", TTL: 5 * time.Second})
	held, err := stalled.Claim(ctx, "delayed")
	if err != nil {
		t.Fatal(err)
	}
	held.Abandon() // expires in about a second; its 2 s delay follows
	time.Sleep(1200 * time.Millisecond)
	var pe *ProblemError
	_, err = next.Claim(ctx, "delayed")
	if !errors.Is(err, ErrLockDelay) || !errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) || pe.Status != 409 ||
		pe.Owner != "stalled" || pe.Generation != 1 || pe.ClaimableInMs < 1000 || pe.ClaimableInMs > 2000 ||
		(pe.RetryAfter != time.Second && pe.RetryAfter != 2*time.Second) {
		t.Fatalf("a claim during the lock-delay: %v %+v", err, pe)
	}
	started := time.Now()
	lease, err := next.ClaimWaiting(ctx, "delayed", 5*time.Second)
	if err != nil || lease.Generation() != 2 || time.Since(started) < 800*time.Millisecond {
		t.Fatalf("waiting out the lock-delay: %v after %v", err, time.Since(started))
	}
	if _, err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := NewClient(s.serverURL, Options{LockDelay: -time.Second}); err == nil {
		t.Fatal("a negative lock-delay was taken")
	}
}

func TestAWorkerThatStopsReportingProgressLosesItsLease(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	c := mustClient(t, s.serverURL, Options{Owner: "bound", TTL: 900 * time.Millisecond, ProgressWithin: 600 * time.Millisecond})
	lease, err := c.Claim(ctx, "bound-job")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ { // 2 s of steady progress: renewed every 300 ms
		time.Sleep(200 * time.Millisecond)
		lease.Progress()
	}
	if err := lease.Err(); err != nil {
		t.Fatalf("lost despite progress: %v", err)
	}
	select {
	case <-lease.Done():
	case <-time.After(2 * time.Second):
		t.Fatal("still held 2 s after the last progress")
	}
	if err := lease.Err(); !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), "no progress") {
		t.Fatalf("lost how: %v", err)
	}
	if _, err := NewClient(s.serverURL, Options{ProgressWithin: -time.Second}); err == nil {
		t.Fatal("a negative ProgressWithin was taken")
	}
}

func TestProgressCountsFromAWaitingClaimsGrantNotItsSend(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	holder := mustClient(t, s.serverURL, Options{Owner: "holder", TTL: 10 * time.Second})
	held, err := holder.Claim(ctx, "progress-wait")
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(1200 * time.Millisecond); _, _ = held.Release(ctx) }()
	// Held for 1.2 s, longer than ProgressWithin: the grant must not count as stalled.
	c := mustClient(t, s.serverURL, Options{Owner: "waiter", TTL: 900 * time.Millisecond, ProgressWithin: 600 * time.Millisecond})
	lease, err := c.ClaimWaiting(ctx, "progress-wait", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = lease.Release(ctx) }()
	time.Sleep(450 * time.Millisecond) // past the first renewal (300 ms), no progress reported
	if err := lease.Err(); err != nil {
		t.Fatalf("lost right after a waiting claim's grant: %v", err)
	}
}

func TestACheckpointGoesToTheNextHolder(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	first := mustClient(t, s.serverURL, Options{Owner: "first", TTL: time.Second})
	second := mustClient(t, s.serverURL, Options{Owner: "second"})
	a, err := first.Claim(ctx, "resumable")
	if err != nil || a.Checkpoint() != nil {
		t.Fatalf("claim: %v, checkpoint %+v", err, a.Checkpoint())
	}
	if rec, err := a.SaveCheckpoint(ctx, "rows 0-999 done"); err != nil || rec.Generation != 1 {
		t.Fatalf("save: %v %+v", err, rec)
	}
	var pe *ProblemError
	if _, err := a.SaveCheckpoint(ctx, strings.Repeat("x", 8193)); !errors.As(err, &pe) || pe.Status != 413 {
		t.Fatalf("a checkpoint past the limit: %v", err)
	}
	a.Abandon()
	time.Sleep(1200 * time.Millisecond)
	b, err := second.Claim(ctx, "resumable")
	if err != nil || b.Checkpoint() == nil || *b.Checkpoint() != (Checkpoint{Generation: 1, Data: "rows 0-999 done"}) {
		t.Fatalf("the next claim: %v, checkpoint %+v", err, b.Checkpoint())
	}
	if _, err := a.SaveCheckpoint(ctx, "stale"); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("a lost lease saved: %v", err)
	}
	if _, err := b.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// 30 s asked, 2 s granted, 1.5 s margin: the deadline is 0.5 s after each send, before a
// third of the grant; renewals come halfway to it.
func TestAFixedMarginThatTakesMostOfACappedGrantStillRenewsInTime(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--max-ttl", "2s"}})
	c := mustClient(t, s.serverURL, Options{TTL: 30 * time.Second, Margin: 1500 * time.Millisecond})
	lease, err := c.Claim(ctx, "capped-margin")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if err := lease.Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestRenewalsFollowAShorterGrant(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--max-ttl", "600ms"}})
	lease, err := mustClient(t, s.serverURL, Options{TTL: 30 * time.Second}).Claim(ctx, "capped")
	if err != nil {
		t.Fatal(err)
	}
	if lease.TTL() != 600*time.Millisecond || time.Until(lease.Deadline()) > 600*time.Millisecond {
		t.Fatalf("ttl %v, deadline in %v", lease.TTL(), time.Until(lease.Deadline()))
	}
	time.Sleep(time.Second) // renewed every 200 ms, not every 10 s
	if err := lease.Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestInvalidJobIDsAreRefusedBeforeSending(t *testing.T) {
	nobody := mustClient(t, "http://127.0.0.1:9", Options{Owner: "ids"}) // would fail to connect if it sent
	for _, id := range []string{"a b", "", strings.Repeat("x", 257), "caf\u00e9", "tab\there", "\x7f"} {
		if _, err := nobody.Claim(context.Background(), id); !errors.Is(err, ErrInvalidJobID) {
			t.Fatalf("%q: %v", id, err)
		}
		if _, err := nobody.Status(context.Background(), id); !errors.Is(err, ErrInvalidJobID) {
			t.Fatalf("%q: %v", id, err)
		}
	}
}

func TestEncodingIsExactlyTheUnreservedSet(t *testing.T) {
	for in, want := range map[string]string{"a/b": "a%2Fb", "a%b": "a%25b", "a?b#c": "a%3Fb%23c", "a+b": "a%2Bb", "Az09-._~": "Az09-._~"} {
		if got, err := EncodeJob(in); err != nil || got != want {
			t.Fatalf("EncodeJob(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
}

func TestIdempotencyKeyMatchesTheBinary(t *testing.T) {
	out, err := exec.Command(fenceBin(t), "idempotency-key", "--job", "invoice-42", "--step", "charge").Output()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := IdempotencyKey("invoice-42", "charge"), strings.TrimSpace(string(out)); got != want {
		t.Fatalf("%q, want %q", got, want)
	}
}

func TestTimingOptionsAreChecked(t *testing.T) {
	for _, o := range []Options{{TTL: 50 * time.Millisecond}, {TTL: time.Second, Margin: time.Second}} {
		if _, err := NewClient("http://127.0.0.1:9", o); err == nil {
			t.Fatalf("%+v accepted", o)
		}
	}
	if _, err := NewClient("127.0.0.1:7700", Options{}); err == nil {
		t.Fatal("a server URL without a scheme accepted")
	}
}

func TestAServerURLWithAUserOrPasswordIsRefusedWithoutQuotingThem(t *testing.T) {
	// The server takes bearer secrets only, and the server URL is quoted in error messages.
	for _, server := range []string{"http://alice:hunter2-pw@127.0.0.1:7700", "https://alice@fence.example/",
		"http://alice:pa/hunter2-pw@127.0.0.1:7700"} {
		_, err := NewClient(server, Options{})
		if err == nil {
			t.Fatalf("%s accepted", server)
		}
		if msg := err.Error(); !strings.Contains(msg, "user or password") || !strings.Contains(msg, "AuthToken") ||
			strings.Contains(msg, "hunter2") || strings.Contains(msg, "alice") {
			t.Fatalf("%s: %s", server, msg)
		}
	}
	// A URL refused for its scheme is quoted without what it carries before an '@'.
	for _, server := range []string{"ftp://alice:hunter2-pw@127.0.0.1:7700", "alice:hunter2-pw@127.0.0.1:7700",
		"ftp://alice:pa/hunter2-pw@127.0.0.1:7700/x"} {
		_, err := NewClient(server, Options{})
		if err == nil {
			t.Fatalf("%s accepted", server)
		}
		if msg := err.Error(); !strings.Contains(msg, "must start with http:// or https://") ||
			!strings.Contains(msg, "127.0.0.1:7700") || strings.Contains(msg, "hunter2") || strings.Contains(msg, "alice") {
			t.Fatalf("%s: %s", server, msg)
		}
	}
}

func TestPrintingALeaseNeverShowsItsKey(t *testing.T) {
	l := &Lease{job: "inv-42", generation: 7, key: "secret-lease-key-0123456789"}
	for _, format := range []string{"%v", "%s", "%+v", "%#v"} {
		if out := fmt.Sprintf(format, l); strings.Contains(out, l.key) {
			t.Fatalf("%s shows the lease key: %s", format, out)
		}
	}
}

// Run's work sees the caller's cancellation (a Ctrl-C through signal.NotifyContext) and its
// values, and the job is released, not left held until its lease runs out.
func TestRunFollowsTheCallersContext(t *testing.T) {
	type key struct{}
	s := newStack(t, stackOpts{noProxy: true})
	c := mustClient(t, s.serverURL, Options{TTL: 30 * time.Second})
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), key{}, "trace-1"))
	defer cancel()
	started := time.Now()
	err := c.Run(parent, "cancelled-run", func(ctx context.Context, _ *Lease) error {
		if ctx.Value(key{}) != "trace-1" {
			t.Errorf("the caller's values are lost: %v", ctx.Value(key{}))
		}
		// Cancelled once the lease is held (a Ctrl-C while the work runs).
		time.AfterFunc(100*time.Millisecond, cancel)
		<-ctx.Done()
		return ctx.Err()
	}, RunOptions{})
	if !errors.Is(err, context.Canceled) || time.Since(started) > 10*time.Second {
		t.Fatalf("Run returned %v after %v", err, time.Since(started))
	}
	rec, err := c.Status(context.Background(), "cancelled-run")
	if err != nil || rec.State != "free" {
		t.Fatalf("the job is not released: %+v %v", rec, err)
	}
}

// A Run whose work panics (recovered by a caller) or calls runtime.Goexit (t.FailNow in a
// test) releases its job: before, the keeper renewed it for as long as the process lived.
func TestRunReleasesTheJobWhenTheWorkPanicsOrExitsItsGoroutine(t *testing.T) {
	s := newStack(t, stackOpts{noProxy: true})
	c := mustClient(t, s.serverURL, Options{TTL: 500 * time.Millisecond})
	other := mustClient(t, s.serverURL, Options{Owner: "other", TTL: 30 * time.Second})
	ends := map[string]func(){
		"panicking-run": func() { panic("boom") },
		"goexit-run":    runtime.Goexit,
	}
	for job, end := range ends {
		done := make(chan any)
		go func() {
			defer func() { done <- recover() }()
			_ = c.Run(context.Background(), job, func(context.Context, *Lease) error {
				end()
				return nil
			}, RunOptions{})
		}()
		recovered := <-done
		if job == "panicking-run" && recovered != "boom" {
			t.Fatalf("%s: the panic did not go on: recovered %v", job, recovered)
		}
		time.Sleep(1500 * time.Millisecond) // 3 TTLs: a kept lease would still be renewed
		lease, err := other.Claim(context.Background(), job)
		if err != nil {
			t.Fatalf("%s: the job is still held: %v", job, err)
		}
		_, _ = lease.Release(context.Background())
	}
}

// finishesAnswered is how many releases and completions reached the server (any answer),
// from its /metrics.
func finishesAnswered(t *testing.T, serverURL string) int {
	t.Helper()
	resp, err := http.Get(serverURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || !strings.Contains(string(body), "fence_lease_requests_total") {
		t.Fatalf("/metrics: %d %v %s", resp.StatusCode, err, body)
	}
	n := 0
	for _, line := range strings.Split(string(body), "\n") {
		if strings.HasPrefix(line, "fence_lease_requests_total{") &&
			(strings.Contains(line, `op="release"`) || strings.Contains(line, `op="complete"`)) {
			v, err := strconv.ParseFloat(line[strings.LastIndex(line, " ")+1:], 64)
			if err != nil {
				t.Fatalf("/metrics: %q: %v", line, err)
			}
			n += int(v)
		}
	}
	return n
}

// assertLeftToExpire checks that job's lease (owner "a") was neither released nor completed:
// b's claim is refused (held while the lease runs, then its lock-delay, never granted), and the
// server answered no release or completion at all.
func assertLeftToExpire(t *testing.T, b *Client, serverURL, job string) {
	t.Helper()
	ctx := context.Background()
	var pe *ProblemError
	lease, err := b.Claim(ctx, job)
	if err == nil {
		lease.Abandon()
	}
	if !errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) || pe.Owner != "a" ||
		(pe.Type != "urn:fence:lease-held" && pe.Type != "urn:fence:lock-delay") {
		t.Fatalf("%s: a second owner's claim: %v %+v", job, err, pe)
	}
	if rec, err := b.Status(ctx, job); err != nil || (rec.State != "held" && rec.State != "expired") {
		t.Fatalf("%s: %+v %v", job, rec, err)
	}
	if n := finishesAnswered(t, serverURL); n != 0 {
		t.Fatalf("%s: %d releases or completions reached the server", job, n)
	}
}

// Seen against `fence server --lock-delay 30s`: a Run whose work abandoned its lease after a
// write that may still land (a timeout, a 504), then failed, had the lease released, so the
// next claim was granted at once and the lock-delay never applied. An abandoned lease is
// neither released nor completed, however the work ends.
func TestRunNeitherReleasesNorCompletesALeaseTheWorkAbandoned(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	a := mustClient(t, s.serverURL, Options{Owner: "a", TTL: 10 * time.Second})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	leftToExpire := func(job string) {
		t.Helper()
		assertLeftToExpire(t, b, s.serverURL, job)
	}
	timedOut := errors.New("the write may still land")
	abandonThen := func(err error) func(context.Context, *Lease) error {
		return func(_ context.Context, lease *Lease) error {
			lease.Abandon()
			return err
		}
	}
	if err := a.Run(ctx, "fails", abandonThen(timedOut), RunOptions{}); err != timedOut {
		t.Fatalf("fails: Run returned %v", err)
	}
	leftToExpire("fails")
	// Work that returns nil after abandoning: no completion, and no *LeaseLostError.
	if err := a.Run(ctx, "returns", abandonThen(nil), RunOptions{}); err != nil {
		t.Fatalf("returns: Run returned %v", err)
	}
	leftToExpire("returns")
	if err := a.Run(ctx, "returns-release", abandonThen(nil), RunOptions{OnSuccessRelease: true}); err != nil {
		t.Fatalf("returns-release: Run returned %v", err)
	}
	leftToExpire("returns-release")
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("panics: recovered %v", r)
			}
		}()
		_ = a.Run(ctx, "panics", func(_ context.Context, lease *Lease) error {
			lease.Abandon()
			panic("boom")
		}, RunOptions{})
	}()
	leftToExpire("panics")
	lease, err := a.Claim(ctx, "counted")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if n := finishesAnswered(t, s.serverURL); n != 1 { // the count sees one when there is one
		t.Fatalf("%d releases or completions counted after one", n)
	}
}

// A defer lease.Release(ctx) written before the Abandon of a write that may still land sent
// the release: the next claim was granted at once, skipping the lock-delay. After Abandon,
// Release and Complete send nothing and return a *LeaseLostError.
func TestReleaseOrCompleteByHandAfterAbandonSendsNothing(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	a := mustClient(t, s.serverURL, Options{Owner: "a", TTL: 10 * time.Second})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	refusedUnsent := func(job string, err error) {
		t.Helper()
		var lost *LeaseLostError
		if !errors.Is(err, ErrLeaseLost) || !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) {
			t.Fatalf("%s: got %v, want a *LeaseLostError of the client's own", job, err)
		}
		if lost.Job != job || lost.InFlight || !strings.Contains(lost.Reason, "abandoned") ||
			!strings.Contains(lost.Reason, "lock-delay") || !strings.Contains(lost.Reason, "nothing was sent") {
			t.Fatalf("%s: %+v", job, lost)
		}
	}
	for _, action := range []string{"release", "complete"} {
		job := "by-hand-" + action
		end := func(lease *Lease) (err error) {
			if action == "release" {
				_, err = lease.Release(ctx)
			} else {
				_, err = lease.Complete(ctx)
			}
			return err
		}
		lease, err := a.Claim(ctx, job)
		if err != nil {
			t.Fatal(err)
		}
		var deferred error
		func() {
			defer func() { deferred = end(lease) }() // written early, as a defer is
			lease.Abandon()
			lease.Abandon() // idempotent
		}()
		refusedUnsent(job, deferred)
		refusedUnsent(job, end(lease)) // asked again: still nothing sent
		assertLeftToExpire(t, b, s.serverURL, job)
	}
	// Abandon after a release changes nothing: the release was sent, and is not undone.
	released, err := a.Claim(ctx, "released-then-abandoned")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := released.Release(ctx); err != nil {
		t.Fatal(err)
	}
	released.Abandon()
	if n := finishesAnswered(t, s.serverURL); n != 1 {
		t.Fatalf("%d releases or completions counted after one", n)
	}
	if rec, err := a.Status(ctx, "released-then-abandoned"); err != nil || rec.State != "free" {
		t.Fatalf("released-then-abandoned: %+v %v", rec, err)
	}
}

// silentDestination is a destination that takes each request and never answers (until the test
// ends): a write on its way when the lease is lost. Its URL, and how many requests reached it.
func silentDestination(t *testing.T) (string, *int32) {
	t.Helper()
	var reached int32
	release := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		atomic.AddInt32(&reached, 1)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { close(release); _ = srv.Close() })
	return "http://" + ln.Addr().String() + "/ledger", &reached
}

// Seen against `fence server --lock-delay 30s`: the keeper declared the lease lost (no
// progress) while a write to an unfenced upstream was on its way; Run released the lease, the
// server took the release (nobody had claimed since), and the next claim was granted at once
// while the write committed later. A lease lost while fn runs is neither released nor
// completed, however fn ends.
func TestRunNeitherReleasesNorCompletesALeaseLostWhileTheWorkRan(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	stalls := mustClient(t, s.serverURL, Options{Owner: "a", TTL: time.Second, ProgressWithin: 300 * time.Millisecond})
	a := mustClient(t, s.serverURL, Options{Owner: "a", TTL: time.Second})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	lostTo := func(job, why string, err error) {
		t.Helper()
		var lost *LeaseLostError
		if !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) || !strings.Contains(lost.Reason, why) {
			t.Fatalf("%s: Run returned %v, want a *LeaseLostError (%s)", job, err, why)
		}
	}
	url, reached := silentDestination(t)
	err := stalls.Run(ctx, "in-flight", func(_ context.Context, lease *Lease) error {
		hc := &http.Client{Transport: lease.Transport(nil)}
		resp, err := hc.Post(url, "text/plain", strings.NewReader("charge")) // cut by the loss
		if err == nil {
			resp.Body.Close()
			return errors.New("the silent destination answered")
		}
		return err
	}, RunOptions{})
	var inFlight *LeaseLostError
	if !errors.As(err, &inFlight) || !inFlight.InFlight {
		t.Fatalf("in-flight: Run returned %v, want the write's *LeaseLostError with InFlight", err)
	}
	lostTo("in-flight", "no progress", err)
	if n := atomic.LoadInt32(reached); n != 1 {
		t.Fatalf("in-flight: %d requests reached the destination", n)
	}
	assertLeftToExpire(t, b, s.serverURL, "in-flight")
	// fn returns nil after the loss: the *LeaseLostError, nothing sent.
	for _, onSuccessRelease := range []bool{false, true} {
		job := fmt.Sprintf("no-progress-%v", onSuccessRelease)
		err := stalls.Run(ctx, job, func(ctx context.Context, lease *Lease) error {
			lostWithin(t, lease, 10*time.Second)
			return nil
		}, RunOptions{OnSuccessRelease: onSuccessRelease})
		lostTo(job, "no progress", err)
		assertLeftToExpire(t, b, s.serverURL, job)
	}
	// The local deadline (renewals unanswered), and fn fails with its own error: that error.
	timedOut := errors.New("the write cut by the loss may still land")
	err = a.Run(ctx, "deadline-fails", func(_ context.Context, lease *Lease) error {
		t.Cleanup(pauseRenewals(lease))
		lostWithin(t, lease, 10*time.Second)
		if !strings.Contains(lease.Err().Error(), reasonDeadline) {
			t.Errorf("deadline-fails: %v", lease.Err())
		}
		return timedOut
	}, RunOptions{})
	if err != timedOut {
		t.Fatalf("deadline-fails: Run returned %v", err)
	}
	assertLeftToExpire(t, b, s.serverURL, "deadline-fails")
	// fn panics after the loss: nothing sent either, and the panic goes on.
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("panics: recovered %v", r)
			}
		}()
		_ = stalls.Run(ctx, "panics", func(_ context.Context, lease *Lease) error {
			lostWithin(t, lease, 10*time.Second)
			panic("boom")
		}, RunOptions{})
	}()
	assertLeftToExpire(t, b, s.serverURL, "panics")
}

// A defer lease.Release(ctx) after the keeper declared the lease lost sent the release, which
// the server took (nobody had claimed since): the lock-delay was skipped. Once the lease is lost
// here, Release sends nothing and returns a *LeaseLostError; Complete is still sent.
func TestReleaseByHandAfterALocalLossSendsNothing(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	stalls := mustClient(t, s.serverURL, Options{Owner: "a", TTL: time.Second, ProgressWithin: 300 * time.Millisecond})
	a := mustClient(t, s.serverURL, Options{Owner: "a", TTL: time.Second})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	refusedUnsent := func(job, why string, err error) {
		t.Helper()
		var lost *LeaseLostError
		if !errors.Is(err, ErrLeaseLost) || !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) {
			t.Fatalf("%s: got %v, want a *LeaseLostError of the client's own", job, err)
		}
		for _, part := range []string{why, "left to expire", "lock-delay", "nothing was sent"} {
			if lost.Job != job || lost.InFlight || !strings.Contains(lost.Reason, part) {
				t.Fatalf("%s: %+v (want %q)", job, lost, part)
			}
		}
	}
	claimLost := func(c *Client, job string, pause bool) *Lease {
		t.Helper()
		lease, err := c.Claim(ctx, job)
		if err != nil {
			t.Fatal(err)
		}
		if pause {
			t.Cleanup(pauseRenewals(lease))
		}
		lostWithin(t, lease, 10*time.Second)
		return lease
	}
	lease := claimLost(stalls, "no-progress", false)
	_, err := lease.Release(ctx)
	refusedUnsent("no-progress", "no progress", err)
	_, err = lease.Release(ctx) // asked again: still nothing sent
	refusedUnsent("no-progress", "no progress", err)
	assertLeftToExpire(t, b, s.serverURL, "no-progress")
	lease = claimLost(a, "deadline", true)
	_, err = lease.Release(ctx)
	refusedUnsent("deadline", reasonDeadline, err)
	assertLeftToExpire(t, b, s.serverURL, "deadline")
	// A semaphore slot's lease: the same.
	slot, err := stalls.ClaimSlot(ctx, "pool", 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	lostWithin(t, slot, 10*time.Second)
	_, err = slot.Release(ctx)
	refusedUnsent("pool#1", "no progress", err)
	if other, err := b.ClaimSlot(ctx, "pool", 1, 0); !errors.Is(err, ErrLeaseHeld) {
		if err == nil {
			other.Abandon()
		}
		t.Fatalf("pool: a second owner's slot claim: %v", err)
	}
	if n := finishesAnswered(t, s.serverURL); n != 0 {
		t.Fatalf("%d releases or completions reached the server", n)
	}
	// A completion after a loss is still sent: nobody can claim a completed job. (The lease is
	// still this owner's at the server, so it takes it.) A release after it is not sent.
	lease = claimLost(stalls, "completed-after-loss", false)
	if rec, err := lease.Complete(ctx); err != nil || rec.State != "completed" {
		t.Fatalf("completed-after-loss: %+v %v", rec, err)
	}
	_, err = lease.Release(ctx)
	refusedUnsent("completed-after-loss", "no progress", err)
	if n := finishesAnswered(t, s.serverURL); n != 1 {
		t.Fatalf("%d releases or completions counted after one completion", n)
	}
}

// failingGateway is a gateway in front of the lease server that answers every completion 502
// without passing it on (a blip: nothing applied) and passes the rest on. Its URL, and the
// paths of the releases and completions that reached it.
func failingGateway(t *testing.T, serverURL string) (string, func() []string) {
	t.Helper()
	target, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	var mu sync.Mutex
	var finishes []string
	gw := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/release") || strings.HasSuffix(r.URL.Path, "/complete") {
			mu.Lock()
			finishes = append(finishes, r.URL.Path)
			mu.Unlock()
		}
		if strings.HasSuffix(r.URL.Path, "/complete") {
			http.Error(w, "<html>502 Bad Gateway</html>", http.StatusBadGateway)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(gw.Close)
	return gw.URL, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), finishes...)
	}
}

// pastDeadline moves clock past lease's local deadline; the keeper, waiting on a real timer (a
// third of a 10 s TTL), has not noticed, so nothing has declared the lease lost yet.
func pastDeadline(t *testing.T, clock *jumpClock, lease *Lease) {
	t.Helper()
	clock.offset.Store(int64(time.Hour))
	if !clock.Now().After(lease.Deadline()) {
		t.Fatalf("%s: the clock is not past the deadline", lease.Job())
	}
	lease.mu.Lock()
	reason := lease.reason
	lease.mu.Unlock()
	if reason != "" {
		t.Fatalf("%s: already lost: %s", lease.Job(), reason)
	}
}

// The server takes a slot's completion as a release (the slot is freed at once): sent after a
// loss here, it let the next claimer in beside a write cut by the loss, skipping the lock-delay,
// as a release by hand did. Complete on a slot's lease lost here sends nothing.
func TestASlotsCompletionByHandAfterALocalLossSendsNothing(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	stalls := mustClient(t, s.serverURL, Options{Owner: "a", TTL: time.Second, ProgressWithin: 300 * time.Millisecond})
	clock := &jumpClock{}
	a := mustClient(t, s.serverURL, Options{Owner: "a", TTL: 10 * time.Second, Clock: clock})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	refusedUnsent := func(job, why string, err error) {
		t.Helper()
		var lost *LeaseLostError
		if !errors.Is(err, ErrLeaseLost) || !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) ||
			lost.Job != job || !strings.Contains(lost.Reason, why) || !strings.Contains(lost.Reason, "nothing was sent") {
			t.Fatalf("%s: got %v, want a *LeaseLostError of the client's own (%s)", job, err, why)
		}
	}
	slotLeftToExpire := func(resource string) {
		t.Helper()
		var pe *ProblemError
		other, err := b.ClaimSlot(ctx, resource, 1, 0)
		if err == nil {
			other.Abandon()
		}
		if !errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) || pe.Owner != "a" ||
			(pe.Type != "urn:fence:lease-held" && pe.Type != "urn:fence:lock-delay") {
			t.Fatalf("%s: a second owner's slot claim: %v %+v", resource, err, pe)
		}
		if n := finishesAnswered(t, s.serverURL); n != 0 {
			t.Fatalf("%s: %d releases or completions reached the server", resource, n)
		}
	}
	slot, err := stalls.ClaimSlot(ctx, "stalled", 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	lostWithin(t, slot, 10*time.Second)
	_, err = slot.Complete(ctx)
	refusedUnsent("stalled#1", "no progress", err)
	_, err = slot.Complete(ctx) // asked again: still nothing sent
	refusedUnsent("stalled#1", "no progress", err)
	slotLeftToExpire("stalled")
	// The local deadline passed, the keeper has not noticed yet: refused all the same.
	slot, err = a.ClaimSlot(ctx, "masked", 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	pastDeadline(t, clock, slot)
	_, err = slot.Complete(ctx)
	refusedUnsent("masked#1", reasonDeadline, err)
	if !errors.Is(slot.Err(), ErrLeaseLost) {
		t.Fatalf("masked: the lease's context is not done: %v", slot.Err())
	}
	slotLeftToExpire("masked")
	clock.offset.Store(0)
	slot, err = a.ClaimSlot(ctx, "abandoned", 1, 0)
	if err != nil {
		t.Fatal(err)
	}
	slot.Abandon()
	_, err = slot.Complete(ctx)
	refusedUnsent("abandoned#1", "abandoned", err)
	slotLeftToExpire("abandoned")
}

// Complete called once the local deadline had passed, before the keeper noticed, marked the
// lease finished, hiding the loss; when the completion then failed unapplied (a 502), a defer
// lease.Release(ctx) was sent and taken, letting the next holder in at once, skipping the
// lock-delay.
func TestAFailedCompletionPastTheDeadlineLetsNoReleaseOut(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--lock-delay", "30s"}})
	gw, finishes := failingGateway(t, s.serverURL)
	clock := &jumpClock{}
	a := mustClient(t, gw, Options{Owner: "a", TTL: 10 * time.Second, Clock: clock})
	b := mustClient(t, s.serverURL, Options{Owner: "b", TTL: 10 * time.Second})
	lease, err := a.Claim(ctx, "masked")
	if err != nil {
		t.Fatal(err)
	}
	pastDeadline(t, clock, lease)
	var pe *ProblemError
	if _, err := lease.Complete(ctx); !errors.As(err, &pe) || pe.Status != http.StatusBadGateway {
		t.Fatalf("the completion: %v, want the gateway's 502", err) // a plain job's: still sent
	}
	f := finishes()
	for _, path := range f {
		if path != "/v1/leases/masked/complete" {
			t.Fatalf("sent %v, want completions only", f)
		}
	}
	if len(f) == 0 {
		t.Fatal("the completion was not sent")
	}
	if err := lease.Err(); !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), reasonDeadline) {
		t.Fatalf("after the completion: %v, want the deadline's loss (not finished)", err)
	}
	completions := len(finishes())
	var lost *LeaseLostError
	if _, err := lease.Release(ctx); !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) ||
		!strings.Contains(lost.Reason, reasonDeadline) || !strings.Contains(lost.Reason, "nothing was sent") {
		t.Fatalf("the release: %v, want a *LeaseLostError, nothing sent", err)
	}
	if n := len(finishes()); n != completions {
		t.Fatalf("sent %v after the completions", finishes())
	}
	assertLeftToExpire(t, b, s.serverURL, "masked")
}

// closedPortURL is the URL of a loopback port nothing listens on (a connection is refused).
func closedPortURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	ln.Close()
	return url
}

// FENCE_SERVER may name several servers that share one database (`fence run --server
// http://a:7700,http://b:7700` passes it on as is); before, the whole list was taken for one
// URL and every call failed. A call moves on only from a server it could not connect to.
func TestAListOfServersMovesOnOnlyFromOneItCouldNotConnectTo(t *testing.T) {
	s := newStack(t, stackOpts{noProxy: true})
	down := closedPortURL(t)
	t.Setenv("FENCE_SERVER", down+", "+s.serverURL+"/")
	c := mustClient(t, "", Options{Owner: "listed", TTL: time.Second})
	err := c.Run(context.Background(), "listed", func(ctx context.Context, lease *Lease) error {
		time.Sleep(1200 * time.Millisecond) // renewed through the server that answered
		return lease.Err()
	}, RunOptions{})
	if err != nil {
		t.Fatalf("a run through the list: %v", err)
	}
	observer := mustClient(t, s.serverURL, Options{})
	if rec, err := observer.Status(context.Background(), "listed"); err != nil || rec.State != "completed" {
		t.Fatalf("not completed: %+v %v", rec, err)
	}
	// A server that took the request and did not answer may have decided it: the next one is
	// never asked.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var requests atomic.Int32
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = conn.Read(make([]byte, 65536))
			requests.Add(1)
			conn.Close()
		}
	}()
	hangup := "http://" + ln.Addr().String()
	_, err = mustClient(t, hangup+","+s.serverURL, Options{Owner: "listed"}).Claim(context.Background(), "unanswered")
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), hangup) {
		t.Fatalf("a server that did not answer: %v", err)
	}
	if n := requests.Load(); n != 1 {
		t.Fatalf("the hanging server saw %d requests", n)
	}
	var unknown *ProblemError
	if _, err := observer.Status(context.Background(), "unanswered"); !errors.As(err, &unknown) || unknown.Status != 404 {
		t.Fatalf("the next server was asked: %v", err)
	}
	// None answering: the last one's failure, named.
	_, err = mustClient(t, closedPortURL(t)+","+down, Options{}).Status(context.Background(), "x")
	if !errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), down) {
		t.Fatalf("no server answering: %v", err)
	}
	if _, err := NewClient(s.serverURL+",127.0.0.1:7700", Options{}); err == nil || !strings.Contains(err.Error(), "must start with http:// or https://") {
		t.Fatalf("a list with a URL without a scheme: %v", err)
	}
}
