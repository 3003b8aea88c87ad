// A held lease: its keeper renews it, and it knows the moment it can no longer be trusted.
//
// The local deadline is send time + granted TTL - margin on the client's Clock (by default
// time.Now, whose readings carry the monotonic clock), where send time is read before the
// claim or renewal went out. The server's expires_at_ms never enters it, so an offset between
// this machine's wall clock and the server's changes nothing.

package fence

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

const (
	reasonDeadline = "the local deadline passed before a renewal succeeded"
	reasonFinished = "the lease was released, completed or abandoned"
	// reasonAbandoned is why a release or completion asked for after Abandon fails: sending it
	// would let the next holder in at once, while a write the abandon was for may still land.
	reasonAbandoned = "the lease was abandoned: it is left to expire on the server, so the lock-delay applies; nothing was sent"
)

// leftToExpire is why a Release asked for once the lease is lost here fails: a write cut by the
// loss may still land, and a release the server would take (nobody claimed the job since) lets
// the next holder in at once, skipping the lock-delay, which only an expiry starts.
func leftToExpire(reason string) string {
	return "the lease was lost (" + reason + "): it is left to expire on the server, so the lock-delay applies; nothing was sent"
}

// Lease is a held lease, renewed every third of its TTL by a keeper goroutine until it is
// released, completed, abandoned or lost. Its methods are safe for concurrent use.
type Lease struct {
	t          *transport
	clock      Clock
	job        string
	owner      string
	generation uint64
	key        string
	askedTTLMs uint64
	margin     time.Duration

	ctx      context.Context
	cancel   context.CancelFunc
	finished chan struct{}
	finish   sync.Once
	// abandoned: Abandon was called (before any Release or Complete), so nothing ends the
	// lease at the server: neither Run's end nor a Release or Complete by hand.
	abandoned bool // under mu
	// ending: Release or Complete was called, so a later Abandon changes nothing.
	ending bool // under mu

	mu          sync.Mutex
	token       string
	deadline    time.Time
	sent        time.Time
	ttl         time.Duration
	expiresAtMs uint64
	reason      string
	renewHook   func(ctx context.Context) (leaseAnswer, error) // tests pause renewals with it
	// renewalFailed is why the last renewal got no grant (unreachable, a 401, a 503), until
	// one does: a loss at the deadline says it, so an operator sees a rotated secret, not a
	// timeout.
	renewalFailed string
	// renewalAnswered: that failure was the server's answer (a 401, a 503); a later attempt
	// that got none (unreachable, or cut short by the deadline) does not replace it.
	renewalAnswered bool

	// resumed is the checkpoint the claim returned.
	resumed *Checkpoint

	// resource and slot are a semaphore slot's lease's (job is "<resource>#<slot>"); "" and 0
	// for a plain lease.
	resource string
	slot     int

	// progressWithin bounds renewals to progress (0: unbound); lastProgress is the last report.
	progressWithin time.Duration
	lastProgress   time.Time
}

// Progress reports that the worker is making progress. With Options.ProgressWithin, the keeper
// renews only while this was called that recently (the claim counts as the first report); a
// worker that hangs then loses its lease, which expires at the server. Without it, this does
// nothing.
func (l *Lease) Progress() {
	l.mu.Lock()
	l.lastProgress = l.clock.Now()
	l.mu.Unlock()
}

// Job is the job id.
func (l *Lease) Job() string { return l.job }

// Owner is the owner name the lease was claimed under.
func (l *Lease) Owner() string { return l.owner }

// Generation is the generation this lease was granted.
func (l *Lease) Generation() uint64 { return l.generation }

// Resource is the semaphore whose slot this lease holds (Job is "<resource>#<slot>"); "" for a
// plain lease.
func (l *Lease) Resource() string { return l.resource }

// Slot is the number of the semaphore slot this lease holds, 1 to the number of slots; 0 for a
// plain lease.
func (l *Lease) Slot() int { return l.slot }

// Context is cancelled the moment the lease is lost (no later than the local deadline, also
// when the server stops answering) or finished; Err says why. Run the job's work under it.
func (l *Lease) Context() context.Context { return l.ctx }

// Done is Context().Done().
func (l *Lease) Done() <-chan struct{} { return l.ctx.Done() }

