// Package fence is a client for fence lease servers: it claims a job, keeps the lease
// renewed in the background, and sends the newest fencing token with every write, refusing to
// send once the lease is lost.
//
//	client, err := fence.NewClient("http://127.0.0.1:7700", fence.Options{TTL: 10 * time.Second})
//	err = client.Run(ctx, "invoice-42", func(ctx context.Context, lease *fence.Lease) error {
//		hc := &http.Client{Transport: lease.Transport(nil), Timeout: 5 * time.Second} // refuses once ctx is done
//		resp, err := hc.Post("http://127.0.0.1:7800/ledger", "text/plain", strings.NewReader("charge"))
//		if err == nil {
//			defer resp.Body.Close()
//			err = fence.ProblemFromResponse(resp) // a refused write (ErrStaleToken on a 409) fails: never completed
//		}
//		if err != nil {
//			lease.Abandon() // a timeout, a 502 or 504 may land: not released, left to expire
//		}
//		return err
//	}, fence.RunOptions{})
//
//	slot, err := client.ClaimSlot(ctx, "exports", 3, 5*time.Second) // a semaphore: one of 3 slots
//	// ... slot.Job() is "exports#2"; write with slot.Transport(nil) ...
//	_, err = slot.Release(ctx) // completing a slot releases it too; neither is sent once it is lost
//
// The wire contract is docs/protocol.md of the fence repository.
package fence

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Clock reads the time the lease's deadline is measured on. The default, time.Now, carries
// the monotonic clock in its readings; tests inject clocks whose wall time is off.
type Clock interface {
	Now() time.Time
}

type systemClock struct{}

func (systemClock) Now() time.Time { return time.Now() }

// Options of a Client. The zero value asks 30 s leases under DefaultOwner().
type Options struct {
	// Owner to claim under; default DefaultOwner().
	Owner string
	// TTL asked for, 100 ms to 24 h; default 30 s.
	TTL time.Duration
	// AuthToken is the bearer secret; else read from AuthTokenFile, else FENCE_AUTH_TOKEN.
	AuthToken     string
	AuthTokenFile string
	// CAFile holds PEM certificates that replace the system roots for an https:// server;
	// default FENCE_CA_CERT.
	CAFile string
	// Margin before the lease's end; default 10% of the granted TTL, at least 50 ms.
	Margin time.Duration
	// Timeout bounds calls other than claims and renewals; default 10 s.
	Timeout time.Duration
	// Clock; default the system clock.
	Clock Clock
	// ProgressWithin binds renewals to progress: the keeper renews only while Lease.Progress
	// was called this recently (the claim counts). Zero: unbound (the default).
	ProgressWithin time.Duration
	// LockDelay of this client's leases, 0 to 24 h in whole ms: if one expires, nobody can
	// claim its job until this long after its end. Zero: the server's default (so a Go client
	// cannot ask for no delay where the server's --lock-delay sets one).
	LockDelay time.Duration
}

// Client claims leases from one lease server under one owner name. Safe for concurrent use.
type Client struct {
	t      *transport
	owner  string
	ttl    time.Duration
	margin time.Duration
	clock  Clock
	delay  time.Duration
	within time.Duration
	// unsettled keeps the keys of claims whose answers were lost, for the next claim of
	// their jobs.
	unsettled *unsettledKeys
}

// NewClient makes a client of server ("" means FENCE_SERVER, else http://127.0.0.1:7700).
func NewClient(server string, opts Options) (*Client, error) {
	t, err := newTransport(server, &opts)
	if err != nil {
		return nil, err
	}
	c := &Client{t: t, owner: opts.Owner, ttl: opts.TTL, margin: opts.Margin, clock: opts.Clock, delay: opts.LockDelay, within: opts.ProgressWithin, unsettled: &unsettledKeys{}}
	if c.within < 0 {
		return nil, fmt.Errorf("fence: ProgressWithin must not be negative, not %v", c.within)
	}
	if c.delay < 0 || c.delay > 24*time.Hour || c.delay%time.Millisecond != 0 {
		return nil, fmt.Errorf("fence: a lock-delay is 0 to 24 h in whole ms, not %v", c.delay)
	}
	if c.owner == "" {
		c.owner = DefaultOwner()
	} else if err := CheckJob(c.owner); err != nil {
		return nil, fmt.Errorf("fence: owner: %w", err)
	}
	if c.ttl == 0 {
		c.ttl = 30 * time.Second
	}
	if err := checkTTL(c.ttl); err != nil {
		return nil, err
	}
	if c.margin < 0 || c.margin >= c.ttl {
		return nil, errors.New("fence: the safety margin must be shorter than the TTL")
	}
	if c.clock == nil {
		c.clock = systemClock{}
	}
	return c, nil
}

