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
import base64
import hashlib
import json
import os
import secrets
import socket
import sys
import threading
import time
import urllib.error
import urllib.request

# A grant's TTL is taken only from 100 ms to 24 h (as the other clients): anything else is no
# grant (a server that misbehaves, a proxy's, a mock's).
MIN_TTL_MS, MAX_TTL_MS = 100, 86_400_000


def step_key(job, step):
    """The Idempotency-Key of a job's step, the same for every holder of every generation
    (docs/protocol.md section 11; `fence idempotency-key --job JOB --step STEP` prints it): a
    successor redoing a step the previous holder's write already committed is answered the
    stored result instead of running it again."""
    digest = hashlib.sha256(b"fence-step-v1\0" + job.encode() + b"\0" + step.encode()).digest()
    return "fence-" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Lease:
    """One lease and its local deadline, measured on the monotonic clock from the moment
    the claim or renewal that granted it was *sent*, minus a safety margin."""

    def __init__(self, server, job, owner, ttl_ms, headers):
        self.server, self.job, self.owner, self.ttl_ms = server, job, owner, ttl_ms
        self.headers = headers
        self.key = secrets.token_urlsafe(32)  # 43 base64url characters: the proof it is ours
        self.held_ms = ttl_ms  # the TTL the deadline counts from: the smaller of granted and asked
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
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            answer = json.loads(raw)
        except ValueError:  # a gateway's 502 page, say: no problem body, and no grant
            answer = {}
        return status, answer if isinstance(answer, dict) else {}

    def _granted(self, sent, answer, generation=None):
        """Records the deadline and token of a 200's answer; False, recording nothing, when
        the answer is no grant: no whole-number generation (or not ``generation``, a
        renewal's: the claim's), or no TTL of 100 ms to 24 h."""
        ttl, gen, token = answer.get("ttl_ms"), answer.get("generation"), answer.get("token")
        if not _whole(ttl) or not MIN_TTL_MS <= ttl <= MAX_TTL_MS or not _whole(gen):
            return False
        if generation is not None and gen != generation:
            return False
        # Never counted from more than was asked: a server (or something posing as one) that
        # grants more cannot move the deadline, nor the renewals, past what was asked to hold.
        held = min(ttl, self.ttl_ms)
        margin = max(held // 10, 50) / 1000.0
        with self.lock:
            if self.lost.is_set() or (self.token is not None and time.monotonic() >= self.deadline):
                self.lost.set()  # answered too late: the loss is final, never taken back
                return True
            self.generation = gen
            # A signing server hands out a token string; send it exactly as given.
            self.token = token if isinstance(token, str) and token else str(gen)
            self.held_ms = held
            self.deadline = sent + held / 1000.0 - margin
        return True

    def claim(self):
        body = {"owner": self.owner, "lease_key": self.key, "ttl_ms": self.ttl_ms}
        sent = time.monotonic()
        status, answer = self._post("claim", body, timeout=self.ttl_ms / 1000.0)
        if status == 200 and not self._granted(sent, answer):
            return None, answer  # answered 200 without a grant
        return status, answer

    def current_token(self):
        """The token to send now and the seconds left to the deadline, or (None, 0) once the
        lease cannot be trusted."""
        with self.lock:
            left = self.deadline - time.monotonic()
            if self.lost.is_set() or left <= 0:
                self.lost.set()
                return None, 0
            return self.token, left

    def _interval(self):
        """A third of the TTL held, but never later than halfway to the deadline (a fixed
        margin may take most of a grant the server cut short)."""
        with self.lock:
            held = self.held_ms
        usable = held - max(held // 10, 50)
        return max(min(held / 3, usable / 2), 10) / 1000.0

    def keep(self):
        """Renews every third of the TTL held until lost or released; again after a twelfth
        when a renewal got no answer (or one that is no grant)."""
        every = self._interval()
        while not self.lost.is_set():
            time.sleep(max(every, 0.01))
            while self.paused.is_set():
                time.sleep(0.01)  # the whole worker is stalled: nobody renews
            with self.lock:
                left = self.deadline - time.monotonic()
                generation = self.generation
            if left <= 0:
                self.lost.set()
                return
            interval = self._interval()
            body = {"owner": self.owner, "generation": generation,
                    "lease_key": self.key, "ttl_ms": self.ttl_ms}
            # Each attempt has its own time (as the Rust client): a renewal interval, or half
            # the time left when longer, never past the deadline. A connection that takes the
            # request and never answers is then abandoned and the renewal asked again, not
            # the lease lost.
            attempt = min(left, max(interval, left / 2))
            sent = time.monotonic()
            try:
                status, answer = self._post("renew", body, timeout=attempt)
            except (OSError, ValueError):
                every = interval / 4  # no answer: the deadline stands; ask again soon
                continue
            if status == 200 and self._granted(sent, answer, generation):
                every = self._interval()
            elif status in (403, 409, 410):
                self.lost.set()  # someone else holds it now, or it is done
                return
            else:
                # A 200 that is no grant (another generation, a TTL out of range) or another
                # answer: the deadline stands; ask again soon.
                every = interval / 4

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
    if status is None:
        print(f"worker: the claim of {args.job} was answered 200 without a grant", file=sys.stderr)
        return 1
    if status != 200:
        print(f"worker: no lease on {args.job}: {answer.get('detail', status)}", file=sys.stderr)
        return 3
    print(f"worker: holding {args.job} at generation {lease.generation}", file=sys.stderr)
    threading.Thread(target=lease.keep, daemon=True).start()
    for n in range(1, args.writes + 1):
        token, left = lease.current_token()
        if token is None:
            print("worker: lease lost; not sending", file=sys.stderr)
            return 75
        if n == 2 and args.stall_before_send > 0:
            lease.paused.set()  # a whole-process pause, renewals included
            time.sleep(args.stall_before_send)
            lease.paused.clear()
        # Key and body are the same whoever holds the job: never the generation or the owner.
        req = urllib.request.Request(
            args.destination, data=f"write {n}".encode(), method="POST",
            headers={"X-Fencing-Job": args.job, "X-Fencing-Token": token,
                     "Idempotency-Key": step_key(args.job, f"write-{n}")})
        try:
            # Cut at the deadline as it stood when the token was taken (each socket operation
            # gets the time left then): a write still unanswered by then is of unknown outcome.
            with urllib.request.urlopen(req, timeout=left) as resp:
                print(f"WRITE {n} {resp.status}")
        except urllib.error.HTTPError as e:
            try:
                problem = json.load(e)
            except ValueError:
                problem = {}
            print(f"WRITE {n} {e.code} {problem.get('type') if isinstance(problem, dict) else None}")
            if e.code == 409:
                return 75  # a newer holder exists: stop, do not complete
            return 1
        except OSError as e:  # a timeout, a reset: it may have landed; neither complete nor release
            print(f"WRITE {n} unknown ({e})")
            return 1
    status, answer = lease.finish("complete")
    print(f"worker: done; the job is {answer.get('state', status)}", file=sys.stderr)
    return 0 if status == 200 else 75


if __name__ == "__main__":
    sys.exit(main())
