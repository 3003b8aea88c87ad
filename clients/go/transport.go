// The fencing transport: a lease's headers on every request, and a request cancelled when the
// lease is lost before its answer's head arrives.

package fence

import (
	"context"
	"io"
	"net/http"
	"sync"
)

// Transport returns an http.RoundTripper that stamps X-Fencing-Job and X-Fencing-Token on
// every request, read as the request goes out, and refuses (a *LeaseLostError, errors.Is
// ErrLeaseLost, wrapped by http.Client in a *url.Error) without sending once the lease's
// context is done. A request still on its way when the lease is lost (dialling, waiting for
// a connection, sending its body, waiting for the answer's head) is cancelled then, with the
// same error, its InFlight set: it may have reached the destination, so its outcome is
// unknown. The answer's body, once its head has arrived, is left alone. base's own retries
// (net/http resends a request with an Idempotency-Key on a fresh connection when a kept-alive
// one was closed under it) happen within that time. base nil means http.DefaultTransport.
func (l *Lease) Transport(base http.RoundTripper) http.RoundTripper {
	if base == nil {
		base = http.DefaultTransport
	}
	return &fencingTransport{lease: l, base: base}
}

// Body wraps r, a request's body, so that each read checks the lease, before and after: once
// the lease is lost, the read fails with the lease's *LeaseLostError (errors.Is ErrLeaseLost),
// what it read is dropped, and nothing more of r is sent. Opt in with it when a body is
// streamed (an upload that may outlast the lease) through a client that does not use
// Transport, which already cancels a request still sending its body at the loss. Close
// closes r when it is an io.Closer.
//
// Each read is checked, not the write that follows: what a read returned before the loss
// still goes out (HTTP/2 flow control can hold it back a while).
//
// http.NewRequest learns the length of a *bytes.Reader, *bytes.Buffer or *strings.Reader,
// not of this wrapper: set req.ContentLength by hand when it is known (else the body is sent
// chunked, or refused by a server that wants a length), and req.GetBody stays nil, so the
// request is not sent again on a 307/308 redirect or a retry on a fresh connection.
func (l *Lease) Body(r io.Reader) io.ReadCloser {
	return &fencedBody{lease: l, r: r}
}

type fencedBody struct {
	lease *Lease
	r     io.Reader
}

func (b *fencedBody) Read(p []byte) (int, error) {
	if _, err := b.lease.Token(); err != nil {
		return 0, err
	}
	n, err := b.r.Read(p)
	// A read that waited (a pipe, a slow source) may return after the loss: checked again,
	// and what it read dropped.
	if _, lost := b.lease.Token(); lost != nil {
		return 0, lost
	}
	return n, err
}

func (b *fencedBody) Close() error {
	if c, ok := b.r.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

type fencingTransport struct {
	lease *Lease
	base  http.RoundTripper
}

func (f *fencingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	token, err := f.lease.Token()
	if err != nil {
		if req.Body != nil {
			req.Body.Close() // a RoundTripper closes the body, also on errors
		}
		return nil, err
	}
	// Until the answer's head arrives, losing the lease cancels the request: a dial, a wait
	// for a connection or a slow upload must not carry the token out after the deadline.
	ctx, cancel := context.WithCancel(req.Context())
	out := req.Clone(ctx) // a RoundTripper must not modify the caller's request
	out.Header.Set("X-Fencing-Job", f.lease.job)
	out.Header.Set("X-Fencing-Token", token)
	var mu sync.Mutex
	answered, lostInFlight := false, false
	stop := make(chan struct{})
	go func() {
		select {
		case <-f.lease.ctx.Done():
			mu.Lock()
			if !answered {
				lostInFlight = true
				cancel()
			}
			mu.Unlock()
		case <-stop:
		}
	}()
	resp, err := f.base.RoundTrip(out)
	mu.Lock()
	answered = true
	lost := lostInFlight
	mu.Unlock()
	close(stop)
	if err != nil || lost {
		if resp != nil && resp.Body != nil {
			resp.Body.Close()
		}
		cancel()
		if lost {
			if lostErr, ok := f.lease.Err().(*LeaseLostError); ok {
				inFlight := *lostErr
				inFlight.InFlight = true
				err = &inFlight
			}
		}
		return nil, err
	}
	if resp.Body == nil || resp.Body == http.NoBody { // nothing to read: nothing to wait for
		cancel()
		return resp, nil
	}
	body := &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
	if w, ok := resp.Body.(io.Writer); ok { // a 101's upgraded connection is writable too
		resp.Body = &cancelOnCloseRW{cancelOnClose: body, Writer: w}
	} else {
		resp.Body = body
	}
	return resp, nil
}

// cancelOnClose ends a fenced request's context when its answer's body is closed.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// cancelOnCloseRW is cancelOnClose for a body that is also writable (an upgraded connection).
type cancelOnCloseRW struct {
	*cancelOnClose
	io.Writer
}