func checkTTL(ttl time.Duration) error {
	if ttl < 100*time.Millisecond || ttl > 24*time.Hour || ttl%time.Millisecond != 0 {
		return fmt.Errorf("fence: a lease TTL is 100 ms to 24 h in whole ms, not %v", ttl)
	}
	return nil
}

// Owner is the owner name this client claims under.
func (c *Client) Owner() string { return c.owner }

// Claim claims job and starts its keeper. Errors: a *ProblemError matching ErrLeaseHeld or
// ErrJobCompleted (or another refusal), ErrUnreachable, and ErrInvalidJobID before sending.
// After a claim whose answer was lost (ErrUnreachable, a 502, 503 or 504: it may have been
// granted), the next claim of the job asks with the same lease key, so that grant comes back
// rather than the job being held, by this owner, until it expires. A 200 that does not follow
// the contract is an ErrProtocol error: its grant is given back when the answer names its
// generation, else its key is kept for the next claim as after a lost answer.
func (c *Client) Claim(ctx context.Context, job string) (*Lease, error) {
	return c.ClaimWaiting(ctx, job, 0)
}

// ClaimWaiting is Claim, the server holding the claim up to wait while the job is held and
// answering the moment it frees (asked again every 60 s). A claim that waited long is renewed
// once at once, and its deadline counts from that renewal. When the server's waiting places are
// full (429 too-many-waiters) it asks again after its Retry-After (1 s without one, at least
// 50 ms) within wait.
func (c *Client) ClaimWaiting(ctx context.Context, job string, wait time.Duration) (*Lease, error) {
	return c.claim(ctx, job, wait, c.ttl)
}

func (c *Client) claim(ctx context.Context, job string, wait, ttl time.Duration) (*Lease, error) {
	enc, err := EncodeJob(job)
	if err != nil {
		return nil, err
	}
	// The key of an earlier claim of this job whose answer was lost, while that claim may
	// still hold the job: asked with it, the server gives that lease back.
	key, kept := c.unsettled.take(job, c.clock.Now())
	if !kept {
		if key, err = newLeaseKey(); err != nil {
			return nil, err
		}
	}
	ttlMs := uint64(ttl / time.Millisecond)
	body := c.claimBody(key, ttlMs)
	budget := ttl - marginOf(ttl, c.margin)
	waitUntil := c.clock.Now().Add(wait)
	var raw json.RawMessage
	var sent time.Time
	for {
		chunk := waitUntil.Sub(c.clock.Now())
		if chunk > 60*time.Second {
			chunk = 60 * time.Second
		}
		chunk = chunk.Truncate(time.Millisecond)
		path := "/v1/leases/" + enc + "/claim"
		if chunk > 0 {
			path += fmt.Sprintf("?wait=%dms", chunk.Milliseconds())
		} else {
			chunk = 0
		}
		sent = c.clock.Now()
		err = c.t.call(ctx, http.MethodPost, path, body, budget+chunk, &raw)
		if err == nil {
			break
		}
		if answerLost(err) || errors.Is(err, ErrProtocol) {
			// An answer lost may have been a grant, and so may a 200 this client cannot read
			// (not JSON), which no release can name: the same key gets it back.
			now := c.clock.Now()
			c.unsettled.keep(job, key, now.Add(ttl), now)
		}
		if errors.Is(err, ErrProtocol) {
			return nil, mayBeHeld(err, true)
		}
		var crowded *ProblemError
		if errors.As(err, &crowded) && crowded.Type == "urn:fence:too-many-waiters" && ctx.Err() == nil {
			// The server's waiting places are full (the job was held): asked again after its
			// Retry-After (1 s without one), at least 50 ms, within the wait (as the Rust client).
			if left := waitUntil.Sub(c.clock.Now()); left > 0 {
				// A Retry-After of 0 is 50 ms, as in the other clients; only none is 1 s.
				pause := crowded.RetryAfter
				if !crowded.retryAfterGiven {
					pause = time.Second
				}
				if pause < minWaitingClaimGap {
					pause = minWaitingClaimGap
				}
				if pause > left {
					pause = left
				}
				if err := sleepCtx(ctx, pause); err != nil {
					return nil, err
				}
				continue
			}
		}
		if !errors.Is(err, ErrLeaseHeld) || chunk == 0 || !c.clock.Now().Before(waitUntil) || ctx.Err() != nil {
			return nil, err
		}
		// A server that holds claims only briefly (its --max-claim-wait) would otherwise be
		// asked again at once, round trip after round trip: at most one claim per 50 ms.
		if pause := minWaitingClaimGap - c.clock.Now().Sub(sent); pause > 0 {
			if left := waitUntil.Sub(c.clock.Now()); left < pause {
				pause = left
			}
			if err := sleepCtx(ctx, pause); err != nil {
				return nil, err
			}
		}
	}
	return c.leaseFrom(ctx, job, key, ttlMs, sent, raw, nil)
}

