"""Faults: a worker whose wall clock is an hour off (libfaketime), and a lease server that stops
answering (SIGSTOP). In both the lost signal must fire before the server's expiry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import CLIENT_DIR
from fence_client import AsyncClient, Client, LeaseLost
from fence_client.httpx import FenceAuth

LIBFAKETIME = [Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"),
               Path("/usr/lib/faketime/libfaketime.so.1")]


def test_a_worker_whose_wall_clock_is_an_hour_off(stack):
    lib = next((p for p in LIBFAKETIME if p.exists()), None)
    if lib is None:
        pytest.fail("libfaketime is missing: apt-get install faketime", pytrace=False)
    s = stack()
    children = {}
    for offset in ("+1h", "-1h"):
        env = {**os.environ, "LD_PRELOAD": str(lib), "FAKETIME": offset,
               # The wall clock is off, the monotonic clock is not (as on a machine whose
               # clock was set wrong); libfaketime 0.9.10 also hangs timed waits otherwise.
               "FAKETIME_DONT_FAKE_MONOTONIC": "1",
               "PYTHONPATH": str(CLIENT_DIR / "src")}
        children[offset] = subprocess.Popen(
            [sys.executable, str(CLIENT_DIR / "tests" / "offset_worker.py"), s.server_url,
             f"{s.proxy_url}/ledger", f"offset{offset}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    events = {offset: [] for offset in children}

    def read(offset: str) -> None:
        for line in children[offset].stdout:  # type: ignore[union-attr]
            events[offset].append((time.time() * 1000, json.loads(line)))

    readers = [threading.Thread(target=read, args=(o,)) for o in children]
    for r in readers:
        r.start()
    try:
        for offset, child in children.items():
            child.wait(timeout=30)
    finally:
        for child in children.values():  # a worker that missed its loss would run on
            if child.poll() is None:
                child.kill()
                child.wait()
    for r in readers:
        r.join(10)
    for offset, child in children.items():
        said = [e for _, e in events[offset]]
        assert child.returncode == 0, (offset, said, child.stderr.read())  # type: ignore[union-attr]
        by = {e["event"]: (at, e) for at, e in events[offset]}
        at, claimed = by["claimed"]
        skew = claimed["wall"] - at / 1000
        expected = 3600 if offset == "+1h" else -3600
        assert abs(skew - expected) < 60, f"{offset}: faketime did not take: skew {skew} s"
        assert [e["status"] for e in said if e["event"] == "write"] == [200, 200], (offset, said)
        assert by["held"][1]["held"], (offset, said)
        assert "lost" in by, f"{offset}: the lost signal did not fire: {said}"
        at, lost = by["lost"]
        assert at < lost["expires_at_ms"], f"{offset}: lost after the server's expiry: {said}"
        assert "refused" in by, (offset, said)
        record = Client(s.server_url).status(f"offset{offset}")
        assert record["generation"] == 1, record
    assert sorted(w.body for w in s.upstream.seen) == ["write 1", "write 1", "write 2", "write 2"]


def test_a_server_that_stops_answering(stack):
    s = stack()
    sync_client = Client(s.server_url, owner="sync", ttl=2.0)
    async_client = AsyncClient(s.server_url, owner="async", ttl=2.0)

    async def scenario() -> None:
        sync_lease = await asyncio.to_thread(sync_client.claim, "stopped-sync")
        async_lease = await async_client.claim("stopped-async")
        await asyncio.sleep(2.2)  # past the TTL: renewals keep both
        for lease in (sync_lease, async_lease):
            assert not lease.is_lost(), lease
        s.server.signal(signal.SIGSTOP)
        stopped_at = time.time() * 1000
        try:
            async def lost_at(wait) -> float:
                fired = await wait
                assert fired, "the lost signal fired"
                return time.time() * 1000

            sync_at, async_at = await asyncio.gather(
                lost_at(asyncio.to_thread(sync_lease.lost.wait, 4.0)),
                lost_at(asyncio.wait_for(async_lease.lost.wait(), 4.0)))
            for lease, at in ((sync_lease, sync_at), (async_lease, async_at)):
                assert stopped_at < at < lease.expires_at_ms, (lease, stopped_at, at,
                                                               lease.expires_at_ms)
                assert "deadline" in (lease.loss_reason or ""), lease.loss_reason
            with pytest.raises(LeaseLost):
                httpx.post(f"{s.proxy_url}/ledger", content="late", auth=FenceAuth(sync_lease))
            with pytest.raises(LeaseLost):
                async_lease.headers()
        finally:
            s.server.signal(signal.SIGCONT)

    asyncio.run(scenario())
    assert s.upstream.seen == []
