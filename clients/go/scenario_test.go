// The acceptance scenario against the real server and proxy: the seed's worked example, a
// worker whose wall clock is an hour off (an injected clock: Go reads time through the vDSO,
// which libfaketime cannot reach), a server that stops answering, job ids that need encoding.

package fence

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

const job = "invoice-42"

func sixEarlierRuns(t *testing.T, server string) {
	ctx := context.Background()
	earlier := mustClient(t, server, Options{Owner: "earlier-runs", TTL: time.Second})
	for n := uint64(1); n <= 5; n++ {
		err := earlier.Run(ctx, job, func(ctx context.Context, l *Lease) error {
			if l.Generation() != n {
				t.Errorf("generation %d, want %d", l.Generation(), n)
			}
			return nil
		}, RunOptions{OnSuccessRelease: true})
		if err != nil {
			t.Fatal(err)
		}
	}
	failed := errors.New("the job failed")
	err := earlier.Run(ctx, job, func(ctx context.Context, l *Lease) error { return failed }, RunOptions{})
	if !errors.Is(err, failed) {
		t.Fatalf("Run returned %v, want the callback's error", err)
	}
	rec, err := earlier.Status(ctx, job)
	if err != nil || rec.State != "free" || rec.Generation != 6 {
		t.Fatalf("after six runs: %+v %v", rec, err)
	}
}

func TestWorkedExample(t *testing.T) {
	for _, signing := range []bool{true, false} {
		name := map[bool]string{true: "signed", false: "plain"}[signing]
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s := newStack(t, stackOpts{signing: signing})
			ledger := s.proxyURL + "/ledger"
			sixEarlierRuns(t, s.serverURL)

			a := mustClient(t, s.serverURL, Options{Owner: "worker-a", TTL: 2 * time.Second})
			leaseA, err := a.Claim(ctx, job)
			if err != nil {
				t.Fatal(err)
			}
			first, _ := leaseA.Token()
			if leaseA.Generation() != 7 || (signing && len(strings.Split(first, ".")) != 3) || (!signing && first != "7") {
				t.Fatalf("generation %d, token %q", leaseA.Generation(), first)
			}
			httpA := &http.Client{Transport: leaseA.Transport(nil)}
			if resp, err := post(t, httpA, ledger, "A: charge 10 EUR"); err != nil || resp.StatusCode != 200 {
				t.Fatalf("A's first write: %v %v", resp, err)
			}
			time.Sleep(2200 * time.Millisecond) // past the TTL: renewals keep it
			now, err := leaseA.Token()
			if err != nil || (signing && now == first) {
				t.Fatalf("after renewals: %q %v (a signing server signs each renewal anew)", now, err)
			}
			if resp, err := post(t, httpA, ledger, "A: note"); err != nil || resp.StatusCode != 200 {
				t.Fatalf("A's second write: %v %v", resp, err)
			}
			if last := s.upstream.all()[1]; last.Token != now || last.Job != job {
				t.Fatalf("the newest token is sent: %+v, want %q", last, now)
			}

			lateToken := now                // A decides to write once more with the token it holds...
			resume := pauseRenewals(leaseA) // ...and stalls before the write goes out
			defer resume()
			lostAt := lostWithin(t, leaseA, 3*time.Second)
			if exp := int64(leaseA.ExpiresAtMs()); lostAt >= exp {
				t.Fatalf("lost at %d, not before the server's expiry %d", lostAt, exp)
			}
			if err := leaseA.Err(); !errors.Is(err, ErrLeaseLost) || !strings.Contains(err.Error(), "deadline") {
				t.Fatalf("Err: %v", err)
			}
			sent := len(s.upstream.all())
			if _, err := post(t, httpA, ledger, "A: refund"); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("the transport sent after the loss: %v", err)
			}
			if len(s.upstream.all()) != sent {
				t.Fatal("the transport sent something after the loss")
			}

			b := mustClient(t, s.serverURL, Options{Owner: "worker-b", TTL: 5 * time.Second})
			err = b.Run(ctx, job, func(ctx context.Context, leaseB *Lease) error {
				if leaseB.Generation() != 8 {
					t.Errorf("B's generation %d", leaseB.Generation())
				}
				httpB := &http.Client{Transport: leaseB.Transport(nil)}
				if resp, err := post(t, httpB, ledger, "B: charge 10 EUR"); err != nil || resp.StatusCode != 200 {
					t.Errorf("B's write: %v %v", resp, err)
				}
				// A's held-up write arrives, sent raw (no client check): the proxy refuses it.
				status, problem := raw(t, "POST", ledger, map[string]string{"X-Fencing-Job": job, "X-Fencing-Token": lateToken}, "A: refund")
				if status != 409 || problem["type"] != "urn:fence:stale-token" {
					t.Errorf("A's late write: %d %v", status, problem)
				}
				req, _ := http.NewRequest("POST", ledger, strings.NewReader("A: refund"))
				req.Header.Set("X-Fencing-Job", job)
				req.Header.Set("X-Fencing-Token", lateToken)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				var pe *ProblemError
				if err := ProblemFromResponse(resp); !errors.Is(err, ErrStaleToken) || !errors.As(err, &pe) || strings.Split(pe.Highest, ".")[0] != "8" {
					t.Errorf("as a problem: %v %+v", err, pe)
				}
				_, err = leaseA.Complete(ctx)
				if !errors.As(err, &pe) || !errors.Is(err, ErrLeaseRefused) || !errors.Is(err, ErrLeaseLost) ||
					pe.Status != 409 || pe.Type != "urn:fence:lease-lost" || pe.Owner != "worker-b" || pe.Generation != 8 {
					t.Errorf("A's completion: %v %+v", err, pe)
				}
				return nil
			}, RunOptions{Wait: 5 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			if rec, err := b.Status(ctx, job); err != nil || rec.State != "completed" {
				t.Fatalf("B completed: %+v %v", rec, err)
			}
			var got []string
			for _, w := range s.upstream.all() {
				got = append(got, strings.Split(w.Token, ".")[0]+" "+w.Body)
			}
			if strings.Join(got, "|") != "7 A: charge 10 EUR|7 A: note|8 B: charge 10 EUR" {
				t.Fatalf("what reached the service: %q", got)
			}
		})
	}
}