// A semaphore claim is not held at the server: while every slot is taken, the client asks again
// after a pause that starts here and doubles up to the cap.
const (
	slotBackoffFirst = 10 * time.Millisecond
	slotBackoffMax   = 500 * time.Millisecond
)

// ClaimSlot claims one slot of semaphore resource, of slots slots (1 to 1000; contract section
// 15), and starts its keeper. The lease is an ordinary one on the slot's job, "<resource>#<slot>"
// (Job; Resource and Slot): renew, release, complete, checkpoint and the fencing headers work on
// it as on any job's. Release or complete it when done: completing a slot releases it (the
// server frees the slot; the Record's State is "free"), so once the lease is lost here neither
// is sent (a *LeaseLostError).
//
// The server never waits on a semaphore claim: with wait the client asks again while every slot
// is taken, after pauses of 10 ms doubling up to 500 ms (shorter when the slot that frees first
// frees sooner), until wait is over or ctx is done. Each call claims under a lease key of its
// own: two calls hold two slots, even under one owner. Within wait, a claim whose answer was
// lost (ErrUnreachable, a timeout, a 502, 503 or 504 after its Retry-After) is asked again with the same
// key, so a grant that was lost comes back as that slot rather than a second one (extended
// from the retry's decision).
//
// Errors: a *ProblemError matching ErrLeaseHeld (every slot taken when the wait ends; its Job is
// the slot that frees first; ErrLockDelay too while that slot's lock-delay runs) or
// ErrSemaphoreSize (slots of the resource are held under another number, its Slots), or another
// refusal; ErrUnreachable; and before sending, ErrInvalidJobID for a resource name that is not 1
// to 251 visible ASCII bytes or holds '#', an error for slots outside 1 to 1000.
func (c *Client) ClaimSlot(ctx context.Context, resource string, slots int, wait time.Duration) (*Lease, error) {
	if err := CheckResource(resource); err != nil {
		return nil, err
	}
	if err := checkSlots(slots); err != nil {
		return nil, err
	}
	enc, err := EncodeJob(resource)
	if err != nil {
		return nil, err
	}
	key, err := newLeaseKey()
	if err != nil {
		return nil, err
	}
	ttlMs := uint64(c.ttl / time.Millisecond)
	body := c.claimBody(key, ttlMs)
	body["slots"] = slots
	budget := c.ttl - marginOf(c.ttl, c.margin)
	path := "/v1/semaphores/" + enc + "/claim"
	waitUntil := c.clock.Now().Add(wait)
	backoff := slotBackoffFirst
	var raw json.RawMessage
	var sent time.Time
	for {
		sent = c.clock.Now()
		err = c.t.call(ctx, http.MethodPost, path, body, budget, &raw)
		if err == nil {
			break
		}
		if errors.Is(err, ErrProtocol) {
			return nil, mayBeHeld(err, false)
		}
		left := waitUntil.Sub(c.clock.Now())
		if left <= 0 || ctx.Err() != nil {
			return nil, err
		}
		var pause time.Duration
		var refused *ProblemError
		switch {
		case errors.Is(err, ErrLeaseHeld) && errors.As(err, &refused):
			pause = heldPause(refused, backoff)
		case errors.Is(err, ErrUnreachable):
			// The answer was lost, and it may have been a grant: the same key gets that slot back.
			pause = backoff
		case answerLost(err) && errors.As(err, &refused):
			// The same, after the answer's Retry-After when it had a longer one.
			if pause = backoff; refused.RetryAfter > pause {
				pause = refused.RetryAfter
			}
		default:
			return nil, err
		}
		if pause > left {
			pause = left
		}
		if err := sleepCtx(ctx, pause); err != nil {
			return nil, err
		}
		if backoff *= 2; backoff > slotBackoffMax {
			backoff = slotBackoffMax
		}
	}
	return c.leaseFrom(ctx, resource, key, ttlMs, sent, raw, func(a leaseAnswer) error {
		if a.Slot < 1 || a.Slot > slots || a.Job != resource+"#"+strconv.Itoa(a.Slot) || a.Resource != resource {
			return fmt.Errorf("%w: a claim of semaphore %s (%d slots) was answered with job %q, slot %d",
				ErrProtocol, resource, slots, a.Job, a.Slot)
		}
		return nil
	})
}

