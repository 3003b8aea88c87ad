"""The keeper and the adapters at the edges: a renewal answered after the deadline, a renewal
that fails in an unexpected way, a server that holds waiting claims only briefly, a redirect
followed after the lease was lost."""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import threading
import time
from typing import Any, List

import httpx
import pytest
import requests

import fence_client._lease
import fence_client._wire
from conftest import wait_for
from fence_client import Client, GrantTooShort, LeaseHeld, LeaseLost, ServerUnreachable
from fence_client._errors import problem_error
from fence_client.aio import AsyncClient
from fence_client.httpx import FenceAuth as HttpxFenceAuth
from fence_client.requests import FenceAuth


def answered_after_the_deadline(lease, monkeypatch) -> None:
    """Renewals reach the server, but their answers are looked at an hour later (the worker's
    clock moved on: a long pause between the answer and its check)."""
    real_send = type(lease)._send_renew
    real_clock = fence_client._wire.monotonic
    offset: List[float] = [0.0]

    def send(timeout: float):
        answer = real_send(lease, timeout)
        offset[0] = 3600.0
        return answer

    monkeypatch.setattr(fence_client._lease, "monotonic", lambda: real_clock() + offset[0])
    monkeypatch.setattr(lease, "_send_renew", send)


def test_a_renewal_answered_after_the_deadline_signals_the_loss(stack, monkeypatch):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="late", ttl=1.0).claim("late-answer")
    answered_after_the_deadline(lease, monkeypatch)
    assert lease.lost.wait(3.0), "the loss was never signalled"
    assert lease.is_lost()

    async def from_asyncio() -> None:
        alease = await AsyncClient(s.server_url, owner="late-async", ttl=1.0).claim("alate")
        answered_after_the_deadline(alease, monkeypatch)
        await asyncio.wait_for(alease.lost.wait(), 3.0)

    asyncio.run(from_asyncio())


def test_a_renewal_that_fails_unexpectedly_is_retried_not_the_end_of_the_keeper(stack,
                                                                               monkeypatch):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="cut", ttl=1.0).claim("cut-answer")
    real_send = type(lease)._send_renew
    failures: List[int] = []

    def send(timeout: float):
        if not failures:
            failures.append(1)
            raise http.client.IncompleteRead(b"")  # a cut body, not a FenceError
        return real_send(lease, timeout)

    monkeypatch.setattr(lease, "_send_renew", send)
    time.sleep(1.5)  # past the claim's deadline: only a later renewal keeps the lease
    assert failures and not lease.is_lost(), lease.loss_reason
    lease.release()


def test_a_problem_with_a_status_that_is_not_a_number_keeps_the_answers_status():
    for member in (None, "503", True, 7, 1000, [503]):
        body = json.dumps({"type": "urn:fence:store-unavailable", "status": member,
                           "detail": "x"}).encode()
        error = problem_error(503, {"content-type": "application/problem+json"}, body)
        assert error.status == 503, (member, error.status)


def test_a_waiting_claim_asks_at_most_every_50ms_whatever_the_server_holds_it_for(stack,
                                                                               monkeypatch):
    s = stack(proxy=False, server_args=["--max-claim-wait", "1ms"])
    holder = Client(s.server_url, owner="holder", ttl=10.0).claim("paced")
    waiter = Client(s.server_url, owner="waiter")
    real_call = waiter._transport.call
    claims: List[str] = []

    def counting(method, path, body=None, timeout=None):
        if "/claim" in path:
            claims.append(path)
        return real_call(method, path, body, timeout=timeout)

    monkeypatch.setattr(waiter._transport, "call", counting)
    with pytest.raises(LeaseHeld):
        waiter.claim("paced", wait=0.5)
    holder.release()
    # 500 ms at one claim per 50 ms: about 10 (a loop without a pause sends hundreds).
    assert 2 <= len(claims) <= 20, len(claims)


def test_a_redirect_after_the_lease_was_lost_is_not_followed(stack):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="redirected", ttl=5.0).claim("redirected")
    reached: List[Any] = []
    server = _redirecting_destination([lease.abandon], reached)
    try:
        with pytest.raises(LeaseLost):
            requests.post(f"http://127.0.0.1:{server.server_address[1]}/slow", data=b"x",
                          auth=FenceAuth(lease), timeout=5)
        assert reached == [], "the redirect was followed with the lost lease's token"
    finally:
        server.shutdown()
        server.server_close()