// offsetClock reads the wall clock off by an hour, without the monotonic reading, so every
// comparison the client makes uses that wrong wall time.
type offsetClock struct{ offset time.Duration }

func (c offsetClock) Now() time.Time { return time.Now().Round(0).Add(c.offset) }

func TestClockOffset(t *testing.T) {
	s := newStack(t, stackOpts{})
	var wg sync.WaitGroup
	for _, offset := range []time.Duration{time.Hour, -time.Hour} {
		offset := offset
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			name := "offset" + offset.String()
			c := mustClient(t, s.serverURL, Options{Owner: name, TTL: 2 * time.Second, Clock: offsetClock{offset}})
			lease, err := c.Claim(ctx, name)
			if err != nil {
				t.Errorf("%s: %v", name, err)
				return
			}
			client := &http.Client{Transport: lease.Transport(nil)}
			if resp, err := post(t, client, s.proxyURL+"/ledger", "write 1"); err != nil || resp.StatusCode != 200 {
				t.Errorf("%s: write 1: %v %v", name, resp, err)
				return
			}
			time.Sleep(2500 * time.Millisecond) // past the TTL: only renewals keep it
			if err := lease.Err(); err != nil {
				t.Errorf("%s: lost while renewing: %v", name, err)
				return
			}
			if resp, err := post(t, client, s.proxyURL+"/ledger", "write 2"); err != nil || resp.StatusCode != 200 {
				t.Errorf("%s: write 2: %v %v", name, resp, err)
			}
			defer pauseRenewals(lease)()
			select {
			case <-lease.Done():
				if at, exp := time.Now().UnixMilli(), int64(lease.ExpiresAtMs()); at >= exp {
					t.Errorf("%s: lost at %d, after the server's expiry %d", name, at, exp)
				}
			case <-time.After(4 * time.Second):
				t.Errorf("%s: the lease's context was not done", name)
				return
			}
			if _, err := post(t, client, s.proxyURL+"/ledger", "write 3"); !errors.Is(err, ErrLeaseLost) {
				t.Errorf("%s: sent after the loss: %v", name, err)
			}
		}()
	}
	wg.Wait()
	if n := len(s.upstream.all()); n != 4 {
		t.Fatalf("%d writes reached the service, want 4", n)
	}
}