// Token is the newest fencing token, exactly as the server returned it (a signing server's
// <generation>.<expires_at_ms>.<signature>, else the generation in decimal); a
// *LeaseLostError (errors.Is ErrLeaseLost) from the moment the lease is lost.
func (l *Lease) Token() (string, error) {
	l.mu.Lock()
	if l.reason == "" && l.clock.Now().Before(l.deadline) {
		defer l.mu.Unlock()
		return l.token, nil
	}
	reason := l.reason
	l.mu.Unlock()
	if reason == "" {
		reason = reasonDeadline
	}
	return "", &LeaseLostError{Job: l.job, Generation: l.generation, Reason: l.declareLost(reason)}
}

// Err is nil while the lease is held, else a *LeaseLostError saying why it is lost.
func (l *Lease) Err() error {
	_, err := l.Token()
	return err
}

// Deadline is the local deadline on the client's clock: lost then unless renewed before.
func (l *Lease) Deadline() time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deadline
}

// TTL is the TTL the server granted last.
func (l *Lease) TTL() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ttl
}

// heldTTL is the TTL the deadline counts from: the grant, never more than was asked (a server,
// or something posing as one, that grants more cannot move the deadline past what the worker
// asked to hold). Called with l.mu held.
func (l *Lease) heldTTL() time.Duration {
	if asked := time.Duration(l.askedTTLMs) * time.Millisecond; asked < l.ttl {
		return asked
	}
	return l.ttl
}

// renewInterval is the keeper's pace for the grant held.
func (l *Lease) renewInterval() time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return renewEvery(l.heldTTL(), l.margin)
}

// ExpiresAtMs is the server's expiry of the last grant, in ms since the epoch on the
// server's clock (informational: the client never uses it for its own deadline).
func (l *Lease) ExpiresAtMs() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.expiresAtMs
}

// IdempotencyKey is the derived Idempotency-Key of a step of this job (contract section 11).
func (l *Lease) IdempotencyKey(step string) string { return IdempotencyKey(l.job, step) }

// Header sets X-Fencing-Job and X-Fencing-Token on h; a *LeaseLostError once lost.
func (l *Lease) Header(h http.Header) error {
	token, err := l.Token()
	if err != nil {
		return err
	}
	h.Set("X-Fencing-Job", l.job)
	h.Set("X-Fencing-Token", token)
	return nil
}

// Release frees the job for another claim. A *ProblemError matching ErrLeaseRefused when the
// server no longer records this lease. A server that fails to answer (ErrUnreachable, a 502,
// 503 or 504, a gateway's 408) or answers its own 408 body-timeout (nothing applied) is asked
// again until it could end the lease on its own (a minute at most, or
// until ctx is done); a retry that finds the earlier attempt applied returns the record it left.
// After Abandon, or once the lease is lost here (past its local deadline, no progress, a refused
// renewal), a *LeaseLostError (errors.Is ErrLeaseLost) and nothing sent: the lease is left to
// expire, so the lock-delay applies.
func (l *Lease) Release(ctx context.Context) (Record, error) { return l.end(ctx, "release") }

// Complete marks the job done for good. The server decides: a *ProblemError matching
// ErrLeaseRefused (409 lease-lost) when someone else took over. Completing a semaphore slot
// releases it: the server frees the slot (the Record's State is "free") and it can be claimed
// again, at the next generation. After Abandon, a *LeaseLostError and nothing sent, as Release;
// after a loss here (the local deadline checked too) a plain job's completion is still sent
// (nobody can claim a completed job), while a slot's returns a *LeaseLostError and sends
// nothing, as Release (it would free the slot at once).
func (l *Lease) Complete(ctx context.Context) (Record, error) { return l.end(ctx, "complete") }

// Abandon stops renewing and lets the lease expire on the server; nothing is sent. In
// Client.Run, the lease is then neither released nor completed when fn ends, however it ends,
// and a later Release or Complete (a defer lease.Release(ctx) included) returns a
// *LeaseLostError, nothing sent. Called again, or after Release or Complete, it changes nothing.
func (l *Lease) Abandon() {
	l.mu.Lock()
	if !l.ending {
		l.abandoned = true
	}
	l.mu.Unlock()
	l.stop()
}

// wasAbandoned is whether Abandon was called.
func (l *Lease) wasAbandoned() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.abandoned
}

// stop ends the keeper and the lease's context; nothing is sent under the lease from then on.
func (l *Lease) stop() {
	l.finish.Do(func() { close(l.finished) })
	l.declareLost(reasonFinished)
}

// giveBack releases, in the background, a grant the client will not use (too short, come too
// late, not renewed after a wait, or malformed): no request carried its token, and the next worker need
// not wait for its expiry. A release that fails leaves it to expire.
func (l *Lease) giveBack() {
	l.stop()
	go func() { _, _ = l.send(context.Background(), "release") }()
}

