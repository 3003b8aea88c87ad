"""A claim answered 200 with a grant that does not follow the contract: the caller gets a
ProtocolError, and the lease it stands for is not left held, unused, until its TTL ends. A grant
that names its generation is given back at once; one that does not keeps its key, which the next
claim of the job asks with (so it gets that lease back). Both clients, against the real server
through a front that mangles the first claim answer."""

from __future__ import annotations

import asyncio
import http.client
import http.server
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import pytest

from conftest import wait_for
from fence_client import AsyncClient, Client, LeaseHeld, ProtocolError

Mangle = Callable[[Dict[str, Any]], str]

FLAVOURS = (Client, AsyncClient)


@dataclass
class Request:
    path: str
    body: Optional[Dict[str, Any]]


class Front:
    """A front for the lease server that forwards everything, records each request's path and
    body, and hands the first 200 of a claim to ``mangle`` (the decoded answer; the text to
    answer with; the first ``mangled`` ones with ``mangled``). The first ``failed_releases`` releases are answered 503 here, unforwarded."""

    def __init__(self, server_url: str, mangle: Mangle, failed_releases: int = 0,
                 refuse_renewals: bool = False, mangled: int = 1) -> None:
        self.seen: List[Request] = []
        self._lock = threading.Lock()
        self._left = mangled
        self._failed_releases = failed_releases
        self._refuse_renewals = refuse_renewals
        self._refused = 0
        host, port = server_url.split("://", 1)[1].rsplit(":", 1)
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                status, content_type, text = outer._answer(self.command, self.path, body,
                                                           host, int(port), mangle)
                if status == 0:  # no answer: the connection is closed unanswered
                    self.close_connection = True
                    return
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer(self, method: str, path: str, body: bytes, host: str, port: int,
                mangle: Mangle) -> "tuple[int, str, bytes]":
        with self._lock:
            self.seen.append(Request(path, json.loads(body) if body else None))
            if path.endswith("/release") and self._failed_releases > 0:
                self._failed_releases -= 1
                problem = {"type": "urn:fence:store-unavailable", "status": 503,
                           "detail": "the front failed this release"}
                return 503, "application/problem+json", json.dumps(problem).encode()
            if path.endswith("/renew") and self._refuse_renewals:
                # The first renewal is refused; the later ones get no answer (their connection
                # is closed unanswered), and a failure with no answer must not hide the 401.
                self._refused += 1
                if self._refused > 1:
                    return 0, "", b""
                problem = {"type": "urn:fence:unauthenticated", "status": 401,
                           "detail": "the front knows no such secret"}
                return 401, "application/problem+json", json.dumps(problem).encode()
        conn = http.client.HTTPConnection(host, port, timeout=10)
        try:
            conn.request(method, path, body or None, {"content-type": "application/json"})
            answer = conn.getresponse()
            status, content_type, text = (answer.status, answer.getheader("content-type", ""),
                                          answer.read())
        finally:
            conn.close()
        with self._lock:
            mangled = (status == 200 and path.split("?")[0].endswith("/claim")
                       and self._left > 0)
            if mangled:
                self._left -= 1
        if mangled:
            text = mangle(json.loads(text)).encode()
        return status, content_type, text

    def requests(self, suffix: str) -> List[Request]:
        """The requests seen so far whose path ends with ``suffix``."""
        with self._lock:
            return [r for r in self.seen if r.path.endswith(suffix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def front():
    """``front(server_url, mangle, failed_releases=0, refuse_renewals=False, mangled=1)``: a
    :class:`Front`, closed at the end."""
    made: List[Front] = []

    def make(server_url: str, mangle: Mangle, failed_releases: int = 0,
             refuse_renewals: bool = False, mangled: int = 1) -> Front:
        made.append(Front(server_url, mangle, failed_releases, refuse_renewals, mangled))
        return made[-1]

    yield make
    for f in made:
        f.close()


DROP = object()


def with_(name: str, value: Any) -> Mangle:
    """The answer with member ``name`` set to ``value`` (DROP: left out)."""
    def mangle(answer: Dict[str, Any]) -> str:
        answer = dict(answer)
        if value is DROP:
            answer.pop(name, None)
        else:
            answer[name] = value
        return json.dumps(answer)
    return mangle


def claim(make: type, url: str, job: str, times: int = 1, release: bool = False) -> List[Any]:
    """``times`` claims of ``job`` by one client (``make``, owner "worker", 30 s TTL) through
    ``url``: each outcome, a lease or the exception raised; the last lease released with
    ``release``."""
    async def claims() -> List[Any]:
        client = make(url, owner="worker", ttl=30.0)
        outcomes: List[Any] = []
        for _ in range(times):
            try:
                if isinstance(client, AsyncClient):
                    outcomes.append(await client.claim(job))
                else:
                    outcomes.append(await asyncio.to_thread(client.claim, job))
            except Exception as e:  # noqa: BLE001 - the outcome the test checks
                outcomes.append(e)
        last = outcomes[-1]
        if release and not isinstance(last, Exception):
            if isinstance(client, AsyncClient):
                await last.release()
            else:
                await asyncio.to_thread(last.release)
        return outcomes

    return asyncio.run(claims())


def given_back(s: Any, f: Front, job: str, path: str, what: str) -> None:
    """Checks that the grant of ``job`` was released through the front, naming the grant (the
    claim's owner and key, the answer's generation), and that the server records it free."""
    wait_for(f"{what}: a release", 5.0, lambda: f.requests("/release"))
    release, claim_sent = f.requests("/release")[0], f.requests("/claim")[0]
    assert release.path == path, what
    assert release.body == {"owner": "worker", "generation": 1,
                            "lease_key": claim_sent.body["lease_key"]}, what
    observer = Client(s.server_url, owner="observer")
    wait_for(f"{what}: {job} given back", 5.0, lambda: observer.status(job)["state"] == "free")


NAMED = {
    "without ttl_ms": with_("ttl_ms", DROP),
    "ttl_ms 0": with_("ttl_ms", 0),
    "ttl_ms 1.5": with_("ttl_ms", 1.5),
    "ttl_ms -5": with_("ttl_ms", -5),
    "ttl_ms true": with_("ttl_ms", True),
    "expires_at_ms -1": with_("expires_at_ms", -1),
    "a token of another generation": with_("token", "99.1.x"),
    # Outside what a server grants (0.1 s to 24 h), and an expiry no u64 holds: refused by the
    # Rust client, taken before.
    "ttl_ms 99": with_("ttl_ms", 99),
    "ttl_ms 86400001": with_("ttl_ms", 86_400_001),
    "expires_at_ms 2**64": with_("expires_at_ms", 2**64),
    # A checkpoint that is not {generation: u64, data: text} was handed to the worker as is.
    "checkpoint text": with_("checkpoint", "rows 0-999"),
    "checkpoint without data": with_("checkpoint", {"generation": 1}),
    "checkpoint without a generation": with_("checkpoint", {"data": "rows"}),
    "checkpoint data 5": with_("checkpoint", {"generation": 1, "data": 5}),
    "checkpoint generation -1": with_("checkpoint", {"generation": -1, "data": "rows"}),
    "checkpoint generation true": with_("checkpoint", {"generation": True, "data": "rows"}),
}


@pytest.mark.parametrize("what", list(NAMED))
def test_a_malformed_grant_that_names_its_generation_is_given_back(stack, front, what):
    s = stack(proxy=False)
    for make in FLAVOURS:
        job = f"malformed-{make.__name__}"
        f = front(s.server_url, NAMED[what])
        refused, again = claim(make, f.url, job, times=2, release=True)
        assert isinstance(refused, ProtocolError), (what, make, refused)  # not GrantTooShort
        assert str(refused).endswith("(the grant of generation 1 is given back)"), refused
        given_back(s, f, job, f"/v1/leases/{job}/release", f"{what} ({make.__name__})")
        # Its key is not kept: asked again at once with it, before the release landed, the
        # claim would get the grant back and the release would then free the job under it.
        claims = f.requests("/claim")
        assert len(claims) == 2 and claims[1].body["lease_key"] != claims[0].body["lease_key"], \
            (what, make, "the given-back key was kept", again)
        assert isinstance(again, LeaseHeld) or again.generation == 2, (what, make, again)


def test_a_give_back_the_server_fails_to_answer_is_asked_again(stack, front):
    # No grant was taken, so the release is asked again within the TTL the claim asked for.
    s = stack(proxy=False)
    for make in FLAVOURS:
        job = f"retried-{make.__name__}"
        f = front(s.server_url, with_("ttl_ms", 0), failed_releases=1)
        [refused] = claim(make, f.url, job)
        assert isinstance(refused, ProtocolError) and "given back" in str(refused), refused
        wait_for(f"{job}: a second release", 5.0, lambda: len(f.requests("/release")) >= 2)
        given_back(s, f, job, f"/v1/leases/{job}/release", job)


NAMELESS = {
    "without a generation": with_("generation", DROP),
    "generation 0": with_("generation", 0),
    "generation -1": with_("generation", -1),
    "generation true": with_("generation", True),
    "not JSON": lambda answer: '{"job": ',
    "not a JSON object": lambda answer: "[1]",
    # Deeper than the interpreter's stack: json.loads raised RecursionError, which escaped the
    # client (no ProtocolError, and the key was not kept).
    "nested too deep": lambda answer: "[" * 100_000,
}


@pytest.mark.parametrize("what", list(NAMELESS))
def test_a_malformed_grant_without_a_generation_keeps_its_key_for_the_next_claim(stack, front,
                                                                                  what):
    s = stack(proxy=False)
    for make in FLAVOURS:
        job = f"nameless-{make.__name__}"
        f = front(s.server_url, NAMELESS[what])
        refused, lease = claim(make, f.url, job, times=2, release=True)
        assert isinstance(refused, ProtocolError), (what, make, refused)
        assert str(refused).endswith("is held until its TTL ends or this client's next claim of"
                                     " the job (asked with the same key) gets it back"), refused
        # Asked with the same key, the server gives that very lease back (another key: 409 held).
        claims = f.requests("/claim")
        assert len(claims) == 2 and claims[1].body["lease_key"] == claims[0].body["lease_key"], \
            (what, make, "the key was not kept", lease)
        assert not isinstance(lease, Exception) and lease.generation == 1, (what, make, lease)
        # The one release is the test's own, of the lease the second claim got.
        assert len(f.requests("/release")) == 1, (what, make, "a release without a generation")


def test_a_malformed_grant_of_a_semaphore_slot_is_given_back(stack, front):
    s = stack(proxy=False)
    for n, make in enumerate(FLAVOURS):
        resource = f"exports{n}"
        f = front(s.server_url, with_("ttl_ms", -5))

        async def claim_slot() -> BaseException:
            client = make(f.url, owner="worker", ttl=30.0)
            with pytest.raises(ProtocolError) as refused:
                if isinstance(client, AsyncClient):
                    await client.claim_slot(resource, 2)
                else:
                    await asyncio.to_thread(client.claim_slot, resource, 2)
            return refused.value

        refused = asyncio.run(claim_slot())
        assert str(refused).endswith("(the grant of generation 1 is given back)"), refused
        given_back(s, f, f"{resource}#1", f"/v1/leases/{resource}%231/release", make.__name__)


UNNAMED_SLOT = {
    "another slot": with_("slot", 3),
    "generation 0": with_("generation", 0),
    "not JSON": lambda answer: '{"job": ',
}


@pytest.mark.parametrize("what", list(UNNAMED_SLOT))
def test_a_slot_grant_that_names_no_slot_or_generation_is_held_and_keeps_no_key(stack, front,
                                                                                what):
    # Which slot's job, or which generation, is not known: no release can name the grant, and
    # no key is kept for a semaphore (each call claims under a key of its own).
    s = stack(proxy=False)
    for n, make in enumerate(FLAVOURS):
        resource = f"unnamed{n}"
        f = front(s.server_url, UNNAMED_SLOT[what])

        async def claim_slot() -> BaseException:
            client = make(f.url, owner="worker", ttl=30.0)
            with pytest.raises(ProtocolError) as refused:
                if isinstance(client, AsyncClient):
                    await client.claim_slot(resource, 2)
                else:
                    await asyncio.to_thread(client.claim_slot, resource, 2)
            assert client._unsettled == {}
            return refused.value

        refused = asyncio.run(claim_slot())
        assert str(refused).endswith("the lease it may stand for is held until its TTL ends"), \
            (what, refused)
        assert f.requests("/release") == [], (what, make.__name__)


def test_a_problem_nested_too_deep_is_a_problem_of_its_status():
    # Before, json.loads raised RecursionError out of the call: a release refused so replaced
    # the exception of the `with` block it ended (only FenceErrors are swallowed there).
    from fence_client import ProblemError
    from fence_client._errors import problem_error
    for body in (b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000):
        error = problem_error(409, {"Content-Type": "application/problem+json"}, body)
        assert isinstance(error, ProblemError) and error.status == 409, error
        assert error.type == "about:blank", error


def test_a_renewal_answer_must_name_the_generation_as_a_number():
    # JSON true equals 1 in Python: a renewal answer of generation true is no grant of 1.
    from fence_client._wire import grant_token
    good = {"generation": 1, "ttl_ms": 1000, "expires_at_ms": 5}
    assert grant_token("j", 1, good) == ("1", 1000, 5)
    with pytest.raises(ProtocolError):
        grant_token("j", 1, {**good, "generation": True})


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_loss_at_the_deadline_says_why_the_renewals_failed(stack, front, flavour):
    # A renewal answered 401 (a rotated secret) is retried until the deadline; the loss's
    # reason then names the 401, not the later attempts that got no answer.
    s = stack(proxy=False)
    f = front(s.server_url, lambda answer: json.dumps(answer), refuse_renewals=True)

    async def run() -> str:
        client = flavour(f.url, ttl=1.0)
        if flavour is AsyncClient:
            lease = await client.claim("renewals-refused")
            await asyncio.wait_for(lease.lost.wait(), 5)
        else:
            lease = client.claim("renewals-refused")
            assert lease.lost.wait(5), "the lease was not lost"
        reason = lease.loss_reason
        assert reason is not None
        return reason

    reason = asyncio.run(run())
    assert reason.startswith("the local deadline passed before a renewal succeeded"), reason
    assert "401" in reason and "no such secret" in reason, reason
    assert len(f.requests("/renew")) >= 1


def test_an_asyncio_claim_cancelled_before_its_answer_keeps_its_key(stack, front):
    # The caller's timeout (asyncio.wait_for, a TaskGroup) cancels the claim, but its request
    # went out and was granted: the next claim asks with the same key and gets that lease back.
    # Before, the key was dropped, and the job stayed held, by this very owner, until its TTL
    # ended; the key kept from an earlier cancelled claim was dropped by the next one too.
    s = stack(proxy=False)

    def late(answer: Dict[str, Any]) -> str:
        time.sleep(1.0)
        return json.dumps(answer)

    f = front(s.server_url, late, mangled=2)

    async def claims() -> None:
        client = AsyncClient(f.url, owner="worker", ttl=30.0)
        for _ in range(2):  # both answers come after the caller gave up
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(client.claim("cancelled"), 0.3)
        lease = await client.claim("cancelled")
        assert lease.generation == 1, lease
        await lease.release()

    asyncio.run(claims())
    keys = {r.body["lease_key"] for r in f.requests("/claim")}
    assert len(f.requests("/claim")) == 3 and len(keys) == 1, keys
