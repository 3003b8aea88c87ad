// The wire half of the client: job ids in paths, HTTP calls to the lease server.

package fence

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"
)

// CheckJob returns nil if job is a valid job id (1 to 256 bytes, each visible ASCII 0x21 to
// 0x7E), else an error matching ErrInvalidJobID: a space or anything outside visible ASCII
// never leaves the client.
func CheckJob(job string) error {
	if len(job) < 1 || len(job) > 256 {
		return fmt.Errorf("%w: a job id has 1 to 256 bytes, not %d", ErrInvalidJobID, len(job))
	}
	for i := 0; i < len(job); i++ {
		if c := job[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("%w: job id %q has byte 0x%02x at offset %d: only visible ASCII (0x21 to 0x7E) is allowed",
				ErrInvalidJobID, job, c, i)
		}
	}
	return nil
}

// MaxSlots is the most slots a semaphore has.
const MaxSlots = 1000

// CheckResource returns nil if resource can name a semaphore: a job id of at most 251 bytes (its
// slots' job ids <resource>#<slot> add '#' and up to 4 digits) without '#', which separates a
// resource from its slot number; else an error matching ErrInvalidJobID, before anything is
// sent.
func CheckResource(resource string) error {
	if len(resource) > 251 {
		return fmt.Errorf("%w: a resource name has 1 to 251 bytes, not %d (its slots' job ids add '#' and up to 4 digits)",
			ErrInvalidJobID, len(resource))
	}
	if err := CheckJob(resource); err != nil {
		return err
	}
	if strings.Contains(resource, "#") {
		return fmt.Errorf("%w: resource name %q holds '#', which separates a resource from its slot number in a slot's job id",
			ErrInvalidJobID, resource)
	}
	return nil
}

func checkSlots(slots int) error {
	if slots < 1 || slots > MaxSlots {
		return fmt.Errorf("fence: a semaphore has 1 to %d slots, not %d", MaxSlots, slots)
	}
	return nil
}

func unreserved(c byte) bool {
	return 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z' || '0' <= c && c <= '9' ||
		c == '-' || c == '.' || c == '_' || c == '~'
}