func TestServerStopsAnswering(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{})
	c := mustClient(t, s.serverURL, Options{Owner: "stopped", TTL: 2 * time.Second})
	var leases []*Lease
	for _, j := range []string{"stopped-1", "stopped-2"} {
		l, err := c.Claim(ctx, j)
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l)
	}
	time.Sleep(2200 * time.Millisecond) // past the TTL: renewals keep both
	for _, l := range leases {
		if err := l.Err(); err != nil {
			t.Fatal(err)
		}
	}
	s.server.signal(t, syscall.SIGSTOP)
	defer s.server.signal(t, syscall.SIGCONT)
	stoppedAt := time.Now().UnixMilli()
	for _, l := range leases {
		at := lostWithin(t, l, 4*time.Second)
		if exp := int64(l.ExpiresAtMs()); at <= stoppedAt || at >= exp {
			t.Fatalf("%s: stopped %d, lost %d, server expiry %d", l.Job(), stoppedAt, at, exp)
		}
		if err := l.Err(); !strings.Contains(err.Error(), "deadline") {
			t.Fatalf("%s: %v", l.Job(), err)
		}
		client := &http.Client{Transport: l.Transport(nil)}
		if _, err := post(t, client, s.proxyURL+"/ledger", "late"); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("%s: sent after the loss: %v", l.Job(), err)
		}
	}
	if n := len(s.upstream.all()); n != 0 {
		t.Fatalf("%d writes reached the service", n)
	}
}

// Job ids that need percent-encoding round-trip through claim, status, the proxy and a revoke
// (whose refused renewal must cancel the context). A '#' is a semaphore slot's
// ("<resource>#<slot>"): the last id is the slot of resource "a?b", claimed as one.
var jobIDs = []string{"a/b", "a%b", "a?b", "a+b", "a%2Fb", "..", ".", "~x_y-z.", "\"'\\<>{}|^`!$&()*,;=:@[", "a?b#1"}

func TestJobIDs(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{})
	c := mustClient(t, s.serverURL, Options{Owner: "ids", TTL: time.Second})
	var leases []*Lease
	for _, id := range jobIDs {
		claim := func() (*Lease, error) { return c.Claim(ctx, id) }
		if strings.HasSuffix(id, "#1") {
			claim = func() (*Lease, error) { return c.ClaimSlot(ctx, strings.TrimSuffix(id, "#1"), 1, 0) }
		}
		l, err := claim()
		if err != nil {
			t.Fatalf("%q: %v", id, err)
		}
		leases = append(leases, l)
		if l.Job() != id || l.Generation() != 1 {
			t.Fatalf("%q: %s %d", id, l.Job(), l.Generation())
		}
		if rec, err := c.Status(ctx, id); err != nil || rec.Job != id || rec.State != "held" {
			t.Fatalf("%q: status %+v %v", id, rec, err)
		}
		enc, _ := EncodeJob(id)
		if status, rec := raw(t, "GET", s.serverURL+"/v1/leases/"+enc, nil, ""); status != 200 || rec["job"] != id {
			t.Fatalf("%q: raw status %d %v", id, status, rec)
		}
		client := &http.Client{Transport: l.Transport(nil)}
		if resp, err := post(t, client, s.proxyURL+"/w", id); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%q: write %v %v", id, resp, err)
		}
	}
	for i, w := range s.upstream.all() {
		if w.Job != jobIDs[i] || w.Body != jobIDs[i] {
			t.Fatalf("the service saw %+v, want job %q", w, jobIDs[i])
		}
	}
	// An operator takes each lease away: the next renewal is refused, and the lease is lost.
	for _, id := range jobIDs {
		enc, _ := EncodeJob(id)
		if status, rec := raw(t, "POST", s.serverURL+"/v1/leases/"+enc+"/revoke", nil, ""); status != 200 || rec["job"] != id {
			t.Fatalf("%q: revoke %d %v", id, status, rec)
		}
	}
	for _, l := range leases {
		lostWithin(t, l, 2*time.Second)
		if err := l.Err(); !strings.Contains(err.Error(), "urn:fence:lease-lost") {
			t.Fatalf("%q: %v", l.Job(), err)
		}
		if _, err := post(t, &http.Client{Transport: l.Transport(nil)}, s.proxyURL+"/w", "late"); !errors.Is(err, ErrLeaseLost) {
			t.Fatalf("%q: sent after the loss: %v", l.Job(), err)
		}
	}
	if n := len(s.upstream.all()); n != len(jobIDs) {
		t.Fatalf("%d writes reached the service", n)
	}
}
