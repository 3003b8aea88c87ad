"""Answers the real server never gives, from a scripted one: each must leave the lease (or the
claim) as the contract says."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import List

import httpx
import pytest
import requests

from conftest import wait_for
from fakeserver import FakeServer, grant, problem
from fence_client import Client, LeaseLost, ProblemError, ProtocolError
from fence_client.aio import AsyncClient
from fence_client.httpx import FenceAuth as HttpxFenceAuth
from fence_client.requests import FenceAuth as RequestsFenceAuth


@pytest.fixture
def fake():
    made = []

    def make(script):
        made.append(FakeServer(script))
        return made[-1]

    yield make
    for server in made:
        server.close()


def first_renewal_hangs(action, body, n):
    if action == "renew" and n == 0:
        return None  # taken, never answered
    return grant(body)


def test_a_renewal_that_never_answers_is_abandoned_and_asked_again(fake):
    server = fake(first_renewal_hangs)
    # A 6 s lease: renewed every 2 s, the hung attempt given up after 2 s and the renewal asked
    # again some 0.5 s later, almost a second before the deadline (5.4 s): room for a loaded
    # machine. Were the attempt given all the time left, it would use up the lease.
    lease = Client(server.url, owner="o", ttl=6.0).claim("j")
    time.sleep(6.0)  # past the claim's deadline: only a later renewal keeps the lease
    assert not lease.is_lost(), lease.loss_reason
    assert server.count("renew") >= 2
    lease.abandon()


def test_an_asyncio_renewal_that_never_answers_is_abandoned_and_asked_again(fake):
    server = fake(first_renewal_hangs)

    async def main() -> None:
        lease = await AsyncClient(server.url, owner="o", ttl=6.0).claim("j")  # as above
        await asyncio.sleep(6.0)
        assert not lease.is_lost(), lease.loss_reason
        assert server.count("renew") >= 2
        lease.abandon()

    asyncio.run(main())


def test_a_release_answered_408_body_timeout_is_asked_again(fake):
    def script(action, body, n):
        if action == "release" and n == 0:
            return problem(408, "body-timeout")
        if action == "release":
            return 200, {"content-type": "application/json"}, json.dumps(
                {"job": "j", "owner": None, "generation": 1, "state": "free",
                 "expires_in_ms": 0}).encode()
        return grant(body)

    server = fake(script)
    record = Client(server.url, owner="o", ttl=5.0).claim("j").release()
    assert record["state"] == "free"
    assert server.count("release") == 2


def test_a_claim_answered_a_gateways_408_is_asked_again_with_the_same_key(fake):
    def script(action, body, n):
        if action == "claim" and n == 0:
            return 408, {"content-type": "text/plain"}, b"request timeout"
        return grant(body)

    server = fake(script)
    client = Client(server.url, owner="o", ttl=5.0)
    with pytest.raises(ProblemError) as lost:
        client.claim("j")
    assert lost.value.status == 408
    client.claim("j").abandon()
    keys = [body["lease_key"] for action, body in server.seen if action == "claim"]
    assert len(keys) == 2 and keys[0] == keys[1]


def crowded_twice(action, body, n):
    if action == "claim" and n < 2:
        return problem(429, "too-many-waiters", {"retry-after": "0"})
    return grant(body)


def test_a_waiting_claim_refused_for_too_many_waiters_asks_again_within_its_wait(fake):
    server = fake(crowded_twice)
    Client(server.url, owner="o", ttl=5.0).claim("j", wait=5).abandon()
    assert server.count("claim") == 3

    async def main() -> None:
        aserver = fake(crowded_twice)
        (await AsyncClient(aserver.url, owner="o", ttl=5.0).claim("j", wait=5)).abandon()
        assert aserver.count("claim") == 3

    asyncio.run(main())


def test_a_grant_above_the_ttl_asked_does_not_move_the_deadline_past_it(fake):
    # Every grant ten times what was asked: the deadline still counts from the 1 s asked.
    server = fake(lambda action, body, n: grant(body, ttl_ms=10 * body["ttl_ms"]))
    lease = Client(server.url, owner="o", ttl=1.0).claim("j")
    assert lease.ttl == 10.0
    assert lease.deadline <= time.monotonic() + 0.9
    # Renewed before the asked TTL's deadline (not a third of 10 s), each counted from 1 s.
    deadline = time.monotonic() + 3
    while server.count("renew") < 2:
        assert time.monotonic() < deadline, "not renewed as the asked TTL needs"
        time.sleep(0.01)
    seen = time.monotonic()
    assert lease.deadline <= seen + 0.9 and not lease.is_lost(), lease.loss_reason
    lease.abandon()


def echo(status, action, body):
    return status, {"content-type": "text/plain"}, json.dumps(body).encode()


def test_an_endpoint_that_echoes_the_request_never_puts_the_lease_key_in_errors(fake):
    # Renewals answered 200 with the request itself: not a grant, and the loss reason says why.
    server = fake(lambda action, body, n: grant(body) if action == "claim" else echo(200, action, body))
    lease = Client(server.url, owner="o", ttl=1.0).claim("j")
    key = server.seen[0][1]["lease_key"]
    assert lease.lost.wait(3), "the lease outlived renewals that were never granted"
    assert "expires_at_ms" in lease.loss_reason and key not in lease.loss_reason, lease.loss_reason
    with pytest.raises(LeaseLost) as lost:
        lease.token
    assert key not in str(lost.value)
    # A refusal whose body is the request: its detail is in the error, the key is not.
    refusing = fake(lambda action, body, n: echo(400, action, body))
    with pytest.raises(ProblemError) as refused:
        Client(refusing.url, owner="o", ttl=1.0).claim("j")
    key = refusing.seen[0][1]["lease_key"]
    assert "lease_key" in str(refused.value) and key not in str(refused.value), str(refused.value)


class Sink:
    """A destination that records the raw bytes of each connection until it closes."""

    def __init__(self) -> None:
        self.received: List[bytes] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/upload"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._take, args=(conn,), daemon=True).start()

    def _take(self, conn: socket.socket) -> None:
        data = b""
        conn.settimeout(5)
        with conn:
            try:
                while b"\r\n0\r\n\r\n" not in data and not data.endswith(b"0\r\n\r\n"):
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if data.endswith(b"0\r\n\r\n"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            except OSError:
                pass
        self.received.append(data)

    def close(self) -> None:
        self.listener.close()


def renewals_hang(action, body, n):
    return None if action == "renew" else grant(body)


def slow_body(then: List[str]):
    yield b"first chunk"
    time.sleep(1.5)  # past the lease's deadline
    then.append("resumed")
    yield b"second chunk"


def test_a_streamed_body_is_cut_at_the_loss_httpx(fake):
    server, sink = fake(renewals_hang), Sink()
    try:
        lease = Client(server.url, owner="o", ttl=1.0).claim("j")
        then: List[str] = []
        with pytest.raises(LeaseLost):
            httpx.post(sink.url, content=slow_body(then), auth=HttpxFenceAuth(lease), timeout=5)
        wait_for("the sink saw the connection end", 5, lambda: sink.received)
        assert b"first chunk" in sink.received[0]
        assert b"second chunk" not in sink.received[0] and not sink.received[0].endswith(b"0\r\n\r\n")

        async def main() -> None:
            alease = await AsyncClient(server.url, owner="o", ttl=1.0).claim("j")

            async def aslow():
                yield b"first chunk"
                await asyncio.sleep(1.5)
                yield b"second chunk"

            async with httpx.AsyncClient(auth=HttpxFenceAuth(alease), timeout=5) as http:
                with pytest.raises(LeaseLost):
                    await http.post(sink.url, content=aslow())

        asyncio.run(main())
        wait_for("the sink saw the second connection end", 5, lambda: len(sink.received) == 2)
        assert b"second chunk" not in sink.received[1] and not sink.received[1].endswith(b"0\r\n\r\n")
    finally:
        sink.close()


def test_a_streamed_body_is_cut_at_the_loss_requests(fake):
    server, sink = fake(renewals_hang), Sink()
    try:
        lease = Client(server.url, owner="o", ttl=1.0).claim("j")
        then: List[str] = []
        with pytest.raises(LeaseLost):
            requests.post(sink.url, data=slow_body(then), auth=RequestsFenceAuth(lease), timeout=5)
        wait_for("the sink saw the connection end", 5, lambda: sink.received)
        assert b"first chunk" in sink.received[0]
        assert b"second chunk" not in sink.received[0] and not sink.received[0].endswith(b"0\r\n\r\n")
    finally:
        sink.close()


def grant_all(action, body, n):
    return grant(body)


def test_a_streamed_body_lost_after_its_last_chunk_never_ends(fake):
    # The last chunk is read while the lease holds; the lease is lost before the source is
    # done: the body's end must not go out (the destination sees a request cut short).
    server, sink = fake(grant_all), Sink()
    try:
        client = Client(server.url, owner="o", ttl=5.0)

        def body(lease):
            yield b"last chunk"
            lease.abandon()

        lease = client.claim("j")
        with pytest.raises(LeaseLost):
            httpx.post(sink.url, content=body(lease), auth=HttpxFenceAuth(lease), timeout=5)
        lease = client.claim("j")
        with pytest.raises(LeaseLost):
            requests.post(sink.url, data=body(lease), auth=RequestsFenceAuth(lease), timeout=5)

        async def main() -> None:
            alease = await AsyncClient(server.url, owner="o", ttl=5.0).claim("j")

            async def abody():
                yield b"last chunk"
                alease.abandon()

            async with httpx.AsyncClient(auth=HttpxFenceAuth(alease), timeout=5) as http:
                with pytest.raises(LeaseLost):
                    await http.post(sink.url, content=abody())

        asyncio.run(main())
        wait_for("the sink saw three connections end", 5, lambda: len(sink.received) == 3)
        for data in sink.received:
            assert b"last chunk" in data and not data.endswith(b"0\r\n\r\n"), data
    finally:
        sink.close()


def test_a_key_cut_short_or_in_a_detail_that_is_no_string_is_redacted(fake):
    from fence_client._errors import problem_error

    key = "KEYPART" + "k" * 36
    # A text answer quoted up to 500 characters, its cut 7 characters into the key.
    head = "x" * (500 - len('lease_key":"') - 7) + 'lease_key":"'
    cut = problem_error(400, {"content-type": "text/plain"}, (head + key + '"}').encode())
    assert "lease_key" in str(cut) and "KEYPART" not in str(cut), str(cut)
    # A problem whose detail is an object (the request echoed).
    echoed = json.dumps({"type": "urn:x", "detail": {"lease_key": key}}).encode()
    odd = problem_error(400, {"content-type": "application/problem+json"}, echoed)
    assert "lease_key" in str(odd) and "KEYPART" not in str(odd) and "KEYPART" not in odd.detail, str(odd)
    # A 200 that is not JSON, quoted up to 200 characters, its cut 3 or 5 characters into the
    # key (the answer's first 200 bytes, or their repr's first 200 characters).
    server = fake(lambda action, body, n: (200, {"content-type": "text/plain"}, (
        "<" * (200 - len("lease_key=") - 5) + "lease_key=" + body["lease_key"]).encode()))
    with pytest.raises(ProtocolError) as bad:
        Client(server.url, owner="o", ttl=1.0).claim("j")
    sent = server.seen[0][1]["lease_key"]
    assert "not JSON" in str(bad.value) and sent[:5] not in str(bad.value), str(bad.value)


def test_a_buffer_body_goes_out_whole_through_the_requests_adapter(fake):
    # memoryview, array and mmap have __iter__ and no read: taken for a stream, they were sent
    # as their ints. They are sent as bytes, as without the adapter.
    import array
    import http.server

    got: List[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(self.rfile.read(int(self.headers.get("content-length") or 0)))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    sink = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    try:
        server = fake(grant_all)
        lease = Client(server.url, owner="o", ttl=5.0).claim("j")
        url = f"http://127.0.0.1:{sink.server_address[1]}/upload"
        for body in (memoryview(b"whole body"), array.array("B", b"whole body")):
            r = requests.post(url, data=body, auth=RequestsFenceAuth(lease), timeout=5)
            assert r.status_code == 200
        assert got == [b"whole body", b"whole body"], got
        lease.abandon()
    finally:
        sink.shutdown()
        sink.server_close()