// A release or completion the server failed to answer is sent again after a pause that starts
// here and doubles up to the cap, until the server could end the lease on its own.
const (
	finishPauseFirst = 100 * time.Millisecond
	finishPauseMax   = time.Second
	// finishRetryWindow bounds the retries, whatever the lease has left.
	finishRetryWindow = time.Minute
)

// end is a Release or Complete asked for by hand: a *LeaseLostError, nothing sent, after
// Abandon, and for a release, or a semaphore slot's completion (the server frees the slot: a
// release), once the lease is lost here. A defer lease.Release(ctx) after an Abandon or a loss
// would let the next holder in at once, skipping the lock-delay, while a write may still land. A
// plain job's completion after a loss is still sent (nobody can claim a completed job). The
// local deadline is checked for both actions first, and a loss it finds is recorded, never
// hidden as finished: a release after a completion that failed past the deadline is refused
// too. A release after a release or completion asked for while held is sent again, as before.
func (l *Lease) end(ctx context.Context, action string) (Record, error) {
	l.mu.Lock()
	if l.abandoned {
		l.mu.Unlock()
		return Record{}, &LeaseLostError{Job: l.job, Generation: l.generation, Reason: reasonAbandoned}
	}
	passed := l.reason == "" && !l.clock.Now().Before(l.deadline)
	if passed {
		l.lostLocked(reasonDeadline) // the keeper has not said it yet
	}
	if l.reason != "" && l.reason != reasonFinished && (action == "release" || l.slot != 0) {
		reason := l.reason // the reason it was lost for, the first declared
		l.mu.Unlock()
		l.cancel()
		return Record{}, &LeaseLostError{Job: l.job, Generation: l.generation, Reason: leftToExpire(reason)}
	}
	l.ending = true
	// Ended here, under the lock: a loss the keeper declares from now on cannot come between
	// the check above and the release going out.
	if l.reason == "" {
		l.reason = reasonFinished
	}
	l.mu.Unlock()
	if passed {
		l.cancel()
	}
	return l.send(ctx, action)
}

// send releases or completes. A server that fails to answer (unreachable, a timeout, a 502, 503
// or 504) is asked again until it could end the lease on its own (a minute at most): a passing
// blip at the end of
// a job must not leave it to expire and run again. A retry refused with lease-lost at this
// generation, by nobody (released) or by this owner (completed: the only refusal that leaves
// both in place), finds the earlier attempt applied: the record it left is returned.
func (l *Lease) send(ctx context.Context, action string) (Record, error) {
	l.stop() // nothing is sent under this lease from now on, whatever the answer
	body := map[string]any{"owner": l.owner, "generation": l.generation, "lease_key": l.key}
	l.mu.Lock()
	until := l.sent.Add(l.ttl)
	l.mu.Unlock()
	if limit := l.clock.Now().Add(finishRetryWindow); limit.Before(until) {
		until = limit
	}
	pause, unsure := finishPauseFirst, false
	for {
		var rec Record
		err := l.t.call(ctx, http.MethodPost, l.path(action), body, 0, &rec)
		if err == nil {
			return rec, nil
		}
		var refused *ProblemError
		if unsure && errors.Is(err, ErrLeaseRefused) && errors.As(err, &refused) &&
			refused.Status == http.StatusConflict && refused.Generation == l.generation &&
			(refused.Owner == "" || refused.Owner == l.owner) {
			state := "completed"
			if refused.Owner == "" {
				state = "free"
			}
			return Record{Job: l.job, Owner: refused.Owner, Generation: l.generation, State: state}, nil
		}
		lost := answerLost(err)
		if !(lost || busy(err)) || !l.clock.Now().Add(pause).Before(until) || ctx.Err() != nil {
			return rec, err
		}
		unsure = unsure || lost
		if serr := sleepCtx(ctx, pause); serr != nil {
			return rec, err
		}
		if pause *= 2; pause > finishPauseMax {
			pause = finishPauseMax
		}
	}
}

// Checkpoint is the job's last checkpoint as the claim returned it (the generation that saved
// it), or nil: resume from it, not from the start.
func (l *Lease) Checkpoint() *Checkpoint { return l.resumed }

