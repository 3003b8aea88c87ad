"""Fixtures: the real `fence server` and `fence proxy` as child processes on ephemeral loopback
ports, an upstream that records what reached it, raw HTTP for requests that must bypass the
client."""

from __future__ import annotations

import http.server
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest

CLIENT_DIR = Path(__file__).resolve().parent.parent


def fence_bin() -> str:
    """FENCE_BIN, else ../../target/debug/fence from the client directory; missing is a failure."""
    path = Path(os.environ.get("FENCE_BIN") or CLIENT_DIR / ".." / ".." / "target" / "debug" / "fence")
    path = path.resolve()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"the fence binary is missing at {path}: build it (cargo build) or set FENCE_BIN",
                    pytrace=False)
    return str(path)


class Proc:
    """`fence ARGS...` until it logs its ready line; its address(es) parsed from that line."""

    def __init__(self, args: List[str], env: Optional[Dict[str, str]] = None) -> None:
        self.args = args
        self.log: List[str] = []
        self.p = subprocess.Popen([fence_bin(), *args], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RUST_LOG": "info", **(env or {})})
        lines: "queue.Queue[str]" = queue.Queue()

        def drain() -> None:
            assert self.p.stderr is not None
            for line in self.p.stderr:
                self.log.append(line.rstrip())
                lines.put(line)

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + 15
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.kill()
                raise AssertionError(f"fence {' '.join(args)} did not get ready:\n" + "\n".join(self.log))
            if " ready " in line:
                self.addr = re.search(r"listen=(\S+)", line).group(1)  # type: ignore[union-attr]
                admin = re.search(r"admin=(\S+)", line)
                self.admin = admin.group(1) if admin else None
                return

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
            self.p.kill()
        self.p.wait(timeout=10)


@dataclass
class Seen:
    method: str
    path: str
    job: Optional[str]
    token: Optional[str]
    body: str


class Upstream:
    """The service behind the proxy: answers 200 and records every request that reached it."""

    def __init__(self) -> None:
        self.seen: List[Seen] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length).decode()
                outer.seen.append(Seen(self.command, self.path, self.headers.get("x-fencing-job"),
                                       self.headers.get("x-fencing-token"), body))
                self.send_response(200)
                self.send_header("content-length", "3")
                self.end_headers()
                self.wfile.write(b"ok\n")

            do_PUT = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Stack:
    server: Proc
    server_url: str
    proxy: Optional[Proc] = None
    proxy_url: str = ""
    upstream: Optional[Upstream] = None
    keys: Optional[Path] = None
    procs: List[Proc] = field(default_factory=list)


@pytest.fixture
def stack(tmp_path: Path):
    """`stack(signing=False, proxy=True, server_args=[])`: a lease server (and a proxy in front
    of a recording upstream), each with its own data directory, killed at the end."""
    made: List[Any] = []
    counter = [0]

    def make(signing: bool = False, proxy: bool = True, server_args: Optional[List[str]] = None,
             scheme: str = "http") -> Stack:
        counter[0] += 1
        base = tmp_path / f"stack{counter[0]}"
        args = ["server", "--listen", "127.0.0.1:0", "--data-dir", str(base / "leases")]
        keys = None
        if signing:
            keys = base / "keys"
            subprocess.run([fence_bin(), "keygen", "--out", str(keys)], check=True,
                           capture_output=True)
            args += ["--signing-key", str(keys / "fence-signing.pem")]
        server = Proc(args + (server_args or []))
        made.append(server)
        s = Stack(server=server, server_url=f"{scheme}://{server.addr}", keys=keys)
        if proxy:
            s.upstream = Upstream()
            made.append(s.upstream)
            pargs = ["proxy", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                     "--upstream", s.upstream.url, "--data-dir", str(base / "sink")]
            if keys is not None:
                pargs += ["--verify-key", str(keys / "fence-verify.pem")]
            s.proxy = Proc(pargs)
            made.append(s.proxy)
            s.proxy_url = f"http://{s.proxy.addr}"
        return s

    yield make
    for thing in reversed(made):
        if isinstance(thing, Proc):
            thing.kill()
        else:
            thing.close()


def raw(method: str, url: str, headers: Optional[Dict[str, str]] = None,
        body: Optional[bytes] = None) -> Tuple[int, Any]:
    """One request with urllib, bypassing the client: (status, decoded JSON or text)."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as response:
            status, payload = response.status, response.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode()


def wait_for(what: str, within: float, done: Any) -> None:
    """Polls ``done()`` every 10 ms; fails naming ``what`` if it does not hold within ``within``."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, f"not within {within} s: {what}"
        threading.Event().wait(0.01)
