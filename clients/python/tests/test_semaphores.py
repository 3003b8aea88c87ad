"""Fenced semaphores (contract section 15): N slots, each a lease of its own on the job
`<resource>#<slot>`. Racing claimers, a completed slot (released), another number of slots, a
stale slot holder, a claim that waits for a slot, and names and sizes refused before sending."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import raw
from fence_client import (AsyncClient, Client, InvalidJobId, LeaseHeld, LeaseLost, LeaseRefused,
                          LockDelay, ProblemError, SemaphoreSize, ServerUnreachable)
from fence_client._wire import monotonic
from fence_client.requests import FenceAuth


def pause_renewals(lease, monkeypatch) -> threading.Event:
    """A whole-keeper pause (GC, SIGSTOP): from now on no renewal reaches the server."""
    resume = threading.Event()

    def paused(timeout: float):
        resume.wait(30)
        raise ServerUnreachable("the worker was paused")

    monkeypatch.setattr(lease, "_send_renew", paused)
    return resume


def race(clients, resource: str, slots: int):
    """Every client claims a slot at once; (leases, refusals) in client order."""
    barrier = threading.Barrier(len(clients))

    def one(client):
        barrier.wait(5)
        try:
            return client.claim_slot(resource, slots)
        except LeaseHeld as e:
            return e

    with ThreadPoolExecutor(len(clients)) as pool:
        outcomes = list(pool.map(one, clients))
    return ([o for o in outcomes if not isinstance(o, Exception)],
            [o for o in outcomes if isinstance(o, Exception)])


def test_three_racing_claimers_of_two_slots(stack):
    s = stack(proxy=False)
    clients = [Client(s.server_url, owner=f"racer-{n}", ttl=5.0) for n in range(3)]
    leases, refused = race(clients, "res", 2)
    assert len(leases) == 2 and len(refused) == 1, (leases, refused)
    assert sorted(lease.job for lease in leases) == ["res#1", "res#2"]
    for lease in leases:
        assert lease.resource == "res" and lease.job == f"res#{lease.slot}", lease
        assert lease.generation == 1 and lease.headers()["X-Fencing-Job"] == lease.job
        record = clients[0].status(lease.job)
        assert (record["state"], record["owner"]) == ("held", lease.owner), record
    e = refused[0]
    assert (e.status, e.type) == (409, "urn:fence:lease-held") and not isinstance(e, LockDelay)
    assert e.job in ("res#1", "res#2") and e.owner in {lease.owner for lease in leases}
    assert 0 < e.expires_in_ms <= 5000, e.problem
    # A plain lease has no resource and no slot; a plain claim of a slot's job is refused.
    plain = clients[0].claim("plain-job")
    assert (plain.resource, plain.slot) == (None, None)
    plain.release()
    with pytest.raises(ProblemError) as reserved:
        clients[0].claim("res#3")
    assert (reserved.value.status, reserved.value.type) == (400, "urn:fence:bad-request")
    for lease in leases:
        assert lease.release()["state"] == "free"

    async def from_asyncio() -> None:
        aclients = [AsyncClient(s.server_url, owner=f"async-{n}", ttl=5.0) for n in range(3)]
        outcomes = await asyncio.gather(*(c.claim_slot("ares", 2) for c in aclients),
                                        return_exceptions=True)
        won = [o for o in outcomes if not isinstance(o, BaseException)]
        lost = [o for o in outcomes if isinstance(o, BaseException)]
        assert sorted((a.job, a.resource, a.slot) for a in won) == [("ares#1", "ares", 1),
                                                                    ("ares#2", "ares", 2)]
        assert len(lost) == 1 and isinstance(lost[0], LeaseHeld), lost
        for a in won:
            await a.release()
        async with aclients[2].claim_slot("ares", 2) as held:  # released on exit
            assert held.slot == 1
        assert (await aclients[2].status("ares#1"))["state"] == "free"

    asyncio.run(from_asyncio())


def test_completing_a_slot_releases_it(stack):
    """complete() on a slot is sent as for any lease; the server frees the slot (state free)
    and the next claimer gets the same slot job at the next generation. A stale holder's
    complete is 409 lease-lost."""
    s = stack(proxy=False)
    first = Client(s.server_url, owner="slot-first", ttl=5.0)
    second = Client(s.server_url, owner="slot-second", ttl=5.0)
    lease = first.claim_slot("once", 1)
    assert (lease.job, lease.slot, lease.generation) == ("once#1", 1, 1)
    record = lease.complete()
    assert record["state"] == "free", record
    assert lease.is_lost() and lease.loss_reason == "the lease was released, completed or abandoned"
    assert first.status("once#1")["state"] == "free"
    again = second.claim_slot("once", 1)
    assert (again.job, again.slot, again.generation) == ("once#1", 1, 2)
    assert again.owner == "slot-second"
    with pytest.raises(LeaseRefused) as stale:  # generation 1 is no longer the holder
        lease.complete()
    assert (stale.value.status, stale.value.type) == (409, "urn:fence:lease-lost")
    assert again.complete()["state"] == "free"

    async def from_asyncio() -> None:
        afirst = AsyncClient(s.server_url, owner="async-first", ttl=5.0)
        asecond = AsyncClient(s.server_url, owner="async-second", ttl=5.0)
        held = await afirst.claim_slot("aonce", 1)
        assert (held.job, held.generation) == ("aonce#1", 1)
        assert (await held.complete())["state"] == "free"
        assert held.is_lost()
        async with asecond.claim_slot("aonce", 1) as next_holder:  # released on exit
            assert (next_holder.job, next_holder.slot, next_holder.generation) == ("aonce#1", 1, 2)
        assert (await asecond.status("aonce#1"))["state"] == "free"

    asyncio.run(from_asyncio())


def test_another_number_of_slots_while_slots_are_held(stack):
    s = stack(proxy=False)
    client = Client(s.server_url, owner="sizer", ttl=5.0)
    first = client.claim_slot("sized", 2)
    for other in (3, 1):
        with pytest.raises(SemaphoreSize) as refused:
            client.claim_slot("sized", other)
        e = refused.value
        assert (e.status, e.type, e.slots) == (409, "urn:fence:semaphore-size", 2), e.problem
        assert isinstance(e, ProblemError) and not isinstance(e, LeaseHeld)
    second = client.claim_slot("sized", 2)  # the number in force is still taken
    assert sorted((first.slot, second.slot)) == [1, 2]
    first.release()
    second.release()
    # No slot held: the number may change.
    with client.claim_slot("sized", 3) as third:
        assert (third.job, third.slot) == ("sized#1", 1)

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="async-sizer")
        held = await aclient.claim_slot("sized", 3)
        with pytest.raises(SemaphoreSize) as refused:
            await aclient.claim_slot("sized", 2)
        assert refused.value.slots == 3
        await held.release()

    asyncio.run(from_asyncio())


def test_a_stale_slot_holder_is_fenced_off(stack, monkeypatch):
    s = stack()
    ledger = f"{s.proxy_url}/ledger"
    a = Client(s.server_url, owner="slot-a", ttl=1.0, margin=0.1)
    lease_a = a.claim_slot("pool", 1)
    assert (lease_a.job, lease_a.slot, lease_a.generation) == ("pool#1", 1, 1)
    lease_a.save_checkpoint("half done")
    http = requests.Session()
    assert http.post(ledger, data="A: write", auth=FenceAuth(lease_a)).status_code == 200
    late_token = lease_a.token
    resume = pause_renewals(lease_a, monkeypatch)  # A stalls: no renewal reaches the server
    try:
        assert lease_a.lost.wait(2.0), "A's lost signal fires"
        assert time.time() * 1000 < lease_a.expires_at_ms, "before the server's expiry"
        with pytest.raises(LeaseLost):
            http.post(ledger, data="A: late", auth=FenceAuth(lease_a))
        b = Client(s.server_url, owner="slot-b", ttl=5.0)
        lease_b = b.claim_slot("pool", 1, wait=3.0)  # granted once A's lease expired
        assert (lease_b.job, lease_b.slot, lease_b.generation) == ("pool#1", 1, 2)
        assert lease_b.checkpoint == {"generation": 1, "data": "half done"}
        assert http.post(ledger, data="B: write", auth=FenceAuth(lease_b)).status_code == 200
        # A's held-up write, sent raw: the proxy refuses the slot's older generation.
        status, problem = raw("POST", ledger, {"X-Fencing-Job": "pool#1",
                                               "X-Fencing-Token": late_token}, b"A: late")
        assert (status, problem["type"]) == (409, "urn:fence:stale-token"), problem
        # A release by hand of the lease lost here sends nothing (it is left to expire).
        with pytest.raises(LeaseLost) as unsent:
            lease_a.release()
        assert type(unsent.value) is LeaseLost and "nothing was sent" in unsent.value.reason
        with pytest.raises(LeaseLost) as unsent:  # nor a completion, which frees a slot too
            lease_a.complete()
        assert type(unsent.value) is LeaseLost and "nothing was sent" in unsent.value.reason
        # The stale lease's renewal and release, sent anyway, are refused by the server.
        with pytest.raises(LeaseRefused) as renew:
            type(lease_a)._send_renew(lease_a, 1.0)
        assert (renew.value.type, renew.value.generation) == ("urn:fence:lease-lost", 2)
        with pytest.raises(LeaseRefused) as release:
            lease_a._send_finish("release")
        assert release.value.owner == "slot-b" and release.value.generation == 2
        with pytest.raises(LeaseLost):  # lost here already: nothing is sent
            lease_a.save_checkpoint("stale")
        assert not lease_b.is_lost()
        assert lease_b.release()["state"] == "free"
    finally:
        resume.set()
    assert [(w.job, w.token, w.body) for w in s.upstream.seen] == [
        ("pool#1", "1", "A: write"), ("pool#1", "2", "B: write")]


def test_a_waiting_claim_gets_a_slot_once_one_is_released(stack):
    s = stack(proxy=False)
    holders = [Client(s.server_url, owner=f"holder-{n}", ttl=5.0) for n in range(2)]
    held = [c.claim_slot("busy", 2) for c in holders]
    waiter = Client(s.server_url, owner="waiter", ttl=5.0)
    # Every slot taken for the whole wait: LeaseHeld once the wait is over, not before.
    started = monotonic()
    with pytest.raises(LeaseHeld) as refused:
        waiter.claim_slot("busy", 2, wait=0.4)
    took = monotonic() - started
    assert 0.4 <= took < 1.0, took
    assert refused.value.job in ("busy#1", "busy#2")
    timer = threading.Timer(0.5, held[1].release)
    timer.start()
    started = monotonic()
    lease = waiter.claim_slot("busy", 2, wait=5.0)
    took = monotonic() - started
    timer.join()
    assert 0.4 < took < 1.5, took  # polled: got the slot soon after its release
    assert (lease.job, lease.slot, lease.generation) == (held[1].job, held[1].slot, 2)
    assert waiter.status(lease.job)["owner"] == "waiter"
    lease.release()
    held[0].release()

    async def from_asyncio() -> None:
        aholders = [AsyncClient(s.server_url, owner=f"aholder-{n}") for n in range(2)]
        aheld = [await c.claim_slot("abusy", 2) for c in aholders]
        awaiter = AsyncClient(s.server_url, owner="awaiter")

        async def release_later() -> None:
            await asyncio.sleep(0.5)
            await aheld[0].release()

        started = monotonic()
        got, _ = await asyncio.gather(awaiter.claim_slot("abusy", 2, wait=5.0), release_later())
        assert 0.4 < monotonic() - started < 1.5
        assert (got.job, got.generation) == (aheld[0].job, 2)
        await got.release()
        await aheld[1].release()

    asyncio.run(from_asyncio())


@pytest.mark.parametrize("resource", ["a#b", "#", "a b", "", "x" * 252, "caf\u00e9"])
def test_bad_resource_names_are_refused_before_sending(resource):
    nobody = Client("http://127.0.0.1:9", owner="sem")  # would fail to connect if it sent
    with pytest.raises(InvalidJobId):
        nobody.claim_slot(resource, 2)
    with pytest.raises(InvalidJobId):
        AsyncClient("http://127.0.0.1:9", owner="sem").claim_slot(resource, 2)


@pytest.mark.parametrize("slots", [0, 1001, -1, True, 2.0, "2"])
def test_bad_numbers_of_slots_are_refused_before_sending(slots):
    nobody = Client("http://127.0.0.1:9", owner="sem")
    with pytest.raises(ValueError):
        nobody.claim_slot("res", slots)
    with pytest.raises(ValueError):
        AsyncClient("http://127.0.0.1:9", owner="sem").claim_slot("res", slots)
    # The bounds themselves are sizes: they fail only to connect.
    for ok in (1, 1000):
        with pytest.raises(ServerUnreachable):
            nobody.claim_slot("x" * 251, ok)


def lose_first_slot_answer(client, monkeypatch, lost_as: Exception) -> list:
    """The first semaphore claim reaches the server and is decided, but its answer is lost on
    the way back and ``lost_as`` raised instead (a connection cut after the request, a 503 of
    a store that did not confirm): the answers lost, and when each claim was sent
    (``client.sends``), for the test."""
    real = client._transport.call
    lost: list = []
    client.sends = []

    def losing(method, path, body=None, timeout=None):
        if "/v1/semaphores/" in path:
            client.sends.append(monotonic())
        answer = real(method, path, body, timeout=timeout)
        if "/v1/semaphores/" in path and not lost:
            lost.append(answer)
            raise lost_as
        return answer

    monkeypatch.setattr(client._transport, "call", losing)
    return lost


UNCONFIRMED = {"type": "urn:fence:store-unavailable", "status": 503,
               "detail": "the store did not confirm the decision within 5 s"}


GATEWAY = {"type": "about:blank", "status": 502, "detail": "<html>502 Bad Gateway</html>"}


@pytest.mark.parametrize("lost_as", [ServerUnreachable("the answer was lost on its way back"),
                                     ProblemError(UNCONFIRMED, 503, retry_after=0.3),
                                     ProblemError(GATEWAY, 502)],
                         ids=["unreachable", "503", "502 of a gateway"])
def test_a_lost_answer_to_a_slot_claim_gets_that_slot_back_not_a_second(stack, monkeypatch,
                                                                          lost_as):
    s = stack(proxy=False)
    other = Client(s.server_url, owner="other", ttl=5.0)

    def only_that_slot(lease, lost, resource, sends):
        # The retry carried the same key: the slot the lost answer granted, not a second one,
        # so the other slot is still free for someone else.
        assert lost and (lost[0]["job"], lost[0]["generation"]) == (lease.job, lease.generation)
        second = other.claim_slot(resource, 2)
        assert second.slot != lease.slot
        assert second.release()["state"] == "free"
        # Asked again once, after the 503's Retry-After when there was one.
        after = (lost_as.retry_after or 0.0) if isinstance(lost_as, ProblemError) else 0.0
        assert len(sends) == 2 and sends[1] - sends[0] >= after, (sends, after)

    client = Client(s.server_url, owner="lossy", ttl=5.0)
    lost = lose_first_slot_answer(client, monkeypatch, lost_as)
    lease = client.claim_slot("lossy", 2, wait=3.0)
    only_that_slot(lease, lost, "lossy", client.sends)
    assert lease.release()["state"] == "free"

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="lossy-async", ttl=5.0)
        lost = lose_first_slot_answer(aclient, monkeypatch, lost_as)
        lease = await aclient.claim_slot("alossy", 2, wait=3.0)
        only_that_slot(lease, lost, "alossy", aclient.sends)
        assert (await lease.release())["state"] == "free"

    asyncio.run(from_asyncio())
    # Without a wait the lost answer is the caller's to handle, as before.
    client = Client(s.server_url, owner="lossy-now", ttl=5.0)
    lose_first_slot_answer(client, monkeypatch, lost_as)
    with pytest.raises(type(lost_as)):
        client.claim_slot("lossy-now", 2)


def test_retry_after_is_seconds_at_most_a_minute():
    """A Retry-After is waited for in seconds, at most 60 (a huge one would sleep for days, or
    overflow the sleep); an HTTP-date, a negative or not-a-number value is none (backoff)."""
    from fence_client._errors import MAX_RETRY_AFTER, problem_error
    for value, seconds in [("2", 2.0), ("0.3", 0.3), ("99999999999", MAX_RETRY_AFTER),
                           ("inf", MAX_RETRY_AFTER), ("-1", None), ("nan", None),
                           ("Wed, 21 Oct 2026 07:28:00 GMT", None)]:
        assert problem_error(503, {"Retry-After": value}, b"").retry_after == seconds, value
