package fence

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// A claim answered 200 with a grant that does not follow the contract: the caller gets an
// ErrProtocol error, and the lease it stands for is not left held, unused, until its TTL ends.
// A grant that names its generation is given back at once; one that does not keeps its key,
// which the next claim of the job asks with (so it gets that lease back).

type seenRequest struct {
	path string
	body map[string]any
}

// manglingFront fronts the lease server: it forwards everything, records each request's path
// and body, and hands the first 200 of a claim to mangle (the decoded answer; the body to
// answer with).
type manglingFront struct {
	url  string
	mu   sync.Mutex
	seen []seenRequest
}

func newManglingFront(t *testing.T, serverURL string, mangle func(map[string]any) string) *manglingFront {
	t.Helper()
	target, err := url.Parse(serverURL)
	if err != nil {
		t.Fatal(err)
	}
	f := &manglingFront{}
	left := 1
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = func(resp *http.Response) error {
		if resp.StatusCode != http.StatusOK || !strings.HasSuffix(resp.Request.URL.Path, "/claim") {
			return nil
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if left == 0 {
			return nil
		}
		left--
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		var a map[string]any
		d := json.NewDecoder(bytes.NewReader(b))
		d.UseNumber()
		if err := d.Decode(&a); err != nil {
			return err
		}
		out := mangle(a)
		resp.Body = io.NopCloser(strings.NewReader(out))
		resp.ContentLength = int64(len(out))
		resp.Header.Set("Content-Length", strconv.Itoa(len(out)))
		return nil
	}
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		var body map[string]any
		_ = json.Unmarshal(b, &body)
		f.mu.Lock()
		f.seen = append(f.seen, seenRequest{r.URL.EscapedPath(), body})
		f.mu.Unlock()
		r.Body = io.NopCloser(bytes.NewReader(b))
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	f.url = front.URL
	return f
}

// requests are the requests seen so far whose path ends with suffix.
func (f *manglingFront) requests(suffix string) []seenRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []seenRequest
	for _, r := range f.seen {
		if strings.HasSuffix(r.path, suffix) {
			out = append(out, r)
		}
	}
	return out
}

// waitRelease waits for the front to see a release; it fails after 5 s.
func (f *manglingFront) waitRelease(t *testing.T, what string) seenRequest {
	t.Helper()
	for until := time.Now().Add(5 * time.Second); time.Now().Before(until); time.Sleep(10 * time.Millisecond) {
		if r := f.requests("/release"); len(r) > 0 {
			return r[0]
		}
	}
	t.Fatalf("%s: no release within 5 s", what)
	return seenRequest{}
}

// freeWithin waits for the server to record job as free; it fails after 5 s.
func freeWithin(t *testing.T, c *Client, job, what string) {
	t.Helper()
	var rec Record
	var err error
	for until := time.Now().Add(5 * time.Second); time.Now().Before(until); time.Sleep(10 * time.Millisecond) {
		if rec, err = c.Status(context.Background(), job); err == nil && rec.State == "free" {
			return
		}
	}
	t.Fatalf("%s: %s not given back: %+v %v", what, job, rec, err)
}

func with(a map[string]any, name string, value any) string {
	if value == nil {
		delete(a, name)
	} else {
		a[name] = value
	}
	b, _ := json.Marshal(a)
	return string(b)
}