def _redirecting_destination(lose: List[Any], reached: List[Any]) -> http.server.ThreadingHTTPServer:
    """A destination that loses the lease (calls ``lose[0]``) while it answers ``/slow`` with a
    307 to ``/target``, and notes the token of every request that reaches ``/target``."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path == "/slow":
                lose[0]()  # lost while the destination took its time
                self.send_response(307)
                self.send_header("location", "/target")
            else:
                reached.append(self.headers.get("x-fencing-token"))
                self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_httpx_follows_no_redirect_once_the_lease_was_lost(stack):
    # httpx follows redirects inside the auth flow, copying the headers: the lease must be
    # checked again as each request's head is written, sync and async alike.
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="redirected", ttl=5.0).claim("redirected-httpx")
    lose: List[Any] = [lease.abandon]
    reached: List[Any] = []
    server = _redirecting_destination(lose, reached)
    url = f"http://127.0.0.1:{server.server_address[1]}/slow"
    try:
        with pytest.raises(LeaseLost):
            httpx.post(url, content=b"x", auth=HttpxFenceAuth(lease), follow_redirects=True,
                       timeout=5)
        assert reached == [], "httpx followed the redirect with the lost lease's token"

        async def main() -> None:
            client = AsyncClient(s.server_url, owner="redirected-async", ttl=5.0)
            alease = await client.claim("redirected-httpx-async")
            loop = asyncio.get_running_loop()

            def lose_async() -> None:
                # Abandoned on its own loop, which is free while the request is answered.
                loop.call_soon_threadsafe(alease.abandon)
                time.sleep(0.2)

            lose[0] = lose_async
            async with httpx.AsyncClient(auth=HttpxFenceAuth(alease), follow_redirects=True,
                                         timeout=5) as http_:
                with pytest.raises(LeaseLost):
                    await http_.post(url, content=b"x")

        asyncio.run(main())
        assert reached == [], "httpx (async) followed the redirect with the lost lease's token"
    finally:
        server.shutdown()
        server.server_close()


def test_a_keeper_that_fails_declares_the_lease_lost(stack, monkeypatch):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="crashing", ttl=3.0).claim("crashing-keeper")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the keeper")

    monkeypatch.setattr(lease, "_after_renewal", broken)
    # The first renewal comes at a third of the TTL (1 s): its failure is seen then, before the
    # deadline (about 2.7 s). A keeper that died silently would never set `lost` at all.
    assert lease.lost.wait(2.0), "the keeper failed silently"
    with pytest.raises(LeaseLost, match="keeper stopped unexpectedly"):
        lease.token


def test_a_grant_no_longer_than_the_margin_is_named_and_given_back(stack):
    # 30 s asked, 1 s granted (the server's --max-ttl), 1.5 s margin: no time to hold it.
    s = stack(proxy=False, server_args=["--max-ttl", "1s"])
    with pytest.raises(GrantTooShort) as refused:
        Client(s.server_url, owner="cautious", ttl=30.0, margin=1.5).claim("short")
    assert (refused.value.granted, refused.value.margin) == (1.0, 1.5)
    wait_for("the short grant given back", 2.0,
             lambda: Client(s.server_url).status("short")["state"] == "free")
    assert Client(s.server_url, owner="next").claim("short").generation == 2

    async def from_asyncio() -> None:
        with pytest.raises(GrantTooShort):
            await AsyncClient(s.server_url, owner="acautious", ttl=30.0, margin=1.5).claim("ashort")
        wait_for("the short grant given back", 2.0,
                 lambda: Client(s.server_url).status("ashort")["state"] == "free")

    asyncio.run(from_asyncio())


def failing_finishes(lease, monkeypatch, failures: int, applied: bool) -> List[str]:
    """The lease's next ``failures`` releases or completions fail as if the server never
    answered: after reaching it (their answer lost) when ``applied``, before otherwise."""
    real_call = lease._transport.call
    sent: List[str] = []

    def call(method, path, body=None, timeout=None):
        if path.endswith(("/release", "/complete")):
            sent.append(path)
            if len(sent) <= failures:
                if applied:
                    real_call(method, path, body, timeout)
                raise ServerUnreachable("the answer was lost")
        return real_call(method, path, body, timeout)

    monkeypatch.setattr(lease._transport, "call", call)
    return sent


def test_a_completion_whose_answer_was_lost_is_done_not_lost(stack, monkeypatch):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="finisher", ttl=30.0).claim("report")
    sent = failing_finishes(lease, monkeypatch, 1, applied=True)
    record = lease.complete()
    assert (record["state"], record["owner"], len(sent)) == ("completed", "finisher", 2)
    assert Client(s.server_url).status("report")["state"] == "completed"

    async def from_asyncio() -> None:
        alease = await AsyncClient(s.server_url, owner="afinisher", ttl=30.0).claim("areport")
        asent = failing_finishes(alease, monkeypatch, 2, applied=False)
        arecord = await alease.release()
        assert (arecord["state"], len(asent)) == ("free", 3)

    asyncio.run(from_asyncio())
    assert Client(s.server_url).status("areport")["state"] == "free"


def test_a_server_that_keeps_failing_a_release_is_given_up_on_at_the_lease_s_end(stack,
                                                                                 monkeypatch):
    s = stack(proxy=False)
    lease = Client(s.server_url, owner="finisher", ttl=1.0).claim("blip")
    sent = failing_finishes(lease, monkeypatch, 1_000, applied=False)
    started = time.monotonic()
    with pytest.raises(ServerUnreachable):
        lease.release()
    took = time.monotonic() - started
    assert 0.5 < took < 1.5, f"gave up after {took:.2f} s (the lease ends 1 s after its claim)"
    assert len(sent) > 2


def test_cancelling_an_asyncio_release_stops_its_retries(stack, monkeypatch):
    """Cancelling ``release()`` stops the retries in its worker thread. Before, they went on
    until the lease could end (10 s here), unseen, and ``asyncio.run`` waited for them."""
    s = stack(proxy=False)
    sent: List[List[str]] = []

    async def cancelled_release() -> None:
        alease = await AsyncClient(s.server_url, owner="canceller", ttl=10.0).claim("acancel")
        sent.append(failing_finishes(alease, monkeypatch, 1_000, applied=False))
        task = asyncio.create_task(alease.release())
        await asyncio.sleep(0.5)  # a few attempts, 100 and 200 ms apart
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    started = time.monotonic()
    asyncio.run(cancelled_release())  # waits for the worker thread at its exit
    took = time.monotonic() - started
    attempts = len(sent[0])
    assert took < 3.0, f"the retries went on after the cancel: {took:.1f} s, {attempts} attempts"
    time.sleep(0.5)
    assert len(sent[0]) == attempts


def test_asyncio_renewals_do_not_wait_for_the_loops_default_executor(stack):
    """An application whose blocking work fills the loop's default executor (one thread here,
    busy for 4 s) must not starve the keeper: a 2 s lease is renewed all along."""
    import concurrent.futures

    s = stack(proxy=False)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=1))
        lease = await AsyncClient(s.server_url, owner="starved", ttl=2.0).claim("starved")
        await asyncio.to_thread(time.sleep, 4.0)  # the only default thread, for 2 leases
        assert not lease.is_lost(), lease.loss_reason
        await lease.release()

    asyncio.run(main())


def test_asyncio_renewals_do_not_queue_behind_waiting_claims(stack):
    """Waiting claims are held at the server for as long as they wait; before, each took one of
    256 threads shared by every AsyncClient for all that time, and the renewals queued behind
    them until the lease was lost. 256 claims wait here for 10 s while a 2 s lease must be
    renewed all along."""
    s = stack(proxy=False)
    Client(s.server_url, owner="holder", ttl=30.0).claim("busy")

    async def main() -> None:
        client = AsyncClient(s.server_url, owner="waiter", ttl=2.0)
        lease = await client.claim("kept")
        async def wait_for_busy() -> None:
            await client.claim("busy", wait=10.0)

        waiting = [asyncio.create_task(wait_for_busy()) for _ in range(256)]
        try:
            await asyncio.sleep(3.0)  # 1.5 TTLs: the lease needs more than one renewal
            assert not lease.is_lost(), lease.loss_reason
            assert not any(t.done() for t in waiting), "a waiting claim ended early"
        finally:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        await lease.release()

    asyncio.run(main())


def test_asyncio_claims_under_way_are_bounded_and_renewals_are_not(stack):
    """Each call under way takes threads: claims (and status reads) of one AsyncClient are
    at most ``max_calls`` at once, a cancelled one keeping its place until its thread ends;
    the keeper's renewals never wait for a place. 20 claims wait here with 4 places while a
    2 s lease must be renewed all along."""
    s = stack(proxy=False)
    Client(s.server_url, owner="holder", ttl=30.0).claim("busy-cap")

    def call_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "fence-call")

    async def main() -> None:
        with pytest.raises(ValueError):
            AsyncClient(s.server_url, max_calls=0)
        client = AsyncClient(s.server_url, owner="waiter", ttl=2.0, max_calls=4, timeout=1.5)
        lease = await client.claim("kept-cap")
        async def wait_for_busy() -> None:
            await client.claim("busy-cap", wait=10.0)

        waiting = [asyncio.create_task(wait_for_busy()) for _ in range(20)]
        most = 0
        try:
            for _ in range(30):  # 3 s: 1.5 TTLs, more than one renewal
                await asyncio.sleep(0.1)
                most = max(most, call_threads())
            assert not lease.is_lost(), lease.loss_reason
            assert not any(t.done() for t in waiting), "a waiting claim ended early"
            # With every place taken, a claim that waits 1.5 s for one (the client's timeout)
            # is refused then, with nothing sent, not held for a place for the 10 s others
            # wait.
            asked = time.monotonic()
            with pytest.raises(ServerUnreachable, match="max_calls"):
                await client.claim("free-cap")
            assert time.monotonic() - asked < 4.0
            # Nothing was sent, so no key is kept for the job: a new key kept here would
            # take the place of one a concurrent claim of the job kept after its answer was
            # lost, and the job would then be answered held by this client's own lease.
            assert "free-cap" not in client._unsettled
            client._unsettled["free-cap"] = ("kept-key", time.monotonic() + 60)
            with pytest.raises(ServerUnreachable, match="max_calls"):
                await client.claim("free-cap")
            assert client._unsettled["free-cap"][0] == "kept-key", "a kept key was dropped"
        finally:
            for t in waiting:
                t.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
        # Two threads per call under way (one sends, one bounds its time).
        assert 8 <= most <= 10, f"{most} threads: 4 claims and at most one renewal"
        await lease.release()

    asyncio.run(main())


def test_an_asyncio_call_under_way_does_not_keep_the_process_alive(stack):
    """A program whose loop ended while a call was under way (a waiting claim whose caller gave
    up) exits at once: before, the call's pool thread was joined at exit, and the process
    lived on until the server answered (here a minute later)."""
    import subprocess
    import sys

    from conftest import CLIENT_DIR

    s = stack(proxy=False)
    Client(s.server_url, owner="holder", ttl=30.0).claim("busy")
    program = f"""
