"""A scripted lease server for answers the real one never gives (a renewal held open forever,
a gateway's 408, a crowded server's 429, a TTL above what was asked, an echo of the request)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

# What a script returns for a request: (status, headers, body), or None to hold it open
# until the server is closed (a connection that takes the request and never answers).
Reply = Optional[Tuple[int, Dict[str, str], bytes]]


def grant(body: Dict[str, Any], ttl_ms: Optional[int] = None, generation: int = 1) -> Reply:
    """A 200 granting ``generation`` for the TTL asked (or ``ttl_ms``)."""
    ttl = ttl_ms if ttl_ms is not None else body.get("ttl_ms", 1000)
    answer = {"job": "j", "owner": body.get("owner"), "generation": generation,
              "state": "held", "ttl_ms": ttl, "expires_at_ms": int(time.time() * 1000) + ttl}
    return 200, {"content-type": "application/json"}, json.dumps(answer).encode()


def problem(status: int, kind: str, headers: Optional[Dict[str, str]] = None) -> Reply:
    doc = {"type": f"urn:fence:{kind}", "title": kind, "status": status, "detail": kind}
    return status, {"content-type": "application/problem+json", **(headers or {})}, \
        json.dumps(doc).encode()


class FakeServer:
    """Answers each request with ``script(action, body, n)``: ``action`` the path's last part
    (claim, renew, release...), ``n`` how many requests of that action came before."""

    def __init__(self, script: Callable[[str, Dict[str, Any], int], Reply]) -> None:
        self.seen: List[Tuple[str, Dict[str, Any]]] = []
        self.closed = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                body = json.loads(raw or b"{}")
                action = self.path.split("?")[0].rsplit("/", 1)[-1]
                n = sum(1 for a, _ in outer.seen if a == action)
                outer.seen.append((action, body))
                reply = script(action, body, n)
                if reply is None:
                    outer.closed.wait()
                    return
                status, headers, payload = reply
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, action: str) -> int:
        return sum(1 for a, _ in self.seen if a == action)

    def close(self) -> None:
        self.closed.set()
        self.server.shutdown()
        self.server.server_close()