// EncodeJob percent-encodes a job id for a URL path: every byte but A-Z a-z 0-9 - . _ ~.
func EncodeJob(job string) (string, error) {
	if err := CheckJob(job); err != nil {
		return "", err
	}
	var b strings.Builder
	for i := 0; i < len(job); i++ {
		if c := job[i]; unreserved(c) {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String(), nil
}

// IdempotencyKey is the derived Idempotency-Key of one step of a job (contract section 11):
// the same for every holder of every generation, for third-party APIs that deduplicate by key.
func IdempotencyKey(job, step string) string {
	h := sha256.New()
	h.Write([]byte("fence-step-v1\x00"))
	h.Write([]byte(job))
	h.Write([]byte{0})
	h.Write([]byte(step))
	return "fence-" + base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

// DefaultOwner is <hostname>-<pid>-<random>, unique per process incarnation.
func DefaultOwner() string {
	host, _ := os.Hostname()
	clean := []byte(host)
	for i, c := range clean {
		if c < 0x21 || c > 0x7e {
			clean[i] = '-'
		}
	}
	if len(clean) == 0 {
		clean = []byte("host")
	} else if len(clean) > 200 {
		clean = clean[:200]
	}
	var r [4]byte
	_, _ = rand.Read(r[:])
	return fmt.Sprintf("%s-%d-%s", clean, os.Getpid(), hex.EncodeToString(r[:]))
}

func newLeaseKey() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return base64.RawURLEncoding.EncodeToString(b[:]), nil // 43 characters
}

// withoutUserinfo is url to quote in an error message: everything from its scheme's "//" (or
// its start) up to its last '@' removed, so no user or password it carries is shown, whatever
// its syntax (the '@' may follow a '/' of the password).
func withoutUserinfo(url string) string {
	at := strings.LastIndexByte(url, '@')
	if at < 0 {
		return url
	}
	return schemePrefix(url[:at]) + url[at+1:]
}

// schemePrefix is s's leading "<scheme>://", or "".
func schemePrefix(s string) string {
	i := strings.Index(s, "://")
	if i < 1 {
		return ""
	}
	for j := 0; j < i; j++ {
		c := s[j]
		letter := 'A' <= c && c <= 'Z' || 'a' <= c && c <= 'z'
		if !letter && (j == 0 || !('0' <= c && c <= '9' || c == '+' || c == '-' || c == '.')) {
			return ""
		}
	}
	return s[:i+3]
}

// transport makes HTTP calls to a lease server. Several servers that share one database act
// as one: a call goes to the one that answered last, and moves on to the next only when no
// connection could be made to it (refused, unreachable, TLS handshake failed), never once a
// request may have reached it, so no decision is ever asked of two servers (as the Rust client).
type transport struct {
	servers   []string // each server's base URL, without a trailing slash
	preferred atomic.Int32
	header    http.Header
	http      *http.Client
	timeout   time.Duration
}

// maxConnectShare is the longest one connection attempt may take while other servers are left
// to try.
const maxConnectShare = 2 * time.Second

// noConnection is the error of a connection that could not be made, its TLS handshake
// included: no request reached the server, so the next one may be asked.
type noConnection struct{ err error }

func (e *noConnection) Error() string { return "no connection: " + e.err.Error() }
func (e *noConnection) Unwrap() error { return e.err }

// connectWithinKey carries, in a request's context, how long connecting may take.
type connectWithinKey struct{}

// withConnectBudget is ctx ended after the connect budget its request set, if any.
func withConnectBudget(ctx context.Context) (context.Context, context.CancelFunc) {
	if within, ok := ctx.Value(connectWithinKey{}).(time.Duration); ok {
		return context.WithTimeout(ctx, within)
	}
	return context.WithCancel(ctx)
}

// serversOf is the servers of given (one URL, or several separated by commas, as FENCE_SERVER
// may hold and `fence run` passes on), each without a trailing slash.
func serversOf(given string) ([]string, error) {
	var servers []string
	for _, one := range strings.Split(given, ",") {
		one = strings.TrimRight(strings.TrimSpace(one), "/")
		if !strings.HasPrefix(one, "http://") && !strings.HasPrefix(one, "https://") {
			return nil, fmt.Errorf("fence: the server URL must start with http:// or https://, not %q", withoutUserinfo(one))
		}
		servers = append(servers, one)
	}
	if strings.Contains(given, "@") {
		// The server knows bearer secrets only: a user or password here is a mistake, and would
		// be quoted in every error message.
		return nil, errors.New("fence: the server URL must not carry a user or password ('@'): give the bearer secret as Options.AuthToken (or AuthTokenFile, FENCE_AUTH_TOKEN)")
	}
	return servers, nil
}

func newTransport(server string, opts *Options) (*transport, error) {
	if server == "" {
		server = os.Getenv("FENCE_SERVER")
	}
	if server == "" {
		server = "http://127.0.0.1:7700"
	}
	servers, err := serversOf(server)
	if err != nil {
		return nil, err
	}
	secret := opts.AuthToken
	if opts.AuthToken != "" && opts.AuthTokenFile != "" {
		return nil, errors.New("fence: give AuthToken or AuthTokenFile, not both")
	}
	if opts.AuthTokenFile != "" {
		b, err := os.ReadFile(opts.AuthTokenFile)
		if err != nil {
			return nil, fmt.Errorf("fence: reading the auth token file: %w", err)
		}
		if secret = strings.TrimSpace(string(b)); secret == "" {
			return nil, fmt.Errorf("fence: the auth token file %s is empty", opts.AuthTokenFile)
		}
	}
	source := "Options.AuthToken"
	if opts.AuthTokenFile != "" {
		source = "the auth token file " + opts.AuthTokenFile
	}
	if secret == "" {
		secret, source = os.Getenv("FENCE_AUTH_TOKEN"), "FENCE_AUTH_TOKEN"
	}
	// A secret read from an environment variable or a file often ends in a newline: white
	// space around it is no part of it. What is left goes in a header, so it must be visible
	// ASCII; the error never repeats it.
	if secret != "" {
		if secret = strings.TrimSpace(secret); secret == "" {
			return nil, fmt.Errorf("fence: the bearer secret (%s) is only white space", source)
		}
		for i := 0; i < len(secret); i++ {
			if secret[i] < 0x21 || secret[i] > 0x7e {
				return nil, fmt.Errorf("fence: the bearer secret (%s) holds a character an HTTP header cannot carry (a space, a control character or non-ASCII); it is not shown here", source)
			}
		}
	}
	t := &transport{servers: servers, header: http.Header{"Accept": {"application/json"}}, timeout: opts.Timeout}
	if t.timeout <= 0 {
		t.timeout = 10 * time.Second
	}
	if secret != "" {
		t.header.Set("Authorization", "Bearer "+secret)
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.Proxy = nil // the lease server is reached directly, never through an environment proxy
	caFile := opts.CAFile
	if caFile == "" {
		caFile = os.Getenv("FENCE_CA_CERT")
	}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("fence: reading the CA file: %w", err)
		}
		pool := x509.NewCertPool() // replaces the system roots, as curl --cacert does
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("fence: no certificate in the CA file %s", caFile)
		}
		base.TLSClientConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	}
	// Connections are made here, so that one that could not be made (its TLS handshake
	// included) is known as such, within the budget its call set.
	dialer := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	dial := func(ctx context.Context, network, addr string) (net.Conn, error) {
		ctx, cancel := withConnectBudget(ctx)
		defer cancel()
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, &noConnection{err}
		}
		return conn, nil
	}
	tlsConfig := base.TLSClientConfig
	if tlsConfig == nil {
		tlsConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	base.DialContext = dial
	base.DialTLSContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		ctx, cancel := withConnectBudget(ctx)
		defer cancel()
		conn, err := dialer.DialContext(ctx, network, addr)
		if err != nil {
			return nil, &noConnection{err}
		}
		host, _, err := net.SplitHostPort(addr)
		if err != nil {
			conn.Close()
			return nil, &noConnection{err}
		}
		config := tlsConfig.Clone()
		config.ServerName = host
		config.NextProtos = []string{"http/1.1"}
		tconn := tls.Client(conn, config)
		// ctx is the connect budget's: the handshake shares it with the TCP connect, so a
		// server that takes the connection and never answers the handshake is left for the
		// next one within its share (handshake_test.go). net/http's TLSHandshakeTimeout does
		// not apply to a DialTLSContext of our own.
		if err := tconn.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, &noConnection{err}
		}
		return tconn, nil
	}
	t.http = &http.Client{Transport: base, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}
	return t, nil
}

