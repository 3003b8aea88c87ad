// The keeper and waiting claims at the edges: an answer that arrives after the deadline, a
// server that holds waiting claims only briefly.

package fence

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// jumpClock is the system clock plus an offset a test moves forward.
type jumpClock struct{ offset atomic.Int64 }

func (c *jumpClock) Now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// A renewal whose answer is applied after the deadline changes nothing, and the lease is lost:
// its context must be done, or work under it never stops and no renewal is sent again.
func TestARenewalAnsweredAfterTheDeadlineSignalsTheLoss(t *testing.T) {
	s := newStack(t, stackOpts{noProxy: true})
	clock := &jumpClock{}
	l, err := mustClient(t, s.serverURL, Options{Owner: "late", TTL: time.Second, Clock: clock}).Claim(context.Background(), "late-answer")
	if err != nil {
		t.Fatal(err)
	}
	l.mu.Lock()
	l.renewHook = func(ctx context.Context) (leaseAnswer, error) {
		var a leaseAnswer
		body := map[string]any{"owner": l.owner, "generation": l.generation, "lease_key": l.key, "ttl_ms": l.askedTTLMs}
		err := l.t.call(ctx, http.MethodPost, l.path("renew"), body, time.Second, &a)
		clock.offset.Store(int64(time.Hour)) // the answer is looked at after the deadline
		return a, err
	}
	l.mu.Unlock()
	lostWithin(t, l, 3*time.Second)
	if err := l.Err(); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("after a late answer: %v", err)
	}
}

// A server whose --max-claim-wait is short answers waiting claims at once: the client must not
// ask again round trip after round trip for the whole wait.
func TestAWaitingClaimAsksAtMostEvery50msWhateverTheServerHolds(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--max-claim-wait", "1ms"}})
	target, err := url.Parse(s.serverURL)
	if err != nil {
		t.Fatal(err)
	}
	var claims atomic.Int64
	proxy := httputil.NewSingleHostReverseProxy(target)
	counting := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/claim") {
			claims.Add(1)
		}
		proxy.ServeHTTP(w, r)
	}))
	defer counting.Close()
	holder, err := mustClient(t, s.serverURL, Options{Owner: "holder", TTL: 10 * time.Second}).Claim(ctx, "paced")
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Release(ctx)
	waiter := mustClient(t, counting.URL, Options{Owner: "waiter"})
	if _, err := waiter.ClaimWaiting(ctx, "paced", 500*time.Millisecond); !errors.Is(err, ErrLeaseHeld) {
		t.Fatalf("still held after the wait: %v", err)
	}
	// 500 ms at one claim per 50 ms: about 10 (a loop without a pause sends hundreds).
	if n := claims.Load(); n < 2 || n > 20 {
		t.Fatalf("%d claims in 500 ms", n)
	}
}

// 30 s asked, 1 s granted (the server's --max-ttl), 1.5 s margin: no time to hold it. The
// error names it, and the grant is given back for the next worker at once.
func TestAGrantNoLongerThanTheMarginIsNamedAndGivenBack(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true, serverArgs: []string{"--max-ttl", "1s"}})
	cautious := mustClient(t, s.serverURL, Options{Owner: "cautious", TTL: 30 * time.Second, Margin: 1500 * time.Millisecond})
	if _, err := cautious.Claim(ctx, "short"); !errors.Is(err, ErrGrantTooShort) || !strings.Contains(err.Error(), "1s, not longer than the safety margin of 1.5s") {
		t.Fatalf("a grant shorter than the margin: %v", err)
	}
	next := mustClient(t, s.serverURL, Options{Owner: "next"})
	for until := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		rec, err := next.Status(ctx, "short")
		if err == nil && rec.State == "free" {
			break
		}
		if time.Now().After(until) {
			t.Fatalf("the short grant was not given back within 2 s: %+v %v", rec, err)
		}
	}
	lease, err := next.Claim(ctx, "short")
	if err != nil || lease.Generation() != 2 {
		t.Fatalf("the next worker: %v", err)
	}
	_, _ = lease.Release(ctx)
}

// flakyFront fronts the lease server; its next failures releases or completions are cut off
// with no answer: after the server decided them (their answer lost) when applied, before
// otherwise. It counts the releases and completions it saw.
func flakyFront(t *testing.T, serverURL string, failures int32, applied bool) (string, *atomic.Int32) {
	target, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	finishes := &atomic.Int32{}
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/release") || strings.HasSuffix(r.URL.Path, "/complete") {
			if finishes.Add(1) <= failures {
				if applied {
					proxy.ServeHTTP(httptest.NewRecorder(), r)
				}
				panic(http.ErrAbortHandler) // the connection is cut: no answer
			}
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	return front.URL, finishes
}

// A completion the server applied but whose answer was lost is retried; the retry's refusal
// (this owner, this generation, completed) is the completion, not a lost lease.
func TestACompletionWhoseAnswerWasLostIsDoneNotLost(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	front, finishes := flakyFront(t, s.serverURL, 1, true)
	l, err := mustClient(t, front, Options{Owner: "finisher", TTL: 30 * time.Second}).Claim(ctx, "report")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := l.Complete(ctx)
	if err != nil || rec.State != "completed" || rec.Owner != "finisher" || finishes.Load() != 2 {
		t.Fatalf("completed after a lost answer: %+v %v (%d attempts)", rec, err, finishes.Load())
	}
	if rec, err := mustClient(t, s.serverURL, Options{}).Status(ctx, "report"); err != nil || rec.State != "completed" {
		t.Fatalf("the server's record: %+v %v", rec, err)
	}
}

