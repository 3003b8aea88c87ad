"""The seed's worked example with the real server and proxy: A claims generation 7, is paused
past its lease, B claims generation 8 and writes, A's late write is refused 409 at the proxy,
A's completion is refused. Once with the thread client and `requests`, once with the asyncio
twin and `httpx`."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import requests

from conftest import raw, wait_for
from fence_client import (AsyncClient, Client, LeaseLost, LeaseRefused, ServerUnreachable,
                          StaleToken)
from fence_client.httpx import FenceAuth as HttpxAuth
from fence_client.httpx import raise_for_problem
from fence_client.requests import FenceAuth

JOB = "invoice-42"


def pause_renewals(lease, monkeypatch) -> threading.Event:
    """A whole-keeper pause (GC, SIGSTOP): from now on no renewal reaches the server."""
    resume = threading.Event()

    def paused(timeout: float):
        resume.wait(30)
        raise ServerUnreachable("the worker was paused")

    monkeypatch.setattr(lease, "_send_renew", paused)
    return resume


def six_earlier_runs(server_url: str) -> None:
    earlier = Client(server_url, owner="earlier-runs", ttl=1.0)
    for n in range(1, 6):
        with earlier.claim(JOB, on_success="release") as lease:
            assert lease.generation == n
    with pytest.raises(RuntimeError):
        with earlier.claim(JOB) as lease:  # completes on a clean exit, releases on an exception
            assert lease.generation == 6
            raise RuntimeError("the job failed")
    record = earlier.status(JOB)
    assert (record["state"], record["generation"]) == ("free", 6), record


def test_worked_example_threads_and_requests(stack, monkeypatch):
    s = stack(signing=True)
    ledger = f"{s.proxy_url}/ledger"
    six_earlier_runs(s.server_url)

    a = Client(s.server_url, owner="worker-a", ttl=2.0)
    lease_a = a.claim(JOB)
    assert lease_a.generation == 7
    first = lease_a.token
    assert first.startswith("7.") and len(first.split(".")) == 3, first  # signed
    http = requests.Session()
    assert http.post(ledger, data="A: charge 10 EUR", auth=FenceAuth(lease_a)).status_code == 200
    # Each renewal is signed anew, and the newest token is the one sent.
    wait_for("a renewal brings a new signed token", 2.0, lambda: lease_a.token != first)
    assert http.post(ledger, data="A: note", auth=FenceAuth(lease_a)).status_code == 200
    assert s.upstream.seen[-1].token == lease_a.token != first
    assert s.upstream.seen[-1].job == JOB

    late_token = lease_a.token  # A decides to write once more with the token it holds...
    resume = pause_renewals(lease_a, monkeypatch)  # ...and stalls before the write goes out
    try:
        assert lease_a.lost.wait(3.0), "A's lost signal fires"
        lost_at_ms = time.time() * 1000
        assert lost_at_ms < lease_a.expires_at_ms, "before the server's expiry"
        assert "deadline" in (lease_a.loss_reason or "")
        sent = len(s.upstream.seen)
        with pytest.raises(LeaseLost):
            http.post(ledger, data="A: refund 10 EUR", auth=FenceAuth(lease_a))
        assert len(s.upstream.seen) == sent, "the adapter sent nothing after the loss"

        b = Client(s.server_url, owner="worker-b", ttl=5.0)
        with b.claim(JOB, wait=5.0) as lease_b:  # granted at the server-side expiry
            assert lease_b.generation == 8
            r = http.post(ledger, data="B: charge 10 EUR", auth=FenceAuth(lease_b))
            assert r.status_code == 200
            # A's held-up write arrives, sent raw (no client check): the proxy refuses it.
            status, problem = raw("POST", ledger, {"X-Fencing-Job": JOB,
                                                   "X-Fencing-Token": late_token},
                                  b"A: refund 10 EUR")
            assert status == 409, problem
            assert problem["type"] == "urn:fence:stale-token", problem
            assert str(problem["highest"]).split(".")[0] == "8", problem
            with pytest.raises(LeaseRefused) as refused:
                lease_a.complete()
            assert (refused.value.status, refused.value.type) == (409, "urn:fence:lease-lost")
            assert refused.value.owner == "worker-b" and refused.value.generation == 8
            assert isinstance(refused.value, LeaseLost)
        assert b.status(JOB)["state"] == "completed"
    finally:
        resume.set()
    assert [(w.token.split(".")[0], w.body) for w in s.upstream.seen] == [
        ("7", "A: charge 10 EUR"), ("7", "A: note"), ("8", "B: charge 10 EUR")]


def test_worked_example_asyncio_and_httpx(stack, monkeypatch):
    s = stack(signing=False)
    ledger = f"{s.proxy_url}/ledger"
    six_earlier_runs(s.server_url)

    async def scenario() -> None:
        a = AsyncClient(s.server_url, owner="worker-a", ttl=2.0)
        async with httpx.AsyncClient() as http:
            lease_a = await a.claim(JOB)
            assert (lease_a.generation, lease_a.token) == (7, "7")  # unsigned: the generation
            r = await http.post(ledger, content="A: charge 10 EUR", auth=HttpxAuth(lease_a))
            assert r.status_code == 200
            await asyncio.sleep(2.2)  # longer than the TTL: the keeper task renews
            assert not lease_a.lost.is_set()
            late_token = lease_a.token
            resume = pause_renewals(lease_a, monkeypatch)
            try:
                await asyncio.wait_for(lease_a.lost.wait(), 3.0)
                assert time.time() * 1000 < lease_a.expires_at_ms, "before the server's expiry"
                sent = len(s.upstream.seen)
                with pytest.raises(LeaseLost):
                    await http.post(ledger, content="A: refund", auth=HttpxAuth(lease_a))
                assert len(s.upstream.seen) == sent

                b = AsyncClient(s.server_url, owner="worker-b", ttl=5.0)
                async with b.claim(JOB, wait=5.0) as lease_b:
                    assert lease_b.generation == 8
                    r = await http.post(ledger, content="B: charge 10 EUR",
                                        auth=HttpxAuth(lease_b))
                    assert r.status_code == 200
                    r = await http.post(ledger, content="A: refund",
                                        headers={"X-Fencing-Job": JOB,
                                                 "X-Fencing-Token": late_token})
                    with pytest.raises(StaleToken) as stale:
                        raise_for_problem(r)
                    assert (stale.value.status, stale.value.highest) == (409, 8)
                    with pytest.raises(LeaseRefused) as refused:
                        await lease_a.complete()
                    assert refused.value.type == "urn:fence:lease-lost"
                assert (await b.status(JOB))["state"] == "completed"
            finally:
                resume.set()

    asyncio.run(scenario())
    assert [(w.token, w.body) for w in s.upstream.seen] == [
        ("7", "A: charge 10 EUR"), ("8", "B: charge 10 EUR")]