// call sends one request and decodes a 2xx JSON answer into out; else the problem as an error.
func (t *transport) call(ctx context.Context, method, path string, body any, timeout time.Duration, out any) error {
	if timeout <= 0 {
		timeout = t.timeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var data []byte
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		data = b
	}
	deadline, _ := ctx.Deadline()
	n := len(t.servers)
	first := int(t.preferred.Load()) % n
	var resp *http.Response
	var server string
	for tried := 0; ; tried++ {
		i := (first + tried) % n
		server = t.servers[i]
		actx := ctx
		if tried+1 < n {
			// A silent server must not use up the call while others are left to try: its
			// share of what is left, at most 2 s; the last one may take it all.
			within := time.Until(deadline) / time.Duration(n-tried)
			if within > maxConnectShare {
				within = maxConnectShare
			}
			actx = context.WithValue(ctx, connectWithinKey{}, within)
		}
		var reader io.Reader
		if data != nil {
			reader = bytes.NewReader(data)
		}
		req, err := http.NewRequestWithContext(actx, method, server+path, reader)
		if err != nil {
			return fmt.Errorf("%w: %v", ErrProtocol, err)
		}
		for k, v := range t.header {
			req.Header[k] = v
		}
		if body != nil {
			req.Header.Set("Content-Type", "application/json")
		}
		resp, err = t.http.Do(req)
		if err != nil {
			// No connection was made, so no request reached this server: the next one may be
			// asked. Any other failure may have reached it: never.
			var none *noConnection
			if errors.As(err, &none) && tried+1 < n && ctx.Err() == nil {
				continue
			}
			return fmt.Errorf("%w: %s %s%s: %v", ErrUnreachable, method, server, path, err)
		}
		if tried > 0 {
			t.preferred.Store(int32(i))
		}
		break
	}
	defer resp.Body.Close()
	payload, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("%w: %s %s%s: %v", ErrUnreachable, method, server, path, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return problemFrom(resp.StatusCode, resp.Header, payload)
	}
	if err := json.Unmarshal(payload, out); err != nil {
		return fmt.Errorf("%w: %s %s%s: %v: %.200s", ErrProtocol, method, server, path, err, redact(string(payload)))
	}
	return nil
}

// leaseAnswer is a claim's or renewal's 200.
type leaseAnswer struct {
	Job         string  `json:"job"`
	Owner       string  `json:"owner"`
	Generation  uint64  `json:"generation"`
	TTLMs       *uint64 `json:"ttl_ms"`
	ExpiresAtMs *uint64 `json:"expires_at_ms"`
	Token       *string `json:"token"`
	// Checkpoint is a claim's: the job's last checkpoint, if any.
	Checkpoint *Checkpoint `json:"checkpoint"`
	// Resource and Slot are a semaphore claim's: Job is "<Resource>#<Slot>".
	Resource string `json:"resource"`
	Slot     int    `json:"slot"`
}

// Checkpoint is a job's saved progress as a claim returns it: the text, and the generation
// whose holder saved it.
type Checkpoint struct {
	Generation uint64 `json:"generation"`
	Data       string `json:"data"`
}

// Record is a job's lease record (status, release, complete).
type Record struct {
	Job         string `json:"job"`
	Owner       string `json:"owner"` // "" when nobody (null)
	Generation  uint64 `json:"generation"`
	State       string `json:"state"` // free, held, expired or completed
	ExpiresInMs uint64 `json:"expires_in_ms"`
}
