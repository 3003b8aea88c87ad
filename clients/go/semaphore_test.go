// Fenced semaphores (contract section 15): N slots, each a lease of its own on the job
// "<resource>#<slot>". Racing claimers, a completed slot (released), another number of slots, a
// stale slot holder, a claim that waits for a slot, and names and sizes refused before sending.

package fence

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestThreeRacingClaimersOfTwoSlots(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	var wg sync.WaitGroup
	start := make(chan struct{})
	leases := make([]*Lease, 3)
	errs := make([]error, 3)
	for i := range leases {
		c := mustClient(t, s.serverURL, Options{Owner: fmt.Sprintf("racer-%d", i), TTL: 5 * time.Second})
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			leases[i], errs[i] = c.ClaimSlot(ctx, "res", 2, 0)
		}(i)
	}
	close(start)
	wg.Wait()
	var won []*Lease
	var refused []error
	for i := range leases {
		if errs[i] != nil {
			refused = append(refused, errs[i])
		} else {
			won = append(won, leases[i])
		}
	}
	if len(won) != 2 || len(refused) != 1 {
		t.Fatalf("%d leases, refusals %v", len(won), refused)
	}
	jobs := []string{won[0].Job(), won[1].Job()}
	sort.Strings(jobs)
	if jobs[0] != "res#1" || jobs[1] != "res#2" {
		t.Fatalf("slot jobs %v", jobs)
	}
	c := mustClient(t, s.serverURL, Options{Owner: "checker"})
	for _, l := range won {
		if l.Resource() != "res" || l.Job() != fmt.Sprintf("res#%d", l.Slot()) || l.Generation() != 1 {
			t.Fatalf("%v: resource %q, slot %d", l, l.Resource(), l.Slot())
		}
		h := http.Header{}
		if err := l.Header(h); err != nil || h.Get("X-Fencing-Job") != l.Job() {
			t.Fatalf("%v: headers %v %v", l, h, err)
		}
		if rec, err := c.Status(ctx, l.Job()); err != nil || rec.State != "held" || rec.Owner != l.Owner() {
			t.Fatalf("%v: status %+v %v", l, rec, err)
		}
	}
	var pe *ProblemError
	if err := refused[0]; !errors.Is(err, ErrLeaseHeld) || errors.Is(err, ErrLockDelay) || !errors.As(err, &pe) ||
		pe.Status != 409 || pe.Type != "urn:fence:lease-held" || (pe.Job != "res#1" && pe.Job != "res#2") ||
		(pe.Owner != won[0].Owner() && pe.Owner != won[1].Owner()) || pe.ExpiresInMs == 0 || pe.ExpiresInMs > 5000 {
		t.Fatalf("the third claimer: %v %+v", err, pe)
	}
	// A plain lease has no resource and no slot; a plain claim of a slot's job is refused.
	plain, err := c.Claim(ctx, "plain-job")
	if err != nil || plain.Resource() != "" || plain.Slot() != 0 {
		t.Fatalf("a plain lease: %v %q %d", err, plain.Resource(), plain.Slot())
	}
	if _, err := plain.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Claim(ctx, "res#3"); !errors.As(err, &pe) || pe.Status != 400 || pe.Type != "urn:fence:bad-request" {
		t.Fatalf("a plain claim of a slot's job: %v", err)
	}
	for _, l := range won {
		if rec, err := l.Release(ctx); err != nil || rec.State != "free" {
			t.Fatalf("%v: release %+v %v", l, rec, err)
		}
	}
}