// A release that never reached the server is sent again until it does.
func TestAReleaseThatNeverReachedTheServerIsSentAgain(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	front, finishes := flakyFront(t, s.serverURL, 2, false)
	l, err := mustClient(t, front, Options{Owner: "finisher", TTL: 30 * time.Second}).Claim(ctx, "blip")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := l.Release(ctx)
	if err != nil || rec.State != "free" || finishes.Load() != 3 {
		t.Fatalf("released after two failures: %+v %v (%d attempts)", rec, err, finishes.Load())
	}
}

// A server that keeps failing is asked until it could end the lease on its own, no longer.
func TestAServerThatKeepsFailingAReleaseIsGivenUpOnAtTheLeasesEnd(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	front, finishes := flakyFront(t, s.serverURL, 1000, false)
	l, err := mustClient(t, front, Options{Owner: "finisher", TTL: time.Second}).Claim(ctx, "down")
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	_, err = l.Release(ctx)
	took := time.Since(started)
	if !errors.Is(err, ErrUnreachable) || took < 500*time.Millisecond || took > 1500*time.Millisecond || finishes.Load() <= 2 {
		t.Fatalf("gave up after %v with %v (%d attempts; the lease ends 1 s after its claim)", took, err, finishes.Load())
	}
}

// A fenced request still waiting for its answer when the lease is lost is cancelled with the
// loss; one whose answer's head arrived is read whole; the caller's own context still applies.
func TestAFencedRequestOnItsWayIsCancelledWhenTheLeaseIsLost(t *testing.T) {
	s := newStack(t, stackOpts{noProxy: true})
	ctx := context.Background()
	c := mustClient(t, s.serverURL, Options{Owner: "in-flight", TTL: 5 * time.Second})
	held := make(chan struct{}, 4)
	release := make(chan struct{})
	destination := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/hold" {
			held <- struct{}{}
			select { // answered only when the test ends
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		w.Header().Set("Content-Length", "4")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		time.Sleep(300 * time.Millisecond)
		_, _ = w.Write([]byte("done"))
	}))
	defer destination.Close()
	defer close(release)

	// Lost while the destination holds the answer: the request ends at once, ErrLeaseLost.
	waiting, err := c.Claim(ctx, "in-flight-1")
	if err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	failed := make(chan error, 1)
	go func() {
		_, err := post(t, &http.Client{Transport: waiting.Transport(nil)}, destination.URL+"/hold", "x")
		failed <- err
	}()
	<-held
	waiting.Abandon()
	select {
	case err := <-failed:
		var lost *LeaseLostError
		if !errors.Is(err, ErrLeaseLost) || !errors.As(err, &lost) || !lost.InFlight {
			t.Fatalf("the request on its way ended with %v, want ErrLeaseLost, InFlight", err)
		}
		if !strings.Contains(err.Error(), "may have reached the destination") {
			t.Fatalf("the error does not say the request may have arrived: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request outlived its lease by 10 s")
	}
	if time.Since(started) > 2*time.Second {
		t.Fatalf("the request ended %v after it started", time.Since(started))
	}
	// Asked after the loss: refused before sending, not in flight.
	_, err = post(t, &http.Client{Transport: waiting.Transport(nil)}, destination.URL+"/body", "x")
	var refused *LeaseLostError
	if !errors.As(err, &refused) || refused.InFlight {
		t.Fatalf("a request after the loss: %v", err)
	}

	// Lost after the answer's head arrived: the body is still read whole.
	answered, err := c.Claim(ctx, "in-flight-2")
	if err != nil {
		t.Fatal(err)
	}
	resp, err := (&http.Client{Transport: answered.Transport(nil)}).Post(destination.URL+"/body", "text/plain", strings.NewReader("x"))
	if err != nil {
		t.Fatal(err)
	}
	answered.Abandon()
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil || string(body) != "done" {
		t.Fatalf("the answer's body after the loss: %q %v", body, err)
	}

	// The caller's own context still cancels it, and the lease stays held.
	own, err := c.Claim(ctx, "in-flight-3")
	if err != nil {
		t.Fatal(err)
	}
	mine, cancel := context.WithCancel(ctx)
	go func() {
		<-held
		cancel()
	}()
	req, _ := http.NewRequestWithContext(mine, "POST", destination.URL+"/hold", strings.NewReader("x"))
	if _, err := (&http.Client{Transport: own.Transport(nil)}).Do(req); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled by its caller: %v", err)
	}
	if own.Err() != nil {
		t.Fatalf("the lease: %v", own.Err())
	}
	if _, err := own.Release(ctx); err != nil {
		t.Fatal(err)
	}
}

// A renewal answered 401 (a rotated secret) is retried until the deadline; the loss's reason
// then names the 401, not the later attempts that got no answer.
func TestALossAtTheDeadlineSaysWhyTheRenewalsFailed(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	target, err := url.Parse(s.serverURL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	var renewals atomic.Int64
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/renew") {
			// The first renewal is refused; the later ones get no answer (their connection
			// is cut), and a failure with no answer must not hide the 401 before it.
			if renewals.Add(1) > 1 {
				panic(http.ErrAbortHandler)
			}
			w.Header().Set("Content-Type", "application/problem+json")
			w.WriteHeader(401)
			_, _ = w.Write([]byte(`{"type":"urn:fence:unauthenticated","status":401,"detail":"the front knows no such secret"}`))
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	defer front.Close()
	lease, err := mustClient(t, front.URL, Options{Owner: "refused", TTL: time.Second}).Claim(ctx, "renewals-refused")
	if err != nil {
		t.Fatal(err)
	}
	lostWithin(t, lease, 5*time.Second)
	err = lease.Err()
	want := "the local deadline passed before a renewal succeeded (the last renewal failed: "
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "no such secret") {
		t.Fatalf("the loss: %v", err)
	}
	if renewals.Load() == 0 {
		t.Fatal("no renewal reached the front")
	}
}
