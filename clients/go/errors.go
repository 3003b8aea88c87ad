// Errors of the fence client: a lease lost locally, and problem+json answers.

package fence

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"time"
)

var (
	// ErrLeaseLost: the lease is lost; stop all work and effects on the job. Returned (as a
	// *LeaseLostError) by Lease.Token and the RoundTripper once the local deadline passed or the
	// server refused a renewal, and by Lease.Release then (or after Abandon), nothing sent; a
	// *ProblemError of type lease-lost or lease-key-mismatch matches it too.
	ErrLeaseLost = errors.New("fence: lease lost")
	// ErrInvalidJobID: a job id that is not 1 to 256 visible ASCII characters, or a semaphore's
	// resource name that is not 1 to 251 of them without '#'; nothing was sent.
	ErrInvalidJobID = errors.New("fence: invalid job id")
	// ErrUnreachable: no answer from the lease server (refused, reset, timed out, TLS).
	ErrUnreachable = errors.New("fence: lease server unreachable")
	// ErrProtocol: an answer that does not follow the contract.
	ErrProtocol = errors.New("fence: protocol error")
	// ErrGrantTooShort: the server granted a lease no longer than the client's safety margin
	// (its --max-ttl is below the TTL asked for): it could not be held at all, and is given
	// back at once. Lower the client's Margin or raise the server's maximum TTL.
	ErrGrantTooShort = errors.New("fence: grant too short")

	// ErrLeaseHeld matches a *ProblemError of type urn:fence:lease-held, and of type
	// urn:fence:lock-delay (nobody can claim the job for now either). For a semaphore claim,
	// every slot is taken, and the problem's Job is the slot that frees first.
	ErrLeaseHeld = errors.New("fence: lease held")
	// ErrLockDelay matches a *ProblemError of type urn:fence:lock-delay: the job's last lease
	// expired and its lock-delay runs for ClaimableInMs (Owner and Generation are the expired
	// lease's).
	ErrLockDelay = errors.New("fence: lock-delay running")
	// ErrSemaphoreSize matches a *ProblemError of type urn:fence:semaphore-size: slots of the
	// resource are in force (held or expired with their holder, or revoked before their lease
	// would have ended) under another number of slots, the problem's Slots. The number of
	// slots changes only while none of them is in force.
	ErrSemaphoreSize = errors.New("fence: semaphore has another number of slots")
	// ErrJobCompleted matches a *ProblemError of type urn:fence:job-completed.
	ErrJobCompleted = errors.New("fence: job completed")
	// ErrLeaseRefused matches a *ProblemError of type urn:fence:lease-lost or
	// urn:fence:lease-key-mismatch (which match ErrLeaseLost too).
	ErrLeaseRefused = errors.New("fence: lease refused by the server")
	// ErrStaleToken matches a destination's urn:fence:stale-token or urn:fence:token-expired:
	// a newer holder exists; stop. One exception: a token-expired (the problem's Type) while
	// your lease still holds (not lost) means the request waited past the end of the token
	// it carried (a signing server gives a new token at each renewal): send it again with the
	// lease's current token.
	ErrStaleToken = errors.New("fence: stale token")
)

// LeaseLostError says why a lease is lost. errors.Is(err, ErrLeaseLost) holds.
type LeaseLostError struct {
	Job        string
	Generation uint64
	Reason     string
	// InFlight: a request of the lease's Transport was on its way when the lease was lost,
	// and was cancelled then. It may have reached the destination (whose fence decides), so
	// its outcome is unknown: a newer holder retries the step with the same Idempotency-Key.
	// False: nothing was sent.
	InFlight bool
}

func (e *LeaseLostError) Error() string {
	msg := fmt.Sprintf("the lease on job %s (generation %d) is lost: %s", e.Job, e.Generation, e.Reason)
	if e.InFlight {
		msg += "; a request on its way was cancelled, and may have reached the destination"
	}
	return msg
}

// Is makes errors.Is(err, ErrLeaseLost) hold.
func (e *LeaseLostError) Is(target error) bool { return target == ErrLeaseLost }

// ProblemError is a refusal answered as application/problem+json (RFC 9457). Members holds
// every member of the object, Job, Owner, Generation and Highest the common ones.
type ProblemError struct {
	Type       string
	Title      string
	Status     int
	Detail     string
	Job        string
	Owner      string // "" when the problem says null or nothing
	Generation uint64
	// Highest is the destination's highest token, as it wrote it, for stale-token problems.
	Highest     string
	ExpiresInMs uint64
	// ClaimableInMs is how long until the job can be claimed, for lock-delay problems.
	ClaimableInMs uint64
	// Slots is the number of slots in force, for semaphore-size problems.
	Slots      int
	RetryAfter time.Duration
	Members    map[string]json.RawMessage
	// retryAfterGiven tells a Retry-After of 0 from none.
	retryAfterGiven bool
}

