"""Every call ends at its timeout, whatever the server does: urllib bounds each socket
operation, and a server that trickles its answer (its head, or an error's body) must not hold
a claim, a release or a completion past the timeout the caller gave; nor may an endless
answer fill the worker's memory."""

import socket
import threading
import time

import pytest

from fence_client import Client, ProtocolError, ServerUnreachable
from fence_client._wire import MAX_ANSWER

TRICKLED_HEAD = (b"HTTP/1.1 200 OK\r\n", b"X-Slow: a\r\n")
TRICKLED_ERROR = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\n"
                  b"Content-Length: 100000\r\n\r\n", b" ")


def serving(opening, then):
    """A listener that answers every connection with ``opening``, then ``then`` every 0.2 s
    until the returned event is set."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def answer(conn):
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(opening)
                while then and not stop.wait(0.2):
                    conn.sendall(then)
                # Closed with the request's body still unread (urllib may send it after the
                # head, past the one recv above), the socket would answer with a reset, and
                # the client would lose what it had not read yet: the write side ends, and
                # what comes is read until the client closes.
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(5.0)
                while conn.recv(65536):
                    pass
            except OSError:
                pass

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener, stop


@pytest.mark.parametrize("opening,then", [TRICKLED_HEAD, TRICKLED_ERROR], ids=["head", "error"])
def test_a_server_that_trickles_its_answer_cannot_hold_a_call_past_its_timeout(opening, then):
    listener, stop = serving(opening, then)
    port = listener.getsockname()[1]
    try:
        # A claim is bounded by the lease's usable time (TTL less the margin: 1.8 s here).
        client = Client(f"http://127.0.0.1:{port}", owner="w", ttl=2.0, timeout=1.0)
        began = time.monotonic()
        with pytest.raises(ServerUnreachable) as unreachable:
            client.claim("trickled")
        took = time.monotonic() - began
        assert took < 3.5, f"the claim took {took:.1f} s against a trickling server"
        assert "no whole answer within" in str(unreachable.value)
    finally:
        stop.set()
        listener.close()


def test_an_answer_larger_than_the_client_reads_is_refused():
    size = 4 * MAX_ANSWER
    listener, stop = serving(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % size + b" " * size, None)
    port = listener.getsockname()[1]
    try:
        client = Client(f"http://127.0.0.1:{port}", owner="w", ttl=5.0, timeout=5.0)
        with pytest.raises(ProtocolError, match="larger than"):
            client.claim("endless")
    finally:
        stop.set()
        listener.close()