// Complete on a slot is sent as for any lease; the server frees the slot (state free) and the
// next claimer gets the same slot job at the next generation. A stale holder's Complete is 409
// lease-lost.
func TestCompletingASlotReleasesIt(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	first := mustClient(t, s.serverURL, Options{Owner: "slot-first", TTL: 5 * time.Second})
	second := mustClient(t, s.serverURL, Options{Owner: "slot-second", TTL: 5 * time.Second})
	lease, err := first.ClaimSlot(ctx, "once", 1, 0)
	if err != nil || lease.Job() != "once#1" || lease.Slot() != 1 || lease.Generation() != 1 {
		t.Fatalf("the first claim: %v %v", lease, err)
	}
	rec, err := lease.Complete(ctx)
	if err != nil || rec.State != "free" || rec.Job != "once#1" {
		t.Fatalf("completing a slot: %+v %v", rec, err)
	}
	if !errors.Is(lease.Err(), ErrLeaseLost) {
		t.Fatalf("a completed slot's lease: %v", lease.Err())
	}
	if rec, err := first.Status(ctx, "once#1"); err != nil || rec.State != "free" {
		t.Fatalf("status after completing: %+v %v", rec, err)
	}
	again, err := second.ClaimSlot(ctx, "once", 1, 0)
	if err != nil || again.Job() != "once#1" || again.Slot() != 1 || again.Generation() != 2 || again.Owner() != "slot-second" {
		t.Fatalf("the next claim: %v %v", again, err)
	}
	var pe *ProblemError
	// Generation 1 is no longer the holder.
	if _, err := lease.Complete(ctx); !errors.Is(err, ErrLeaseRefused) || !errors.As(err, &pe) ||
		pe.Status != 409 || pe.Type != "urn:fence:lease-lost" {
		t.Fatalf("a stale holder's complete: %v", err)
	}
	if rec, err := again.Complete(ctx); err != nil || rec.State != "free" {
		t.Fatalf("completing the slot again: %+v %v", rec, err)
	}
}