// SaveCheckpoint saves data (text, up to the server's limit, 8 KiB by default) as the job's
// checkpoint under this lease; the next claim returns it. A *LeaseLostError without sending
// once the lease is lost; a *ProblemError matching ErrLeaseRefused when a newer holder exists
// (the lease is then lost), or of status 413 past the limit.
func (l *Lease) SaveCheckpoint(ctx context.Context, data string) (Record, error) {
	var rec Record
	if _, err := l.Token(); err != nil {
		return rec, err
	}
	body := map[string]any{"owner": l.owner, "generation": l.generation, "lease_key": l.key, "checkpoint": data}
	err := l.t.call(ctx, http.MethodPost, l.path("checkpoint"), body, 0, &rec)
	if errors.Is(err, ErrLeaseRefused) {
		l.declareLost("the server refused the checkpoint: " + err.Error())
	}
	return rec, err
}

func (l *Lease) path(action string) string {
	enc, _ := EncodeJob(l.job) // checked at claim
	return "/v1/leases/" + enc + "/" + action
}

// declareLost is the one place a lease is declared lost. Final: nothing un-loses it. Returns
// the reason the lease is lost for (the first one declared).
func (l *Lease) declareLost(reason string) string {
	l.mu.Lock()
	settled := l.lostLocked(reason)
	l.mu.Unlock()
	l.cancel()
	return settled
}

// lostLocked records reason as the loss's, unless one is recorded already, and returns the
// one recorded; under mu. The caller cancels the lease's context once it unlocks.
func (l *Lease) lostLocked(reason string) string {
	if l.reason == "" {
		if reason == reasonDeadline && l.renewalFailed != "" {
			reason = reasonDeadline + " (the last renewal failed: " + l.renewalFailed + ")"
		}
		l.reason = reason
	}
	return l.reason
}

// setGrant takes a claim's or renewal's answer sent at sent; false when the lease was lost
// before it arrived (loss is final: a late answer changes nothing).
func (l *Lease) setGrant(sent time.Time, a leaseAnswer, first bool) (bool, error) {
	if a.Generation != l.generation {
		return false, fmt.Errorf("%w: the server granted generation %d of %s, expected %d", ErrProtocol, a.Generation, l.job, l.generation)
	}
	if a.TTLMs == nil || a.ExpiresAtMs == nil {
		return false, fmt.Errorf("%w: a lease answer without ttl_ms and expires_at_ms", ErrProtocol)
	}
	if *a.TTLMs < 100 || *a.TTLMs > 86_400_000 {
		// Outside what a server grants (0.1 s to 24 h; 0 is malformed, not a grant too short to
		// hold, and a huge one would overflow a time.Duration): as the Rust client.
		return false, fmt.Errorf("%w: a lease answer with ttl_ms %d", ErrProtocol, *a.TTLMs)
	}
	token := strconv.FormatUint(l.generation, 10)
	if a.Token != nil {
		if !strings.HasPrefix(*a.Token, token+".") {
			return false, fmt.Errorf("%w: the server signed token %.200q for generation %d", ErrProtocol, redact(*a.Token), l.generation)
		}
		token = *a.Token
	}
	ttl := time.Duration(*a.TTLMs) * time.Millisecond
	l.mu.Lock()
	defer l.mu.Unlock()
	if !first && (l.reason != "" || !l.clock.Now().Before(l.deadline)) {
		return false, nil
	}
	l.token, l.ttl, l.expiresAtMs, l.sent = token, ttl, *a.ExpiresAtMs, sent
	held := l.heldTTL()
	usable := held - marginOf(held, l.margin)
	if usable < 0 {
		usable = 0
	}
	l.deadline = sent.Add(usable)
	l.renewalFailed, l.renewalAnswered = "", false
	return true, nil
}

// renewEvery is a third of the grant, but never later than halfway to the deadline: a fixed
// margin may take most of a grant the server cut short (its --max-ttl).
func renewEvery(ttl, margin time.Duration) time.Duration {
	every := ttl / 3
	if half := (ttl - marginOf(ttl, margin)) / 2; half < every {
		every = half
	}
	if every < 10*time.Millisecond {
		every = 10 * time.Millisecond
	}
	return every
}

func marginOf(ttl, configured time.Duration) time.Duration {
	if configured > 0 {
		return configured
	}
	if m := ttl / 10; m > 50*time.Millisecond {
		return m.Truncate(time.Millisecond)
	}
	return 50 * time.Millisecond
}

func (l *Lease) sendRenew(ctx context.Context) (leaseAnswer, error) {
	l.mu.Lock()
	hook := l.renewHook
	l.mu.Unlock()
	if hook != nil {
		return hook(ctx)
	}
	var a leaseAnswer
	body := map[string]any{"owner": l.owner, "generation": l.generation, "lease_key": l.key, "ttl_ms": l.askedTTLMs}
	deadline, _ := ctx.Deadline()
	err := l.t.call(ctx, http.MethodPost, l.path("renew"), body, time.Until(deadline), &a)
	return a, err
}

