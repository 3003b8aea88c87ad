// Answers the real server never gives, from a scripted one: each must leave the lease (or the
// claim) as the contract says.

package fence

import (
	"context"
	"testing"
	"time"
)

func TestARenewalThatNeverAnswersIsAbandonedAndAskedAgain(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		if action == "renew" && n == 0 {
			return reply{hang: true} // taken, never answered
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: time.Second})
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Abandon()
	time.Sleep(1500 * time.Millisecond) // past the claim's deadline: only a later renewal keeps it
	if err := lease.Err(); err != nil {
		t.Fatalf("lost: %v", err)
	}
	if n := f.count("renew"); n < 2 {
		t.Fatalf("%d renewals", n)
	}
}
