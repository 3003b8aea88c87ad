#!/usr/bin/env python3
"""A fence worker in Python, standard library only, written from docs/protocol.md
("Writing a worker in any language").

It claims a job from the lease server, keeps the lease renewed in a background thread,
sends each write to the destination (a fenced service or `fence proxy`) with
X-Fencing-Job and X-Fencing-Token, stops the moment it can no longer be sure it holds
the lease, and completes the job at the end.

    python3 worker.py --server http://127.0.0.1:7700 --destination http://127.0.0.1:7800/charges \
        --job invoice-42 --writes 3

Exit codes: 0 done (job completed), 3 the lease could not be had, 75 the lease was lost
(no write was sent after that moment: a destination answering 409 means a newer holder
wrote first), 1 anything else.

--stall-before-send S pauses the whole worker (renewals too) for S seconds between
deciding to send a write and sending it, the way a GC pause or SIGSTOP would: the write
then reaches the destination with a stale token, and a fenced destination refuses it.
"""

import argparse
import json
import os
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request


class Lease:
    """One lease and its local deadline, measured on the monotonic clock from the moment
    the claim or renewal that granted it was *sent*, minus a safety margin."""

    def __init__(self, server, job, owner, ttl_ms, headers):
        self.server, self.job, self.owner, self.ttl_ms = server, job, owner, ttl_ms
        self.headers = headers
        self.key = secrets.token_urlsafe(32)  # 43 base64url characters: the proof it is ours
        self.margin = max(ttl_ms // 10, 50) / 1000.0
        self.lock = threading.Lock()
        self.generation = None
        self.token = None
        self.deadline = 0.0
        self.lost = threading.Event()
        self.paused = threading.Event()

    def _post(self, action, body, timeout):
        url = f"{self.server}/v1/leases/{urllib.request.quote(self.job, safe='')}/{action}"
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), method="POST",
            headers={"content-type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.load(e)
            except ValueError:  # a gateway's 502 page, say: no problem body
                return e.code, {}

    def _granted(self, sent, answer):
        with self.lock:
            if self.lost.is_set() or (self.token is not None and time.monotonic() >= self.deadline):
                self.lost.set()  # answered too late: the loss is final, never taken back
                return
            self.generation = answer["generation"]
            # A signing server hands out a token string; send it exactly as given.
            self.token = answer.get("token") or str(answer["generation"])
            self.deadline = sent + answer["ttl_ms"] / 1000.0 - self.margin

    def claim(self):
        body = {"owner": self.owner, "lease_key": self.key, "ttl_ms": self.ttl_ms}
        sent = time.monotonic()
        status, answer = self._post("claim", body, timeout=self.ttl_ms / 1000.0)
        if status != 200:
            return status, answer
        self._granted(sent, answer)
        return status, answer

    def current_token(self):
        """The token to send now, or None once the lease cannot be trusted."""
        with self.lock:
            if self.lost.is_set() or time.monotonic() >= self.deadline:
                self.lost.set()
                return None
            return self.token

    def keep(self):
        """Renews every third of the TTL until lost or released."""
        while not self.lost.is_set():
            time.sleep(self.ttl_ms / 3000.0)
            while self.paused.is_set():
                time.sleep(0.01)  # the whole worker is stalled: nobody renews
            with self.lock:
                left = self.deadline - time.monotonic()
            if left <= 0:
                self.lost.set()
                return
            body = {"owner": self.owner, "generation": self.generation,
                    "lease_key": self.key, "ttl_ms": self.ttl_ms}
            sent = time.monotonic()
            try:
                status, answer = self._post("renew", body, timeout=left)
            except (OSError, ValueError):
                continue  # no (readable) answer: the deadline stands; try again
            if status == 200:
                self._granted(sent, answer)
            elif status in (403, 409, 410):
                self.lost.set()  # someone else holds it now, or it is done
                return

    def finish(self, action):
        body = {"owner": self.owner, "generation": self.generation, "lease_key": self.key}
        return self._post(action, body, timeout=5)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--destination", required=True, help="URL the writes are POSTed to")
    p.add_argument("--job", required=True)
    p.add_argument("--ttl-ms", type=int, default=30_000)
    p.add_argument("--writes", type=int, default=3)
    p.add_argument("--auth-token-file", help="bearer secret for a server with --auth-file")
    p.add_argument("--stall-before-send", type=float, default=0.0,
                   help="stall the whole worker this long before the second write")
    args = p.parse_args()
    headers = {}
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            headers["authorization"] = "Bearer " + f.read().strip()
    owner = f"{socket.gethostname()}-{os.getpid()}-py"
    lease = Lease(args.server, args.job, owner, args.ttl_ms, headers)
    status, answer = lease.claim()
    if status != 200:
        print(f"worker: no lease on {args.job}: {answer.get('detail', status)}", file=sys.stderr)
        return 3
    print(f"worker: holding {args.job} at generation {lease.generation}", file=sys.stderr)
    threading.Thread(target=lease.keep, daemon=True).start()
    for n in range(1, args.writes + 1):
        token = lease.current_token()
        if token is None:
            print("worker: lease lost; not sending", file=sys.stderr)
            return 75
        if n == 2 and args.stall_before_send > 0:
            lease.paused.set()  # a whole-process pause, renewals included
            time.sleep(args.stall_before_send)
            lease.paused.clear()
        req = urllib.request.Request(
            args.destination, data=f"write {n}".encode(), method="POST",
            headers={"X-Fencing-Job": args.job, "X-Fencing-Token": token,
                     "Idempotency-Key": f"{args.job}-{lease.generation}-{n}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                print(f"WRITE {n} {resp.status}")
        except urllib.error.HTTPError as e:
            problem = json.load(e)
            print(f"WRITE {n} {e.code} {problem.get('type')}")
            if e.code == 409:
                return 75  # a newer holder exists: stop, do not complete
            return 1
    status, answer = lease.finish("complete")
    print(f"worker: done; the job is {answer.get('state', status)}", file=sys.stderr)
    return 0 if status == 200 else 75


if __name__ == "__main__":
    sys.exit(main())