func TestAnotherNumberOfSlotsWhileSlotsAreHeld(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	c := mustClient(t, s.serverURL, Options{Owner: "sizer", TTL: 5 * time.Second})
	first, err := c.ClaimSlot(ctx, "sized", 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, other := range []int{3, 1} {
		var pe *ProblemError
		_, err := c.ClaimSlot(ctx, "sized", other, time.Second) // not waited on: it will not change
		if !errors.Is(err, ErrSemaphoreSize) || errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) ||
			pe.Status != 409 || pe.Type != "urn:fence:semaphore-size" || pe.Slots != 2 {
			t.Fatalf("%d slots while 2 are in force: %v %+v", other, err, pe)
		}
	}
	second, err := c.ClaimSlot(ctx, "sized", 2, 0) // the number in force is still taken
	if err != nil || first.Slot()+second.Slot() != 3 {
		t.Fatalf("the second slot: %v", err)
	}
	for _, l := range []*Lease{first, second} {
		if _, err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
	third, err := c.ClaimSlot(ctx, "sized", 3, 0) // no slot held: the number may change
	if err != nil || third.Job() != "sized#1" || third.Slot() != 1 {
		t.Fatalf("3 slots once none is held: %v", err)
	}
	if _, err := third.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestAStaleSlotHolderIsFencedOff(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{})
	ledger := s.proxyURL + "/ledger"
	a := mustClient(t, s.serverURL, Options{Owner: "slot-a", TTL: time.Second, Margin: 100 * time.Millisecond})
	b := mustClient(t, s.serverURL, Options{Owner: "slot-b", TTL: 5 * time.Second})
	leaseA, err := a.ClaimSlot(ctx, "pool", 1, 0)
	if err != nil || leaseA.Job() != "pool#1" || leaseA.Slot() != 1 || leaseA.Generation() != 1 {
		t.Fatalf("A's slot: %v %v", leaseA, err)
	}
	if _, err := leaseA.SaveCheckpoint(ctx, "half done"); err != nil {
		t.Fatal(err)
	}
	httpA := &http.Client{Transport: leaseA.Transport(nil)}
	if resp, err := post(t, httpA, ledger, "A: write"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("A's write: %v %v", resp, err)
	}
	lateToken, _ := leaseA.Token()
	resume := pauseRenewals(leaseA) // A stalls: no renewal reaches the server
	defer resume()
	lostAt := lostWithin(t, leaseA, 2*time.Second)
	if lostAt >= int64(leaseA.ExpiresAtMs()) {
		t.Fatalf("lost at %d, after the server's expiry %d", lostAt, leaseA.ExpiresAtMs())
	}
	if _, err := post(t, httpA, ledger, "A: late"); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("A sent after the loss: %v", err)
	}
	leaseB, err := b.ClaimSlot(ctx, "pool", 1, 3*time.Second) // granted once A's lease expired
	if err != nil || leaseB.Job() != "pool#1" || leaseB.Slot() != 1 || leaseB.Generation() != 2 {
		t.Fatalf("B's slot: %v %v", leaseB, err)
	}
	if cp := leaseB.Checkpoint(); cp == nil || *cp != (Checkpoint{Generation: 1, Data: "half done"}) {
		t.Fatalf("B's checkpoint: %+v", cp)
	}
	if resp, err := post(t, &http.Client{Transport: leaseB.Transport(nil)}, ledger, "B: write"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("B's write: %v %v", resp, err)
	}
	// A's held-up write, sent raw: the proxy refuses the slot's older generation.
	if status, problem := raw(t, "POST", ledger, map[string]string{"X-Fencing-Job": "pool#1", "X-Fencing-Token": lateToken}, "A: late"); status != 409 || problem["type"] != "urn:fence:stale-token" {
		t.Fatalf("A's late write: %d %v", status, problem)
	}
	// A release or completion (which frees a slot too) by hand of the lease lost here sends
	// nothing: it is left to expire.
	var lost *LeaseLostError
	if _, err := leaseA.Release(ctx); !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) || !strings.Contains(lost.Reason, "nothing was sent") {
		t.Fatalf("A's release: %v", err)
	}
	if _, err := leaseA.Complete(ctx); !errors.As(err, &lost) || errors.Is(err, ErrLeaseRefused) || !strings.Contains(lost.Reason, "nothing was sent") {
		t.Fatalf("A's completion: %v", err)
	}
	// The stale lease's renewal, and its completion sent raw, are refused by the server.
	leaseA.mu.Lock()
	leaseA.renewHook = nil // the real renewal again
	leaseA.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var pe *ProblemError
	if _, err := leaseA.sendRenew(rctx); !errors.Is(err, ErrLeaseRefused) || !errors.As(err, &pe) || pe.Type != "urn:fence:lease-lost" || pe.Generation != 2 {
		t.Fatalf("A's renewal: %v", err)
	}
	stale := fmt.Sprintf(`{"owner":"slot-a","generation":1,"lease_key":%q}`, leaseA.key)
	if status, problem := raw(t, "POST", s.serverURL+"/v1/leases/pool%231/complete", map[string]string{"Content-Type": "application/json"}, stale); status != 409 ||
		problem["type"] != "urn:fence:lease-lost" || problem["owner"] != "slot-b" || problem["generation"] != float64(2) {
		t.Fatalf("A's completion, sent raw: %d %v", status, problem)
	}
	if _, err := leaseA.SaveCheckpoint(ctx, "stale"); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("A's checkpoint: %v", err)
	}
	if err := leaseB.Err(); err != nil {
		t.Fatal(err)
	}
	if rec, err := leaseB.Release(ctx); err != nil || rec.State != "free" {
		t.Fatalf("B's release: %+v %v", rec, err)
	}
	want := []seen{{"pool#1", "1", "A: write"}, {"pool#1", "2", "B: write"}}
	if got := s.upstream.all(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("the service saw %+v, want %+v", got, want)
	}
}

