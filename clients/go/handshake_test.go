package fence

import (
	"context"
	"encoding/pem"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// A server that takes the TCP connection and never answers its TLS handshake is given up on
// within its connect share (at most 2 s), and the next server asked: the handshake is bounded
// by the per-server connect budget, not only by the whole call's time.
func TestATLSHandshakeThatNeverAnswersIsBoundedByTheConnectBudget(t *testing.T) {
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	// Appended by the accepting goroutine, closed by the test's: under a lock.
	var mu sync.Mutex
	var held []net.Conn
	closed := false
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		closed = true
		for _, c := range held {
			c.Close()
		}
	}()
	go func() {
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			if closed {
				c.Close()
			} else {
				held = append(held, c) // taken, never spoken to
			}
			mu.Unlock()
		}
	}()
	good := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("content-type", "application/json")
		_, _ = w.Write([]byte(`{"job":"j","owner":null,"generation":0,"state":"free","expires_in_ms":0}`))
	}))
	defer good.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	cert := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: good.Certificate().Raw})
	if err := os.WriteFile(ca, cert, 0o600); err != nil {
		t.Fatal(err)
	}
	servers := "https://" + silent.Addr().String() + "," + good.URL
	c := mustClient(t, servers, Options{Owner: "o", Timeout: 20 * time.Second, CAFile: ca})
	start := time.Now()
	rec, err := c.Status(context.Background(), "j")
	if err != nil || rec.State != "free" {
		t.Fatalf("%+v, %v", rec, err)
	}
	if took := time.Since(start); took > 4*time.Second {
		t.Fatalf("the silent handshake took %v of the call", took)
	}
}