func TestAMalformedGrantThatNamesItsGenerationIsGivenBack(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	observer := mustClient(t, s.serverURL, Options{Owner: "observer"})
	cases := []struct {
		what   string
		mangle func(map[string]any) string
	}{
		{"without ttl_ms", func(a map[string]any) string { return with(a, "ttl_ms", nil) }},
		{"ttl_ms 0", func(a map[string]any) string { return with(a, "ttl_ms", 0) }},
		{"ttl_ms 1.5", func(a map[string]any) string { return with(a, "ttl_ms", 1.5) }},
		{"ttl_ms -5", func(a map[string]any) string { return with(a, "ttl_ms", -5) }},
		{"a token of another generation", func(a map[string]any) string { return with(a, "token", "99.1.x") }},
		// Outside what a server grants (0.1 s to 24 h), refused by the Rust client; taken
		// before, 1e16 ms overflowing a time.Duration.
		{"ttl_ms 99", func(a map[string]any) string { return with(a, "ttl_ms", 99) }},
		{"ttl_ms 86400001", func(a map[string]any) string { return with(a, "ttl_ms", 86_400_001) }},
		{"ttl_ms 1e16", func(a map[string]any) string { return with(a, "ttl_ms", uint64(1e16)) }},
		// A checkpoint without its generation or data was handed to the worker as zero values.
		{"checkpoint without data", func(a map[string]any) string {
			return with(a, "checkpoint", map[string]any{"generation": 1})
		}},
		{"checkpoint without a generation", func(a map[string]any) string {
			return with(a, "checkpoint", map[string]any{"data": "rows"})
		}},
		{"checkpoint generation null", func(a map[string]any) string {
			return with(a, "checkpoint", map[string]any{"generation": nil, "data": "rows"})
		}},
		{"checkpoint text", func(a map[string]any) string { return with(a, "checkpoint", "rows 0-999") }},
		{"checkpoint data 5", func(a map[string]any) string {
			return with(a, "checkpoint", map[string]any{"generation": 1, "data": 5})
		}},
	}
	for i, c := range cases {
		job := "malformed-" + strconv.Itoa(i)
		front := newManglingFront(t, s.serverURL, c.mangle)
		client := mustClient(t, front.url, Options{Owner: "worker", TTL: 30 * time.Second})
		_, err := client.Claim(ctx, job)
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "given back") {
			t.Fatalf("%s: %v", c.what, err)
		}
		// The release names the grant: the claim's owner and key, the answer's generation.
		release := front.waitRelease(t, c.what)
		claim := front.requests("/claim")[0]
		if release.path != "/v1/leases/"+job+"/release" || release.body["owner"] != "worker" ||
			release.body["generation"] != 1.0 || release.body["lease_key"] != claim.body["lease_key"] {
			t.Fatalf("%s: release %+v after claim %+v", c.what, release, claim)
		}
		freeWithin(t, observer, job, c.what)
		// Its key is not kept: asked again with it before the release landed, the claim would
		// get the grant back and the release would then free the job under its new holder.
		again, err := client.Claim(ctx, job)
		if err != nil {
			t.Fatalf("%s: the claim after the give-back: %v", c.what, err)
		}
		claims := front.requests("/claim")
		if len(claims) != 2 || claims[1].body["lease_key"] == claims[0].body["lease_key"] || again.Generation() != 2 {
			t.Fatalf("%s: the given-back key was kept: %+v, generation %d", c.what, claims, again.Generation())
		}
		_, _ = again.Release(ctx)
	}
}

func TestAMalformedGrantWithoutAGenerationKeepsItsKeyForTheNextClaim(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	cases := []struct {
		what   string
		mangle func(map[string]any) string
	}{
		{"without a generation", func(a map[string]any) string { return with(a, "generation", nil) }},
		{"generation 0", func(a map[string]any) string { return with(a, "generation", 0) }},
		{"generation -1", func(a map[string]any) string { return with(a, "generation", -1) }},
		{"not JSON", func(map[string]any) string { return `{"job": ` }},
	}
	for i, c := range cases {
		job := "nameless-" + strconv.Itoa(i)
		front := newManglingFront(t, s.serverURL, c.mangle)
		client := mustClient(t, front.url, Options{Owner: "worker", TTL: 30 * time.Second})
		_, err := client.Claim(ctx, job)
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "held until its TTL ends") {
			t.Fatalf("%s: %v", c.what, err)
		}
		if r := front.requests("/release"); len(r) > 0 {
			t.Fatalf("%s: a release without a generation: %+v", c.what, r)
		}
		// Asked with the same key, the server gives that very lease back (another key: 409 held).
		lease, err := client.Claim(ctx, job)
		if err != nil {
			t.Fatalf("%s: the next claim: %v", c.what, err)
		}
		claims := front.requests("/claim")
		if len(claims) != 2 || claims[1].body["lease_key"] != claims[0].body["lease_key"] || lease.Generation() != 1 {
			t.Fatalf("%s: generation %d after claims %+v", c.what, lease.Generation(), claims)
		}
		_, _ = lease.Release(ctx)
	}
}

func TestAMalformedGrantOfASemaphoreSlotIsGivenBack(t *testing.T) {
	ctx := context.Background()
	s := newStack(t, stackOpts{noProxy: true})
	front := newManglingFront(t, s.serverURL, func(a map[string]any) string { return with(a, "ttl_ms", -5) })
	_, err := mustClient(t, front.url, Options{Owner: "worker", TTL: 30 * time.Second}).ClaimSlot(ctx, "exports", 2, 0)
	if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "given back") {
		t.Fatal(err)
	}
	release := front.waitRelease(t, "slot")
	claim := front.requests("/claim")[0]
	if release.path != "/v1/leases/exports%231/release" || release.body["generation"] != 1.0 ||
		release.body["lease_key"] != claim.body["lease_key"] {
		t.Fatalf("release %+v after claim %+v", release, claim)
	}
	freeWithin(t, mustClient(t, s.serverURL, Options{Owner: "observer"}), "exports#1", "slot")
}
