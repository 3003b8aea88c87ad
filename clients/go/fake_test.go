// A scripted lease server for answers the real one never gives (a renewal held open forever, a
// gateway's 408, a crowded server's 429, a TTL above what was asked, an echo of the request).

package fence

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// reply is what a script answers; hang holds the request open until the server closes.
type reply struct {
	status  int
	headers map[string]string
	body    string
	hang    bool
}

func grantOf(body map[string]any, ttlMs uint64) reply {
	if ttlMs == 0 {
		ttlMs = uint64(body["ttl_ms"].(float64))
	}
	b, _ := json.Marshal(map[string]any{"job": "j", "owner": body["owner"], "generation": 1, "state": "held",
		"ttl_ms": ttlMs, "expires_at_ms": uint64(time.Now().UnixMilli()) + ttlMs})
	return reply{status: 200, headers: map[string]string{"content-type": "application/json"}, body: string(b)}
}

func problemReply(status int, kind string, headers map[string]string) reply {
	h := map[string]string{"content-type": "application/problem+json"}
	for k, v := range headers {
		h[k] = v
	}
	return reply{status: status, headers: h, body: fmt.Sprintf(`{"type":"urn:fence:%s","title":"%s","status":%d,"detail":"%s"}`, kind, kind, status, kind)}
}

type fakeSeen struct {
	action string
	body   map[string]any
}

type fakeServer struct {
	URL  string
	mu   sync.Mutex
	seen []fakeSeen
}

func (f *fakeServer) count(action string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, s := range f.seen {
		if s.action == action {
			n++
		}
	}
	return n
}

func (f *fakeServer) bodies(action string) []map[string]any {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []map[string]any
	for _, s := range f.seen {
		if s.action == action {
			out = append(out, s.body)
		}
	}
	return out
}

// startFake answers each request with script(action, body, n): action the path's last part
// (claim, renew, release...), n how many requests of that action came before.
func startFake(t *testing.T, script func(action string, body map[string]any, n int) reply) *fakeServer {
	f := &fakeServer{}
	closed := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		var body map[string]any
		_ = json.Unmarshal(raw, &body)
		parts := strings.Split(r.URL.Path, "/")
		action := parts[len(parts)-1]
		f.mu.Lock()
		n := 0
		for _, s := range f.seen {
			if s.action == action {
				n++
			}
		}
		f.seen = append(f.seen, fakeSeen{action, body})
		f.mu.Unlock()
		rep := script(action, body, n)
		if rep.hang {
			select {
			case <-closed:
			case <-r.Context().Done():
			}
			return
		}
		for k, v := range rep.headers {
			w.Header().Set(k, v)
		}
		w.WriteHeader(rep.status)
		_, _ = io.WriteString(w, rep.body)
	}))
	t.Cleanup(func() { close(closed); srv.CloseClientConnections(); srv.Close() })
	f.URL = srv.URL
	return f
}
