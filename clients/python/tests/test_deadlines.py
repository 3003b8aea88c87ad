"""Every call ends at its timeout, whatever the server does: urllib bounds each socket
operation, and a server that trickles its answer a header line at a time must not hold a
claim, a release or a completion past the timeout the caller gave."""

import socket
import threading
import time

import pytest

from fence_client import Client, ServerUnreachable


def trickling_server():
    """A listener that answers every connection with a status line, then one header line
    every 0.2 s, never ending the head; stops when the returned event is set."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def answer(conn):
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not stop.wait(0.2):
                    conn.sendall(b"X-Slow: a\r\n")
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


def test_a_server_that_trickles_its_answer_cannot_hold_a_call_past_its_timeout():
    listener, stop = trickling_server()
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
