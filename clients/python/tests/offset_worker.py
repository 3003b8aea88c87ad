"""A worker run by test_faults.py under libfaketime, its wall clock an hour off: it claims,
writes through the proxy, keeps its lease past one TTL by renewing, then stops renewing and
reports when its lost signal fires. One JSON line per event on stdout.

Under libfaketime 0.9.10 with FAKETIME_DONT_FAKE_MONOTONIC=1, time.sleep (clock_nanosleep on
the monotonic clock) fails with EINVAL, so this script waits with Event.wait, as the client's
keeper does.
"""

import json
import sys
import threading
import time

import requests

from fence_client import Client, LeaseLost, ServerUnreachable
from fence_client.requests import FenceAuth


def say(event, **kv):
    print(json.dumps({"event": event, **kv}), flush=True)


def main():
    server, ledger, job = sys.argv[1:4]
    lease = Client(server, owner=f"offset-{job}", ttl=2.0).claim(job)
    say("claimed", wall=time.time(), generation=lease.generation)
    http = requests.Session()
    say("write", status=http.post(ledger, data="write 1", auth=FenceAuth(lease)).status_code)
    threading.Event().wait(2.5)  # past the TTL: only renewals keep the lease
    say("held", held=not lease.is_lost())
    say("write", status=http.post(ledger, data="write 2", auth=FenceAuth(lease)).status_code)

    def paused(timeout):
        threading.Event().wait(30)
        raise ServerUnreachable("paused")

    lease._send_renew = paused  # no renewal reaches the server from now on
    fired = lease.lost.wait(5.0)
    say("lost" if fired else "not-lost", expires_at_ms=lease.expires_at_ms,
        reason=lease.loss_reason)
    try:
        http.post(ledger, data="write 3", auth=FenceAuth(lease))
        say("sent-after-loss")
    except LeaseLost:
        say("refused")


if __name__ == "__main__":
    main()
