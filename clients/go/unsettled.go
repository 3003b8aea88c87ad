package fence

import (
	"errors"
	"net/http"
	"sync"
	"time"
)

// maxUnsettled is the most lease keys of claims with lost answers a client keeps: past it,
// expired ones go first, then new ones are not kept.
const maxUnsettled = 10000

// unsettledKeys keeps, by job, the lease key of the last claim whose answer was lost, until
// a lease that claim may have won would have expired. The next claim of the job asks with it:
// the server then gives that lease back instead of answering that the job is held, by this
// very owner, until it expires.
type unsettledKeys struct {
	mu   sync.Mutex
	keys map[string]unsettledKey
}

type unsettledKey struct {
	key   string
	until time.Time
}

// take removes and returns job's kept key, if a lease it won could still be held at now.
func (u *unsettledKeys) take(job string, now time.Time) (string, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	k, ok := u.keys[job]
	delete(u.keys, job)
	if !ok || !now.Before(k.until) {
		return "", false
	}
	return k.key, true
}

// keep keeps key for job until until.
func (u *unsettledKeys) keep(job, key string, until, now time.Time) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.keys == nil {
		u.keys = make(map[string]unsettledKey)
	}
	if len(u.keys) >= maxUnsettled {
		for j, k := range u.keys {
			if !now.Before(k.until) {
				delete(u.keys, j)
			}
		}
	}
	if len(u.keys) < maxUnsettled {
		u.keys[job] = unsettledKey{key, until}
	}
}

// bodyTimeout is the lease server's own 408: the request did not arrive whole in time.
const bodyTimeout = "urn:fence:body-timeout"

// answerLost reports whether err means a request's answer was lost (the server unreachable, a
// timeout, a 502, 503 or 504 of the server or a gateway, or a 408 that is not the lease
// server's own body-timeout: a gateway's, such as envoy's when the server sent no head in
// time, after it forwarded the request): it may have been applied, and for a claim a grant,
// which the same lease key gets back.
func answerLost(err error) bool {
	var refused *ProblemError
	return errors.Is(err, ErrUnreachable) || (errors.As(err, &refused) &&
		(refused.Status == http.StatusBadGateway || refused.Status == http.StatusServiceUnavailable ||
			refused.Status == http.StatusGatewayTimeout ||
			(refused.Status == http.StatusRequestTimeout && refused.Type != bodyTimeout)))
}

// busy reports whether err is the lease server's own 408 body-timeout: nothing was applied,
// and asking again may pass (as the Rust client's StoreError::Busy).
func busy(err error) bool {
	var refused *ProblemError
	return errors.As(err, &refused) && refused.Status == http.StatusRequestTimeout && refused.Type == bodyTimeout
}