func TestAWaitingClaimGetsASlotOnceOneIsReleased(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	var held []*Lease
	for i := 0; i < 2; i++ {
		l, err := mustClient(t, s.serverURL, Options{Owner: fmt.Sprintf("holder-%d", i), TTL: 5 * time.Second}).ClaimSlot(ctx, "busy", 2, 0)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}
	waiter := mustClient(t, s.serverURL, Options{Owner: "waiter", TTL: 5 * time.Second})
	// Every slot taken for the whole wait: ErrLeaseHeld once the wait is over, not before.
	started := time.Now()
	var pe *ProblemError
	_, err := waiter.ClaimSlot(ctx, "busy", 2, 400*time.Millisecond)
	if took := time.Since(started); !errors.Is(err, ErrLeaseHeld) || !errors.As(err, &pe) || (pe.Job != "busy#1" && pe.Job != "busy#2") ||
		took < 400*time.Millisecond || took > time.Second {
		t.Fatalf("a wait with every slot taken: %v after %v", err, took)
	}
	// A wait cut short by its context (context.DeadlineExceeded during a pause, else the failure
	// of the request the context ended).
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	started = time.Now()
	if _, err := waiter.ClaimSlot(cctx, "busy", 2, 5*time.Second); err == nil || time.Since(started) > time.Second {
		t.Fatalf("a cancelled wait: %v after %v", err, time.Since(started))
	}
	go func() {
		time.Sleep(500 * time.Millisecond)
		_, _ = held[1].Release(ctx)
	}()
	started = time.Now()
	lease, err := waiter.ClaimSlot(ctx, "busy", 2, 5*time.Second)
	took := time.Since(started)
	if err != nil || took < 400*time.Millisecond || took > 1500*time.Millisecond { // polled: soon after the release
		t.Fatalf("a waiting claim: %v after %v", err, took)
	}
	if lease.Job() != held[1].Job() || lease.Slot() != held[1].Slot() || lease.Generation() != 2 {
		t.Fatalf("got %v slot %d, want %s", lease, lease.Slot(), held[1].Job())
	}
	if rec, err := waiter.Status(ctx, lease.Job()); err != nil || rec.Owner != "waiter" {
		t.Fatalf("status %+v %v", rec, err)
	}
	for _, l := range []*Lease{lease, held[0]} {
		if _, err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

func TestBadResourceNamesAndNumbersOfSlotsAreRefusedBeforeSending(t *testing.T) {
	ctx := context.Background()
	nobody := mustClient(t, "http://127.0.0.1:9", Options{Owner: "sem"}) // would fail to connect if it sent
	for _, resource := range []string{"a#b", "#", "a b", "", strings.Repeat("x", 252), "caf\u00e9"} {
		if _, err := nobody.ClaimSlot(ctx, resource, 2, 0); !errors.Is(err, ErrInvalidJobID) {
			t.Fatalf("resource %q: %v", resource, err)
		}
	}
	for _, slots := range []int{0, 1001, -1} {
		_, err := nobody.ClaimSlot(ctx, "res", slots, 0)
		if err == nil || errors.Is(err, ErrUnreachable) || !strings.Contains(err.Error(), "1 to 1000 slots") {
			t.Fatalf("%d slots: %v", slots, err)
		}
	}
	for _, slots := range []int{1, 1000} { // the bounds themselves are sizes: they fail only to connect
		if _, err := nobody.ClaimSlot(ctx, strings.Repeat("x", 251), slots, 0); !errors.Is(err, ErrUnreachable) {
			t.Fatalf("%d slots: %v", slots, err)
		}
	}
}

// losingTransport passes requests on, but the answer to the first semaphore claim of owner
// "lossy" is lost on its way back and replaced: by a transport error (a connection cut after
// the request) when status is 0, by a 503 store-unavailable with Retry-After: 0.3 when it is
// 503, by a gateway's 502 page when it is 502. The answer lost is kept in lost, and when each
// of that owner's claims was sent in sends. With path set, the claims lost are those whose
// path starts with it instead.
type losingTransport struct {
	next   http.RoundTripper
	status int
	path   string
	mu     sync.Mutex
	lost   []map[string]any
	sends  []time.Time
}

func (l *losingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	mine := false
	if l.path != "" {
		mine = strings.HasPrefix(req.URL.Path, l.path)
	} else if strings.Contains(req.URL.Path, "/v1/semaphores/lossy") && req.GetBody != nil {
		if body, err := req.GetBody(); err == nil {
			raw, _ := io.ReadAll(body)
			mine = strings.Contains(string(raw), `"owner":"lossy"`)
		}
	}
	if mine {
		l.mu.Lock()
		l.sends = append(l.sends, time.Now())
		l.mu.Unlock()
	}
	resp, err := l.next.RoundTrip(req)
	if err != nil || !mine {
		return resp, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.lost) > 0 {
		return resp, nil
	}
	var answer map[string]any
	_ = json.NewDecoder(resp.Body).Decode(&answer)
	resp.Body.Close()
	l.lost = append(l.lost, answer)
	switch l.status {
	case 0:
		return nil, errors.New("the answer was lost on its way back")
	case http.StatusBadGateway:
		return &http.Response{
			StatusCode: http.StatusBadGateway,
			Header:     http.Header{"Content-Type": {"text/html"}},
			Body:       io.NopCloser(strings.NewReader("<html>502 Bad Gateway</html>")),
			Request:    req,
		}, nil
	}
	problem := `{"type":"urn:fence:store-unavailable","status":503,"detail":"the store did not confirm the decision within 5 s"}`
	return &http.Response{
		StatusCode: http.StatusServiceUnavailable,
		Header:     http.Header{"Content-Type": {"application/problem+json"}, "Retry-After": {"0.3"}},
		Body:       io.NopCloser(strings.NewReader(problem)),
		Request:    req,
	}, nil
}

func TestALostAnswerToASlotClaimGetsThatSlotBackNotASecond(t *testing.T) {
	for _, status := range []int{0, http.StatusServiceUnavailable, http.StatusBadGateway} {
		t.Run(fmt.Sprintf("lost as %d", status), func(t *testing.T) {
			ctx := context.Background()
			s := newStack(t, stackOpts{noProxy: true})
			c := mustClient(t, s.serverURL, Options{Owner: "lossy", TTL: 5 * time.Second})
			losing := &losingTransport{next: c.t.http.Transport, status: status}
			c.t.http.Transport = losing
			other := mustClient(t, s.serverURL, Options{Owner: "other", TTL: 5 * time.Second})
			lease, err := c.ClaimSlot(ctx, "lossy", 2, 3*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			// The retry carried the same key: the slot the lost answer granted, not a second
			// one, so the other slot is still free for someone else.
			if len(losing.lost) != 1 || losing.lost[0]["job"] != lease.Job() || fmt.Sprint(losing.lost[0]["generation"]) != fmt.Sprint(lease.Generation()) {
				t.Fatalf("lost %v, lease %s generation %d", losing.lost, lease.Job(), lease.Generation())
			}
			second, err := other.ClaimSlot(ctx, "lossy", 2, 0)
			if err != nil || second.Slot() == lease.Slot() {
				t.Fatalf("the other slot: %v, %v", second, err)
			}
			// Asked again once, after the 503's Retry-After when there was one.
			after := time.Duration(0)
			if status == http.StatusServiceUnavailable {
				after = 300 * time.Millisecond
			}
			if len(losing.sends) != 2 || losing.sends[1].Sub(losing.sends[0]) < after {
				t.Fatalf("sends %v, expected the second %v after the first", losing.sends, after)
			}
			for _, held := range []*Lease{second, lease} {
				if _, err := held.Release(ctx); err != nil {
					t.Fatal(err)
				}
			}
			// Without a wait the lost answer is the caller's to handle, as before.
			losing.lost = nil
			_, err = c.ClaimSlot(ctx, "lossy-now", 2, 0)
			var refused *ProblemError
			if status != 0 && !(errors.As(err, &refused) && refused.Status == status) || status == 0 && !errors.Is(err, ErrUnreachable) {
				t.Fatalf("without a wait: %v", err)
			}
		})
	}
}

// A claim whose answer was lost may have been granted: the next claim of the job asks with the
// same key and gets that lease back, instead of the job being held, by this owner, for the
// whole TTL.
func TestAClaimAfterOneWhoseAnswerWasLostGetsThatLeaseBack(t *testing.T) {
	for _, status := range []int{0, http.StatusServiceUnavailable, http.StatusBadGateway} {
		t.Run(fmt.Sprintf("lost as %d", status), func(t *testing.T) {
			ctx := context.Background()
			s := newStack(t, stackOpts{noProxy: true})
			c := mustClient(t, s.serverURL, Options{Owner: "lossy", TTL: 30 * time.Second})
			losing := &losingTransport{next: c.t.http.Transport, status: status, path: "/v1/leases/plain-lossy/claim"}
			c.t.http.Transport = losing
			if _, err := c.Claim(ctx, "plain-lossy"); err == nil {
				t.Fatal("the lost answer was not an error")
			}
			lease, err := c.Claim(ctx, "plain-lossy")
			if err != nil {
				t.Fatalf("the lost grant, asked again: %v", err)
			}
			if len(losing.lost) != 1 || fmt.Sprint(losing.lost[0]["generation"]) != "1" || lease.Generation() != 1 {
				t.Fatalf("lost %v, lease generation %d", losing.lost, lease.Generation())
			}
			if _, err := lease.Release(ctx); err != nil {
				t.Fatal(err)
			}
			next, err := c.Claim(ctx, "plain-lossy") // settled: a claim like any other
			if err != nil || next.Generation() != 2 {
				t.Fatalf("next claim: %v, %v", next, err)
			}
			if _, err := next.Release(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestARetryAfterIsSecondsAtMostAMinute(t *testing.T) {
	// A huge one would wait for days (or overflow a Duration); an HTTP-date, a negative or
	// not-a-number value is none, and backoff decides.
	for value, want := range map[string]time.Duration{
		"2": 2 * time.Second, "0.3": 300 * time.Millisecond, "99999999999": MaxRetryAfter,
		"+Inf": MaxRetryAfter, "-1": 0, "NaN": 0, "Wed, 21 Oct 2026 07:28:00 GMT": 0,
	} {
		got := problemFrom(503, http.Header{"Retry-After": {value}}, nil).RetryAfter
		if got != want {
			t.Errorf("Retry-After %q: %v, want %v", value, got, want)
		}
	}
}

// A held slot's answer whose expires_in_ms or claimable_in_ms is null, or not a count of
// milliseconds, gives no hint: the pause is the backoff, not a millisecond (which would ask
// again a thousand times a second).
func TestAHeldPauseIgnoresANullHint(t *testing.T) {
	backoff := 200 * time.Millisecond
	for _, tc := range []struct {
		body string
		want time.Duration
	}{
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":null}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409,"claimable_in_ms":null}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":30}`, 30 * time.Millisecond},
		{`{"type":"urn:fence:lock-delay","status":409,"expires_in_ms":null,"claimable_in_ms":40}`, 40 * time.Millisecond},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":0}`, time.Millisecond},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":"30"}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":-5}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":1.5}`, backoff},
		// Past what a time.Duration holds in nanoseconds: still the backoff, not a millisecond.
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":18446744073709551615}`, backoff},
		{`{"type":"urn:fence:lease-held","status":409,"expires_in_ms":9300000000000}`, backoff},
	} {
		held := problemFrom(409, http.Header{"Content-Type": {"application/problem+json"}}, []byte(tc.body))
		if got := heldPause(held, backoff); got != tc.want {
			t.Errorf("%s: paused %v, want %v", tc.body, got, tc.want)
		}
	}
}
