// Answers the real server never gives, from a scripted one: each must leave the lease (or the
// claim) as the contract says.

package fence

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
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
	// A 6 s lease: renewed every 2 s, the hung attempt given up after 2 s and the renewal asked
	// again some 0.5 s later, almost a second before the deadline (5.4 s): room for a loaded
	// machine. Were the attempt given all the time left, it would use up the lease.
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: 6 * time.Second})
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Abandon()
	time.Sleep(6 * time.Second) // past the claim's deadline: only a later renewal keeps it
	if err := lease.Err(); err != nil {
		t.Fatalf("lost: %v", err)
	}
	if n := f.count("renew"); n < 2 {
		t.Fatalf("%d renewals", n)
	}
}

func TestAReleaseAnswered408BodyTimeoutIsAskedAgain(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		switch {
		case action == "release" && n == 0:
			return problemReply(408, "body-timeout", nil)
		case action == "release":
			return reply{status: 200, headers: map[string]string{"content-type": "application/json"},
				body: `{"job":"j","owner":null,"generation":1,"state":"free","expires_in_ms":0}`}
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: 5 * time.Second})
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	rec, err := lease.Release(context.Background())
	if err != nil || rec.State != "free" {
		t.Fatalf("%+v, %v", rec, err)
	}
	if n := f.count("release"); n != 2 {
		t.Fatalf("%d releases", n)
	}
}

func TestAClaimAnsweredAGateways408IsAskedAgainWithTheSameKey(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		if action == "claim" && n == 0 {
			return reply{status: 408, headers: map[string]string{"content-type": "text/plain"}, body: "request timeout"}
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: 5 * time.Second})
	var refused *ProblemError
	if _, err := c.Claim(context.Background(), "j"); !errors.As(err, &refused) || refused.Status != 408 {
		t.Fatalf("claim: %v", err)
	}
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	lease.Abandon()
	claims := f.bodies("claim")
	if len(claims) != 2 || claims[0]["lease_key"] != claims[1]["lease_key"] {
		t.Fatalf("claims: %v", claims)
	}
}

func TestAWaitingClaimRefusedForTooManyWaitersAsksAgainWithinItsWait(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		if action == "claim" && n < 2 {
			return problemReply(429, "too-many-waiters", map[string]string{"retry-after": "0.05"})
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: 5 * time.Second})
	lease, err := c.ClaimWaiting(context.Background(), "j", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	lease.Abandon()
	if n := f.count("claim"); n != 3 {
		t.Fatalf("%d claims", n)
	}
}

func TestAWaitingClaimRefusedWithRetryAfterZeroAsksAgainAfter50ms(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		if action == "claim" && n < 2 {
			return problemReply(429, "too-many-waiters", map[string]string{"retry-after": "0"})
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: 5 * time.Second})
	start := time.Now()
	lease, err := c.ClaimWaiting(context.Background(), "j", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	lease.Abandon()
	// Two pauses of 50 ms (the least between waiting claims), not of a second each.
	if took := time.Since(start); took > 1500*time.Millisecond || f.count("claim") != 3 {
		t.Fatalf("%d claims in %v", f.count("claim"), took)
	}
}

func TestAGrantAboveTheTTLAskedDoesNotMoveTheDeadlinePastIt(t *testing.T) {
	// Every grant ten times what was asked: the deadline still counts from the 1 s asked.
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		return grantOf(body, 10*uint64(body["ttl_ms"].(float64)))
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: time.Second})
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Abandon()
	if lease.TTL() != 10*time.Second {
		t.Fatalf("TTL %v", lease.TTL())
	}
	if out := time.Until(lease.Deadline()); out > 900*time.Millisecond {
		t.Fatalf("the deadline is %v out", out)
	}
	// Renewed before the asked TTL's deadline (not a third of 10 s), each counted from 1 s.
	until := time.Now().Add(3 * time.Second)
	for f.count("renew") < 2 {
		if time.Now().After(until) {
			t.Fatal("not renewed as the asked TTL needs")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if out := time.Until(lease.Deadline()); out > 900*time.Millisecond || lease.Err() != nil {
		t.Fatalf("the deadline is %v out (%v)", out, lease.Err())
	}
}

func TestAnEndpointThatEchoesTheRequestNeverPutsTheLeaseKeyInErrors(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status int
		prefix string
	}{{"a refusal whose body is the request", 400, ""}, {"a 200 that is not JSON", 200, "echo: "}} {
		f := startFake(t, func(action string, body map[string]any, n int) reply {
			b, _ := json.Marshal(body)
			return reply{status: tc.status, headers: map[string]string{"content-type": "text/plain"}, body: tc.prefix + string(b)}
		})
		c := mustClient(t, f.URL, Options{Owner: "o", TTL: time.Second})
		_, err := c.Claim(context.Background(), "j")
		key := f.bodies("claim")[0]["lease_key"].(string)
		if err == nil || !strings.Contains(err.Error(), "lease_key") || strings.Contains(err.Error(), key) {
			t.Errorf("%s: %v", tc.name, err)
		}
	}
}

// sink records the raw bytes of each connection until the request's chunked body ends or the
// connection closes.
func sink(t *testing.T) (string, <-chan []byte) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	got := make(chan []byte, 4)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
				var data []byte
				buf := make([]byte, 65536)
				for !bytes.HasSuffix(data, []byte("0\r\n\r\n")) {
					n, err := conn.Read(buf)
					data = append(data, buf[:n]...)
					if err != nil {
						break
					}
				}
				if bytes.HasSuffix(data, []byte("0\r\n\r\n")) {
					_, _ = conn.Write([]byte("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"))
				}
				got <- data
			}()
		}
	}()
	return "http://" + ln.Addr().String() + "/upload", got
}

func TestABodyWrappedByLeaseBodyIsCutAtTheLoss(t *testing.T) {
	f := startFake(t, func(action string, body map[string]any, n int) reply {
		if action == "renew" {
			return reply{hang: true}
		}
		return grantOf(body, 0)
	})
	c := mustClient(t, f.URL, Options{Owner: "o", TTL: time.Second})
	lease, err := c.Claim(context.Background(), "j")
	if err != nil {
		t.Fatal(err)
	}
	url, got := sink(t)
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write([]byte("first chunk"))
		time.Sleep(1500 * time.Millisecond) // past the lease's deadline
		_, _ = pw.Write([]byte("second chunk"))
		pw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, url, lease.Body(pr))
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err == nil {
		resp.Body.Close()
		t.Fatal("the upload went through after the loss")
	}
	if !errors.Is(err, ErrLeaseLost) {
		t.Errorf("not a lease loss: %v", err)
	}
	select {
	case data := <-got:
		if !bytes.Contains(data, []byte("first chunk")) || bytes.Contains(data, []byte("second chunk")) || bytes.HasSuffix(data, []byte("0\r\n\r\n")) {
			t.Fatalf("the sink got %q", data)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the sink saw no connection end")
	}
}

func TestALeaseKeyCutShortInATextAnswerIsRedacted(t *testing.T) {
	// A text answer quoted up to 500 bytes, its cut 7 characters into the key.
	key := "KEYPART" + strings.Repeat("k", 36)
	head := strings.Repeat("x", 500-len(`lease_key":"`)-7) + `lease_key":"`
	p := problemFrom(400, http.Header{"Content-Type": {"text/plain"}}, []byte(head+key+`"}`))
	if !strings.Contains(p.Error(), "lease_key") || strings.Contains(p.Error(), "KEYPART") {
		t.Fatalf("%s", p.Error())
	}
}
