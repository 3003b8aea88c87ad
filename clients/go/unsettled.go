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

// answerLost reports whether err means a claim's answer was lost (the server unreachable, a
// timeout, a 502, 503 or 504 of the server or a gateway): it may have been a grant, which the
// same lease key gets back.
func answerLost(err error) bool {
	var refused *ProblemError
	return errors.Is(err, ErrUnreachable) || (errors.As(err, &refused) &&
		(refused.Status == http.StatusBadGateway || refused.Status == http.StatusServiceUnavailable ||
			refused.Status == http.StatusGatewayTimeout))
}