func (e *ProblemError) Error() string {
	return fmt.Sprintf("%d %s: %s", e.Status, e.Type, e.Detail)
}

// Is matches the sentinel of the problem's type: ErrLeaseHeld (and ErrLockDelay),
// ErrSemaphoreSize, ErrJobCompleted, ErrLeaseRefused (and ErrLeaseLost), ErrStaleToken.
func (e *ProblemError) Is(target error) bool {
	switch e.Type {
	case "urn:fence:lease-held":
		return target == ErrLeaseHeld
	case "urn:fence:lock-delay":
		return target == ErrLockDelay || target == ErrLeaseHeld
	case "urn:fence:semaphore-size":
		return target == ErrSemaphoreSize
	case "urn:fence:job-completed":
		return target == ErrJobCompleted
	case "urn:fence:lease-lost", "urn:fence:lease-key-mismatch":
		return target == ErrLeaseRefused || target == ErrLeaseLost
	case "urn:fence:stale-token", "urn:fence:token-expired":
		return target == ErrStaleToken
	}
	return false
}

// MaxRetryAfter is the most of a Retry-After a client waits for; its own wait still applies.
const MaxRetryAfter = 60 * time.Second

func problemFrom(status int, header http.Header, body []byte) *ProblemError {
	p := &ProblemError{Status: status, Type: "about:blank"}
	// Seconds, at most MaxRetryAfter: an HTTP-date, a negative or not-a-number value is no
	// answer (backoff decides), and a huge one no reason to wait for days (nor a float too
	// large for a Duration, whose conversion differs between platforms).
	if secs, err := strconv.ParseFloat(header.Get("Retry-After"), 64); err == nil && secs >= 0 {
		p.RetryAfter = time.Duration(math.Min(secs, MaxRetryAfter.Seconds()) * float64(time.Second))
		p.retryAfterGiven = true
	}
	var members map[string]json.RawMessage
	if strings.Contains(strings.ToLower(header.Get("Content-Type")), "json") &&
		json.Unmarshal(body, &members) == nil && members["type"] != nil &&
		json.Unmarshal(members["type"], &p.Type) == nil {
		p.Members = members
		_ = json.Unmarshal(members["title"], &p.Title)
		_ = json.Unmarshal(members["status"], &p.Status)
		_ = json.Unmarshal(members["detail"], &p.Detail)
		p.Detail = redact(p.Detail)
		_ = json.Unmarshal(members["job"], &p.Job)
		_ = json.Unmarshal(members["owner"], &p.Owner)
		_ = json.Unmarshal(members["generation"], &p.Generation)
		_ = json.Unmarshal(members["expires_in_ms"], &p.ExpiresInMs)
		_ = json.Unmarshal(members["claimable_in_ms"], &p.ClaimableInMs)
		_ = json.Unmarshal(members["slots"], &p.Slots)
		if h := members["highest"]; h != nil {
			var s string
			if json.Unmarshal(h, &s) == nil {
				p.Highest = s
			} else {
				p.Highest = string(h)
			}
		}
		return p
	}
	// Redacted before it is cut: a key cut short at the end would escape the redaction.
	p.Detail = redact(strings.TrimSpace(string(body)))
	if len(p.Detail) > 500 {
		p.Detail = p.Detail[:500]
	}
	return p
}

// leaseKeyValue is a lease_key member's value as an answer may quote it (JSON, a form, a repr).
var leaseKeyValue = regexp.MustCompile(`(lease_key\W{0,8}?)[A-Za-z0-9_-]{8,}`)

// redact is text (an answer quoted into a message) with any lease_key value replaced: an
// endpoint that echoes the request would otherwise put the lease's proof into errors and loss
// reasons, which end up in logs.
func redact(text string) string {
	return leaseKeyValue.ReplaceAllString(text, "${1}<redacted>")
}

// ProblemFromResponse returns the *ProblemError of a response that is not 2xx (for a
// destination's 409 stale-token, one matching ErrStaleToken), reading and closing its body;
// nil for a success, whose body is left alone.
func ProblemFromResponse(resp *http.Response) error {
	if resp.StatusCode < 400 {
		return nil
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	return problemFrom(resp.StatusCode, resp.Header, body)
}