import asyncio
from fence_client.aio import AsyncClient

async def main():
    client = AsyncClient({s.server_url!r}, owner="leaver", ttl=30.0)
    try:
        await asyncio.wait_for(client.claim("busy", wait=60.0), 0.5)
    except asyncio.TimeoutError:
        print("gave up", flush=True)

asyncio.run(main())
"""
    started = time.monotonic()
    try:
        child = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                               timeout=20, env={"PYTHONPATH": str(CLIENT_DIR / "src")})
    except subprocess.TimeoutExpired:
        pytest.fail("the program was kept alive past the end of its loop")
    assert child.returncode == 0 and child.stdout == "gave up\n", (child.stdout, child.stderr)
    assert time.monotonic() - started < 20


def test_asyncio_calls_work_in_a_forked_child(stack):
    """A prefork server (gunicorn --preload) forks after the parent used the client: the
    child has none of the parent's threads, and its calls must not wait for them."""
    import os

    s = stack(proxy=False)

    async def claim_and_release(job: str) -> None:
        lease = await AsyncClient(s.server_url, owner="forked", ttl=5.0).claim(job)
        await lease.release()

    asyncio.run(claim_and_release("before-fork"))  # the parent's pool has threads now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its calls went through within 10 s
        try:
            asyncio.run(asyncio.wait_for(claim_and_release("in-child"), 10.0))
            os._exit(0)
        except BaseException:  # noqa: BLE001 - any failure is the child's exit code
            os._exit(1)
    deadline = time.monotonic() + 20.0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child's calls did not go through"