// wait returns after d, or false at once when the lease is finished.
func (l *Lease) wait(d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-l.finished:
		return false
	case <-timer.C:
		return true
	}
}

// keep renews every third of the TTL until lost or finished. Every wait, a hanging renewal's
// included, ends at the deadline at the latest, so the context is cancelled on time.
func (l *Lease) keep() {
	l.mu.Lock()
	next := l.sent.Add(renewEvery(l.heldTTL(), l.margin))
	l.mu.Unlock()
	for {
		deadline := l.Deadline()
		until := next
		if deadline.Before(until) {
			until = deadline
		}
		if !l.wait(until.Sub(l.clock.Now())) || l.ctx.Err() != nil {
			return
		}
		sent := l.clock.Now()
		if !sent.Before(deadline) {
			l.declareLost(reasonDeadline)
			return
		}
		l.mu.Lock()
		stalled := l.progressWithin > 0 && sent.Sub(l.lastProgress) > l.progressWithin
		l.mu.Unlock()
		if stalled {
			l.declareLost(fmt.Sprintf("the worker reported no progress for %v; renewals stopped", l.progressWithin))
			return
		}
		// Each attempt has its own time (as the Rust client): a renewal interval, or half the
		// time left when longer, never past the deadline. A connection that takes the request
		// and never answers is then abandoned and the renewal asked again, not the lease lost.
		left := deadline.Sub(sent)
		attempt := l.renewInterval()
		if attempt < left/2 {
			attempt = left / 2
		}
		if attempt > left {
			attempt = left
		}
		rctx, cancel := context.WithTimeout(context.Background(), attempt)
		type outcome struct {
			a   leaseAnswer
			err error
		}
		done := make(chan outcome, 1)
		go func() {
			a, err := l.sendRenew(rctx)
			done <- outcome{a, err}
		}()
		timer := time.NewTimer(attempt)
		var o outcome
		select {
		case o = <-done:
		case <-timer.C:
			cancel()
			if !l.clock.Now().Before(deadline) {
				l.declareLost(reasonDeadline)
				return
			}
			o.err = fmt.Errorf("%w: a renewal had no answer within %v", ErrUnreachable, attempt)
		case <-l.finished:
			timer.Stop()
			cancel()
			return
		}
		timer.Stop()
		cancel()
		if o.err == nil {
			ok, err := l.setGrant(sent, o.a, false)
			if err == nil {
				if !ok {
					// The answer came after the deadline (or the lease was lost meanwhile):
					// it changes nothing, and the lease is lost, which must be signalled.
					l.declareLost(reasonDeadline)
					return
				}
				next = sent.Add(l.renewInterval())
				continue
			}
			o.err = err
		}
		if errors.Is(o.err, ErrLeaseRefused) || errors.Is(o.err, ErrJobCompleted) {
			l.declareLost("the server refused the renewal: " + o.err.Error())
			return
		}
		// No answer, or a refusal that decides nothing (503, 5xx, a secret the server does
		// not know): the deadline stands. Retry at a steady, jittered pace so the last chance
		// before the deadline is not skipped.
		failed := o.err.Error()
		if len(failed) > 300 {
			failed = strings.ToValidUTF8(failed[:300], "") // not half a character
		}
		answered := !errors.Is(o.err, ErrUnreachable)
		l.mu.Lock()
		if answered || !l.renewalAnswered {
			l.renewalFailed, l.renewalAnswered = failed, answered
		}
		l.mu.Unlock()
		// A quarter of the renewal interval, as the other clients do: it follows the usable
		// time when a fixed margin takes most of a grant the server cut short.
		pause := l.renewInterval() / 4
		if pause < 10*time.Millisecond {
			pause = 10 * time.Millisecond
		} else if pause > time.Second {
			pause = time.Second
		}
		next = l.clock.Now().Add(time.Duration(float64(pause) * (0.8 + 0.2*rand.Float64())))
	}
}

// String describes the lease without its key: fmt's %v and %s print this, never the lease
// key, which proves the holder and stays out of logs.
func (l *Lease) String() string {
	return fmt.Sprintf("fence.Lease{job: %q, generation: %d}", l.job, l.generation)
}

// GoString is String, for %#v.
func (l *Lease) GoString() string { return l.String() }
