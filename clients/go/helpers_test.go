// Test helpers: the real `fence server` and `fence proxy` as child processes on ephemeral
// loopback ports, an upstream that records what reached it, raw HTTP that bypasses the client.

package fence

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fenceBin is FENCE_BIN, else ../../target/debug/fence from the client directory; missing fails.
func fenceBin(t *testing.T) string {
	t.Helper()
	path := os.Getenv("FENCE_BIN")
	if path == "" {
		path = filepath.Join("..", "..", "target", "debug", "fence")
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := os.Stat(abs); err != nil || info.IsDir() || info.Mode()&0o111 == 0 {
		t.Fatalf("the fence binary is missing at %s: build it (cargo build) or set FENCE_BIN", abs)
	}
	return abs
}

type proc struct {
	cmd   *exec.Cmd
	addr  string
	mu    sync.Mutex
	lines []string
}

func (p *proc) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

var listenRe = regexp.MustCompile(`listen=(\S+)`)

// startFence runs `fence ARGS...` until its ready line; killed when the test ends.
func startFence(t *testing.T, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(fenceBin(t), args...)
	cmd.Env = append(os.Environ(), "RUST_LOG=info")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	ready := make(chan string, 1)
	go func() {
		scanner := bufio.NewScanner(stderr)
		for scanner.Scan() {
			line := scanner.Text()
			p.mu.Lock()
			p.lines = append(p.lines, line)
			p.mu.Unlock()
			if strings.Contains(line, " ready ") {
				select {
				case ready <- line:
				default:
				}
			}
		}
	}()
	select {
	case line := <-ready:
		p.addr = listenRe.FindStringSubmatch(line)[1]
	case <-time.After(15 * time.Second):
		p.mu.Lock()
		defer p.mu.Unlock()
		t.Fatalf("fence %v did not get ready:\n%s", args, strings.Join(p.lines, "\n"))
	}
	return p
}

type seen struct {
	Job, Token, Body string
}

type upstream struct {
	mu   sync.Mutex
	seen []seen
	url  string
}

func (u *upstream) all() []seen {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seen(nil), u.seen...)
}

func startUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{}
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.seen = append(u.seen, seen{r.Header.Get("X-Fencing-Job"), r.Header.Get("X-Fencing-Token"), string(body)})
		u.mu.Unlock()
		_, _ = w.Write([]byte("ok\n"))
	})}
	go func() { _ = srv.Serve(listener) }()
	t.Cleanup(func() { _ = srv.Close() })
	u.url = "http://" + listener.Addr().String()
	return u
}

type stackOpts struct {
	signing    bool
	noProxy    bool
	serverArgs []string
	scheme     string
}

type testStack struct {
	dir       string
	server    *proc
	serverURL string
	proxyURL  string
	upstream  *upstream
}

func newStack(t *testing.T, o stackOpts) *testStack {
	t.Helper()
	dir := t.TempDir()
	args := []string{"server", "--listen", "127.0.0.1:0", "--data-dir", filepath.Join(dir, "leases")}
	keys := filepath.Join(dir, "keys")
	if o.signing {
		if out, err := exec.Command(fenceBin(t), "keygen", "--out", keys).CombinedOutput(); err != nil {
			t.Fatalf("keygen: %v %s", err, out)
		}
		args = append(args, "--signing-key", filepath.Join(keys, "fence-signing.pem"))
	}
	s := &testStack{dir: dir}
	s.server = startFence(t, append(args, o.serverArgs...)...)
	scheme := o.scheme
	if scheme == "" {
		scheme = "http"
	}
	s.serverURL = scheme + "://" + s.server.addr
	if !o.noProxy {
		s.upstream = startUpstream(t)
		pargs := []string{"proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
			"--upstream", s.upstream.url, "--data-dir", filepath.Join(dir, "sink")}
		if o.signing {
			pargs = append(pargs, "--verify-key", filepath.Join(keys, "fence-verify.pem"))
		}
		s.proxyURL = "http://" + startFence(t, pargs...).addr
	}
	return s
}

// raw sends one request with a plain http.Client, bypassing the lease's checks.
func raw(t *testing.T, method, url string, header map[string]string, body string) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	b, _ := io.ReadAll(resp.Body)
	_ = json.Unmarshal(b, &out)
	return resp.StatusCode, out
}

func post(t *testing.T, c *http.Client, url, body string) (*http.Response, error) {
	t.Helper()
	resp, err := c.Post(url, "text/plain", strings.NewReader(body))
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return resp, err
}

// pauseRenewals stops every renewal from reaching the server, as a whole-keeper pause (GC,
// SIGSTOP) would; the returned func resumes.
func pauseRenewals(l *Lease) func() {
	resume := make(chan struct{})
	l.mu.Lock()
	l.renewHook = func(ctx context.Context) (leaseAnswer, error) {
		select {
		case <-resume:
		case <-time.After(30 * time.Second):
		}
		return leaseAnswer{}, ErrUnreachable
	}
	l.mu.Unlock()
	var once sync.Once
	return func() { once.Do(func() { close(resume) }) }
}

// lostWithin waits for the lease's context; the wall time (ms) it was done, or fails.
func lostWithin(t *testing.T, l *Lease, within time.Duration) int64 {
	t.Helper()
	select {
	case <-l.Done():
		return time.Now().UnixMilli()
	case <-time.After(within):
		t.Fatalf("%s: the lease's context was not done within %v", l.Job(), within)
		return 0
	}
}

func mustClient(t *testing.T, server string, o Options) *Client {
	t.Helper()
	c, err := NewClient(server, o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