// minWaitingClaimGap is the least time between two sends of one waiting claim.
const minWaitingClaimGap = 50 * time.Millisecond

// sleepCtx pauses for d, or until ctx is done (its error then).
func sleepCtx(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// heldPause is how long to pause before asking for a slot again: until the slot that frees
// first may be free (the problem's expires_in_ms, or claimable_in_ms in a lock-delay), at most
// backoff, at least 1 ms.
func heldPause(held *ProblemError, backoff time.Duration) time.Duration {
	// A member that is null or not a count of milliseconds ("30", -5, 1.5) is no hint (the
	// other clients read it so): read as 0, it would mean asking again every millisecond.
	present := func(name string) bool {
		var ms uint64
		v, ok := held.Members[name]
		return ok && string(v) != "null" && json.Unmarshal(v, &ms) == nil
	}
	hint, given := held.ExpiresInMs, present("expires_in_ms")
	if present("claimable_in_ms") {
		hint, given = held.ClaimableInMs, true
	}
	pause := backoff
	// Compared in milliseconds: a hint above about 9.2e12 ms would overflow a time.Duration
	// (negative, then a millisecond's pause: a thousand claims a second).
	if given && hint < uint64(pause/time.Millisecond) {
		pause = time.Duration(hint) * time.Millisecond
	}
	if pause < time.Millisecond {
		pause = time.Millisecond
	}
	return pause
}

// claimBody is a claim's body; the lock-delay of the client, else the server's.
func (c *Client) claimBody(key string, ttlMs uint64) map[string]any {
	body := map[string]any{"owner": c.owner, "lease_key": key, "ttl_ms": ttlMs}
	if c.delay > 0 {
		body["lock_delay_ms"] = uint64(c.delay / time.Millisecond)
	}
	return body
}

// mayBeHeld is err, a claim's 200 that does not follow the contract, saying what it leaves: a
// grant no release can name (its generation, or a semaphore's slot, unknown), held until its
// TTL ends; with kept, until the next claim of the job, asked with the same key, gets it back.
func mayBeHeld(err error, kept bool) error {
	until := "its TTL ends"
	if kept {
		until += " or this client's next claim of the job (asked with the same key) gets it back"
	}
	return fmt.Errorf("%w; the lease it may stand for is held until %s", err, until)
}

// leaseFrom makes the lease of a claim sent at sent and answered 200 with raw, and starts its
// keeper; for a semaphore claim, slotErr checks the answer's slot first (the lease is then on
// the slot's job). An answer that does not follow the contract is an ErrProtocol error, and
// the grant it may stand for is given back when the answer names its generation: a release
// names a lease by owner, generation and key, and the owner and key are the claim's. One that
// names no generation, or no slot of the semaphore asked for, cannot be given back: it is held
// until its TTL ends, unless (a plain claim) the next claim, asked with the same key, gets it.
func (c *Client) leaseFrom(ctx context.Context, job, key string, ttlMs uint64, sent time.Time, raw json.RawMessage, slotErr func(leaseAnswer) error) (*Lease, error) {
	var a leaseAnswer
	err := json.Unmarshal(raw, &a)
	if err != nil {
		err = fmt.Errorf("%w: a claim of %s was answered %.200s: %v", ErrProtocol, job, redact(string(raw)), err)
		// Its generation alone (a member that did decode) names the grant.
		var named struct {
			Generation uint64 `json:"generation"`
		}
		if json.Unmarshal(raw, &named) != nil {
			named.Generation = 0
		}
		a.Generation = named.Generation
	}
	if slotErr != nil {
		if serr := slotErr(a); serr != nil {
			return nil, mayBeHeld(serr, false)
		}
		job = a.Job
	}
	if a.Generation == 0 {
		if err == nil {
			err = fmt.Errorf("%w: a claim of %s granted generation 0", ErrProtocol, job)
		}
		if slotErr == nil {
			// No release can name it: a plain claim's key is kept, so the next claim gets it
			// back. Only then: a key kept beside a release could get the grant back before the
			// release landed, which would then free the job under its new holder.
			now := c.clock.Now()
			c.unsettled.keep(job, key, now.Add(time.Duration(ttlMs)*time.Millisecond), now)
		}
		return nil, mayBeHeld(err, slotErr == nil)
	}
	l := c.newLease(job, key, ttlMs, a)
	if err == nil {
		err = checkCheckpoint(job, raw)
	}
	if err == nil {
		_, err = l.setGrant(sent, a, true)
	}
	if err != nil {
		// A token, ttl_ms or expires_at_ms that is not the contract's: given back, the release
		// asked again within the TTL asked for (there is no grant to go by).
		l.sent, l.ttl = sent, time.Duration(ttlMs)*time.Millisecond
		l.giveBack()
		return nil, fmt.Errorf("%w (the grant of generation %d is given back)", err, a.Generation)
	}
	return c.startLease(ctx, l, sent)
}

// checkCheckpoint refuses a claim's answer whose checkpoint, when it has one, lacks its
// generation or its data (as the Rust client; their types are checked as the answer decodes).
func checkCheckpoint(job string, raw json.RawMessage) error {
	var named struct {
		Checkpoint *struct {
			Generation *uint64 `json:"generation"`
			Data       *string `json:"data"`
		} `json:"checkpoint"`
	}
	if err := json.Unmarshal(raw, &named); err != nil {
		return fmt.Errorf("%w: a claim of %s was answered %.200s: %v", ErrProtocol, job, redact(string(raw)), err)
	}
	if cp := named.Checkpoint; cp != nil && (cp.Generation == nil || cp.Data == nil) {
		return fmt.Errorf("%w: a claim of %s was answered with a checkpoint without its generation or data", ErrProtocol, job)
	}
	return nil
}

// newLease is the lease of job granted by a, before its grant is taken.
func (c *Client) newLease(job, key string, ttlMs uint64, a leaseAnswer) *Lease {
	lctx, cancel := context.WithCancel(context.Background())
	return &Lease{t: c.t, clock: c.clock, job: job, owner: c.owner, generation: a.Generation, key: key,
		askedTTLMs: ttlMs, margin: c.margin, ctx: lctx, cancel: cancel, finished: make(chan struct{}),
		// Progress counts from the answer, not the send: a waiting claim may have been held
		// longer than ProgressWithin before it was granted.
		progressWithin: c.within, lastProgress: c.clock.Now(), resumed: a.Checkpoint, resource: a.Resource, slot: a.Slot}
}

// startLease starts the keeper of l, whose claim was sent at sent and whose grant it took.
func (c *Client) startLease(ctx context.Context, l *Lease, sent time.Time) (*Lease, error) {
	job := l.job
	if !l.Deadline().After(sent) {
		l.giveBack()
		return nil, fmt.Errorf("%w: job %s: the server granted a lease of %v, not longer than the safety margin of %v, so it could not be held at all; lower the client's safety margin or raise the server's maximum TTL",
			ErrGrantTooShort, job, l.TTL(), marginOf(l.TTL(), c.margin))
	}
	// A claim that waited long arrives with little time left: renew once, now, and count the
	// deadline from this send (against the grant, which may be shorter than asked).
	usable := l.Deadline().Sub(sent)
	if l.Deadline().Sub(c.clock.Now()) < usable*2/3 {
		sent = c.clock.Now()
		rctx, rcancel := context.WithTimeout(ctx, usable)
		a, err := l.sendRenew(rctx)
		rcancel()
		if err == nil {
			_, err = l.setGrant(sent, a, true)
		}
		if err != nil {
			l.giveBack() // not renewed: not held for a known time
			return nil, err
		}
	}
	if !c.clock.Now().Before(l.Deadline()) {
		l.giveBack()
		return nil, fmt.Errorf("%w: the lease on %s was granted too late to be of use", ErrUnreachable, job)
	}
	go l.keep()
	return l, nil
}

// RunOptions of Client.Run.
type RunOptions struct {
	// Wait at the server up to this long while the job is held.
	Wait time.Duration
	// OnSuccessRelease releases the job when fn returns nil, for a job that runs again;
	// the default completes it.
	OnSuccessRelease bool
}

// Run claims job, runs fn under a context that carries ctx's values and is cancelled when
// ctx is or the lease is lost (lease.Err says which), completes the job when fn returns nil
// (releases it with OnSuccessRelease) and releases it when fn fails. When fn panics or calls
// runtime.Goexit, the job is released before the panic (or Goexit) goes on. A lease lost while
// fn ran (past its local deadline, no progress, a refused renewal) is neither released nor
// completed, and Run returns fn's error, or the *LeaseLostError when fn returned nil. A lease fn
// abandoned (lease.Abandon) is neither released nor completed either, however fn ends (and Run
// returns fn's error, nil included). Either way it is left to expire, so the server's
// lock-delay applies: a write may still land.
func (c *Client) Run(ctx context.Context, job string, fn func(ctx context.Context, lease *Lease) error, opts RunOptions) error {
	lease, err := c.ClaimWaiting(ctx, job, opts.Wait)
	if err != nil {
		return err
	}
	// fn's context: ctx's (its values, its cancellation: a Ctrl-C through
	// signal.NotifyContext must reach the work), cut when the lease is lost.
	fctx, cancel := context.WithCancel(ctx)
	ran := make(chan struct{})
	go func() {
		select {
		case <-lease.Done():
			cancel()
		case <-ran:
		}
	}()
	returned := false
	defer func() {
		close(ran)
		cancel()
		if !returned && !lease.wasAbandoned() && lease.Err() == nil {
			// fn panicked (a caller may recover) or called runtime.Goexit: the job is
			// released before the panic goes on, or the keeper would renew it forever
			// (a lease lost or abandoned is left to expire, as below).
			_, _ = lease.Release(valuesOnly{ctx})
		}
	}()
	err = fn(fctx, lease)
	returned = true
	// The release or completion goes out even when ctx ends (before or during it), with its
	// values (each is bounded by the lease's end and a minute of retries): a cancelled run
	// must not leave its job held.
	finish := valuesOnly{ctx}
	if lease.wasAbandoned() {
		// Left to expire, so the lock-delay applies: the effect may still land.
		return err
	}
	if lost := lease.Err(); lost != nil {
		// Neither completed (the work may be unfinished) nor released: a write cut by the loss
		// may still land, and a release would let the next holder in beside it at once,
		// skipping the lock-delay. Left to expire; fn's own error, if any, is what counts.
		if err != nil {
			return err
		}
		return lost
	}
	if err != nil {
		_, _ = lease.Release(finish) // fn's own error is what counts
		return err
	}
	if opts.OnSuccessRelease {
		_, err = lease.Release(finish)
	} else {
		_, err = lease.Complete(finish)
	}
	return err
}

// Status is the job's lease record; a *ProblemError 404 unknown-job for a job never claimed.
func (c *Client) Status(ctx context.Context, job string) (Record, error) {
	var rec Record
	enc, err := EncodeJob(job)
	if err != nil {
		return rec, err
	}
	err = c.t.call(ctx, http.MethodGet, "/v1/leases/"+enc, nil, 0, &rec)
	return rec, err
}

// valuesOnly is a context with the values of another and none of its cancellation or
// deadline (context.WithoutCancel, which needs Go 1.21).
type valuesOnly struct{ context.Context }

func (valuesOnly) Deadline() (time.Time, bool) { return time.Time{}, false }
func (valuesOnly) Done() <-chan struct{}       { return nil }
func (valuesOnly) Err() error                  { return nil }
