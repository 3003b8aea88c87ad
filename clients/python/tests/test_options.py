"""Auth, TLS, waiting claims, refusals as exceptions, derived idempotency keys."""

from __future__ import annotations

import asyncio
import http.server
import subprocess
import threading
import time

import pytest

from conftest import fence_bin, raw
from fence_client import (Client, JobCompleted, LeaseHeld, LeaseLost, LockDelay, ProblemError,
                          ServerUnreachable, idempotency_key)
from fence_client.aio import AsyncClient
from fence_client._lease import DEADLINE_PASSED
from fence_client._wire import monotonic

SECRET = "s3cret-s3cret-s3cret"


def test_bearer_token_and_ca_file(stack, tmp_path, monkeypatch):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    auth = tmp_path / "auth"
    auth.write_text(f"workers {SECRET} tls-*\n")
    auth.chmod(0o600)
    token_file = tmp_path / "token"
    token_file.write_text(f"  {SECRET}\n")
    s = stack(proxy=False, scheme="https", server_args=[
        "--tls-cert", str(cert), "--tls-key", str(key), "--auth-file", str(auth)])
    monkeypatch.delenv("FENCE_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("FENCE_CA_CERT", raising=False)

    with Client(s.server_url, auth_token=SECRET, ca_file=cert, ttl=1.0).claim("tls-1") as lease:
        assert lease.generation == 1
    with Client(s.server_url, auth_token_file=token_file, ca_file=cert).claim("tls-2"):
        pass
    # An environment variable's trailing newline (a Kubernetes secret's) is no part of it.
    monkeypatch.setenv("FENCE_AUTH_TOKEN", SECRET + "\n")
    monkeypatch.setenv("FENCE_CA_CERT", str(cert))
    with Client(s.server_url).claim("tls-3"):
        pass
    assert Client(s.server_url).status("tls-3")["state"] == "completed"
    with pytest.raises(ProblemError) as forbidden:
        Client(s.server_url).claim("other-job")
    assert (forbidden.value.status, forbidden.value.type) == (403, "urn:fence:forbidden")
    monkeypatch.delenv("FENCE_AUTH_TOKEN")
    # One a header cannot carry is refused at once, and never repeated in the error.
    for bad in (SECRET + "\x01", SECRET[:8] + " " + SECRET[8:]):
        with pytest.raises(ValueError) as refused:
            Client(s.server_url, auth_token=bad)
        assert "auth_token" in str(refused.value) and SECRET[:8] not in str(refused.value)
    with pytest.raises(ProblemError) as unauthenticated:
        Client(s.server_url, ca_file=cert).claim("tls-4")
    assert unauthenticated.value.status == 401
    assert unauthenticated.value.type == "urn:fence:unauthenticated"
    monkeypatch.delenv("FENCE_CA_CERT")
    with pytest.raises(ServerUnreachable) as untrusted:  # the system roots do not know it
        Client(s.server_url, auth_token=SECRET).claim("tls-5")
    assert "CERTIFICATE_VERIFY_FAILED" in str(untrusted.value)


def test_waiting_claim_and_refusals(stack):
    s = stack(proxy=False)
    holder = Client(s.server_url, owner="holder", ttl=1.0)
    waiter = Client(s.server_url, owner="waiter", ttl=1.5)
    held = holder.claim("wait-job")
    held.abandon()  # stops renewing: the lease runs out at the server in about a second
    with pytest.raises(LeaseHeld) as refused:
        waiter.claim("wait-job")
    assert (refused.value.status, refused.value.type) == (409, "urn:fence:lease-held")
    assert refused.value.owner == "holder" and 0 < refused.value.expires_in_ms <= 1000
    started = monotonic()
    lease = waiter.claim("wait-job", wait=5.0)
    took = monotonic() - started
    assert lease.generation == 2 and 0.5 < took < 2.0, took
    # It waited most of a second of its 1.35 s of usable time: renewed at once, so the
    # deadline counts from that renewal, not from the claim sent a second ago.
    assert lease.deadline - monotonic() > 0.9, lease.deadline - monotonic()
    lease.complete()
    with pytest.raises(JobCompleted) as completed:
        waiter.claim("wait-job", wait=1.0)
    assert (completed.value.status, completed.value.generation) == (410, 2)
    with pytest.raises(ProblemError) as unknown:
        waiter.status("never-claimed")
    assert (unknown.value.status, unknown.value.type) == (404, "urn:fence:unknown-job")


def test_lock_delay_keeps_an_expired_job_and_a_waiting_claim_waits_it_out(stack):
    s = stack(proxy=False)
    stalled = Client(s.server_url, owner="stalled", ttl=1.0, lock_delay=2.0).claim("delayed")
    stalled.abandon()  # the lease expires in about a second; its 2 s delay follows
    time.sleep(1.2)
    nxt = Client(s.server_url, owner="next", ttl=5.0)
    with pytest.raises(LockDelay) as refused:
        nxt.claim("delayed")
    assert isinstance(refused.value, LeaseHeld)  # code that handles a held job handles this
    assert (refused.value.status, refused.value.type) == (409, "urn:fence:lock-delay")
    assert refused.value.owner == "stalled" and refused.value.generation == 1
    assert 1000 <= refused.value.claimable_in_ms <= 2000, refused.value.problem
    assert refused.value.retry_after in (1, 2)
    started = monotonic()
    lease = nxt.claim("delayed", wait=5.0)
    assert lease.generation == 2 and monotonic() - started > 0.8
    lease.release()
    # A claim's own lock-delay beats the client's; 0 means none.
    quick = Client(s.server_url, owner="quick", ttl=1.0, lock_delay=3600.0)
    quick.claim("own-zero", lock_delay=0).abandon()
    time.sleep(1.2)
    nxt.claim("own-zero").release()
    with pytest.raises(ValueError):
        Client(s.server_url, lock_delay=-1)

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="async", ttl=1.0, lock_delay=2.0)
        (await aclient.claim("async-delayed")).abandon()
        await asyncio.sleep(1.2)
        with pytest.raises(LockDelay):
            await AsyncClient(s.server_url, owner="other").claim("async-delayed")

    asyncio.run(from_asyncio())


def finishes_answered(server_url: str) -> int:
    """How many releases and completions reached the server (any answer), from its /metrics."""
    status, text = raw("GET", server_url + "/metrics")
    assert status == 200 and "fence_lease_requests_total" in text, text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("fence_lease_requests_total{")
               and ('op="release"' in line or 'op="complete"' in line))


def assert_left_to_expire(server_url: str, job: str) -> None:
    """``job``'s lease (owner ``a``) was neither released nor completed: another owner's claim
    is refused (held while the lease runs, then its lock-delay, never granted), and the server
    answered no release or completion at all."""
    b = Client(server_url, owner="b", ttl=10.0)
    with pytest.raises(LeaseHeld) as refused:
        b.claim(job)
    assert refused.value.type in ("urn:fence:lease-held", "urn:fence:lock-delay"), job
    assert refused.value.owner == "a", refused.value.problem
    assert b.status(job)["state"] in ("held", "expired"), job
    assert finishes_answered(server_url) == 0, job


def test_a_lease_abandoned_inside_with_is_neither_released_nor_completed(stack):
    # Seen against `fence server --lock-delay 30s`: a block that abandoned its lease after a
    # write that may still land (a timeout, a 504), then raised, had the lease released on
    # exit, so the next claim was granted at once and the lock-delay never applied.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    a = Client(s.server_url, owner="a", ttl=10.0)

    def left_to_expire(job: str) -> None:
        assert_left_to_expire(s.server_url, job)

    with pytest.raises(TimeoutError):
        with a.claim("raises") as lease:
            lease.abandon()
            raise TimeoutError("the write may still land")
    left_to_expire("raises")
    with a.claim("returns") as lease:  # a clean exit: no completion, and no LeaseLost
        lease.abandon()
    left_to_expire("returns")
    with a.claim("returns-release", on_success="release") as lease:
        lease.abandon()
    left_to_expire("returns-release")

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="a", ttl=10.0)
        with pytest.raises(TimeoutError):
            async with aclient.claim("async-raises") as alease:
                alease.abandon()
                raise TimeoutError("the write may still land")
        left_to_expire("async-raises")
        async with aclient.claim("async-returns") as alease:
            alease.abandon()
        left_to_expire("async-returns")

    asyncio.run(from_asyncio())
    a.claim("counted").release()  # the count sees one when there is one
    assert finishes_answered(s.server_url) == 1


def test_a_release_or_completion_by_hand_after_abandon_sends_nothing(stack):
    # A `finally: lease.release()` written before the abandon of a write that may still land
    # sent the release: the next claim was granted at once, skipping the lock-delay.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    a = Client(s.server_url, owner="a", ttl=10.0)

    def refused_unsent(lost: pytest.ExceptionInfo, job: str) -> None:
        assert type(lost.value) is LeaseLost, repr(lost.value)  # not the server's LeaseRefused
        assert "abandoned" in lost.value.reason and "lock-delay" in lost.value.reason, job
        assert "nothing was sent" in lost.value.reason, job

    for action in ("release", "complete"):
        job = f"by-hand-{action}"
        with pytest.raises(LeaseLost) as lost:
            lease = a.claim(job)
            try:
                lease.abandon()
                raise TimeoutError("the write may still land")
            except TimeoutError:
                lease.abandon()  # idempotent
            finally:
                getattr(lease, action)()
        refused_unsent(lost, job)
        with pytest.raises(LeaseLost):  # asked again: still nothing sent
            getattr(lease, action)()
        assert_left_to_expire(s.server_url, job)

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="a", ttl=10.0)
        for action in ("release", "complete"):
            job = f"async-by-hand-{action}"
            alease = await aclient.claim(job)
            alease.abandon()
            with pytest.raises(LeaseLost) as lost:
                await getattr(alease, action)()
            refused_unsent(lost, job)
            assert_left_to_expire(s.server_url, job)

    asyncio.run(from_asyncio())
    # Abandon after a release changes nothing: the release was sent, and is not undone.
    released = a.claim("released-then-abandoned")
    released.release()
    released.abandon()
    assert finishes_answered(s.server_url) == 1
    assert a.status("released-then-abandoned")["state"] == "free"


def fail_renewals(lease) -> None:
    """From now on every renewal of ``lease`` fails unanswered: it is lost at its deadline."""
    def unanswered(timeout: float):
        raise ServerUnreachable("the server is out of reach (the test)")

    lease._send_renew = unanswered


def test_a_lease_lost_inside_with_is_neither_released_nor_completed(stack):
    # Seen against `fence server --lock-delay 30s`: the keeper declared the lease lost (no
    # progress, or the local deadline) while a write to an unfenced upstream was on its way;
    # the exit released it, the server took the release (nobody had claimed since), and the
    # next claim was granted at once while the write committed seconds later.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    stalls = Client(s.server_url, owner="a", ttl=1.0, progress_within=0.3)
    a = Client(s.server_url, owner="a", ttl=1.0)

    with pytest.raises(LeaseLost) as lost:  # a clean exit: LeaseLost, nothing sent
        with stalls.claim("no-progress") as lease:
            assert lease.lost.wait(10.0), "no progress reported, still held"
    assert type(lost.value) is LeaseLost and "no progress" in lost.value.reason, lost.value
    assert_left_to_expire(s.server_url, "no-progress")
    with pytest.raises(LeaseLost) as lost:
        with stalls.claim("no-progress-release", on_success="release") as lease:
            assert lease.lost.wait(10.0)
    assert "no progress" in lost.value.reason, lost.value
    assert_left_to_expire(s.server_url, "no-progress-release")
    with pytest.raises(TimeoutError):  # the block's own exception, nothing sent
        with a.claim("deadline-raises") as lease:
            fail_renewals(lease)
            assert lease.lost.wait(10.0), "renewals fail, still held"
            raise TimeoutError("the write cut by the loss may still land")
    assert lease.loss_reason.startswith(DEADLINE_PASSED), lease.loss_reason
    assert_left_to_expire(s.server_url, "deadline-raises")
    with pytest.raises(LeaseLost):  # a semaphore slot, released on exit when held
        with stalls.claim_slot("pool", 1) as lease:
            assert lease.lost.wait(10.0)
    with pytest.raises(LeaseHeld) as slot_refused:
        Client(s.server_url, owner="b", ttl=10.0).claim_slot("pool", 1)
    assert slot_refused.value.type in ("urn:fence:lease-held", "urn:fence:lock-delay")
    assert finishes_answered(s.server_url) == 0

    async def from_asyncio() -> None:
        astalls = AsyncClient(s.server_url, owner="a", ttl=1.0, progress_within=0.3)
        with pytest.raises(LeaseLost) as alost:
            async with astalls.claim("async-no-progress") as alease:
                await asyncio.wait_for(alease.lost.wait(), 10.0)
        assert "no progress" in alost.value.reason, alost.value
        assert_left_to_expire(s.server_url, "async-no-progress")
        aclient = AsyncClient(s.server_url, owner="a", ttl=1.0)
        with pytest.raises(TimeoutError):
            async with aclient.claim("async-deadline-raises") as alease:
                fail_renewals(alease)
                await asyncio.wait_for(alease.lost.wait(), 10.0)
                raise TimeoutError("the write cut by the loss may still land")
        assert_left_to_expire(s.server_url, "async-deadline-raises")
        with pytest.raises(LeaseLost):
            async with astalls.claim_slot("apool", 1) as alease:
                await asyncio.wait_for(alease.lost.wait(), 10.0)
        with pytest.raises(LeaseHeld):
            await AsyncClient(s.server_url, owner="b", ttl=10.0).claim_slot("apool", 1)
        assert finishes_answered(s.server_url) == 0

    asyncio.run(from_asyncio())


def test_a_release_by_hand_after_a_local_loss_sends_nothing(stack):
    # A `finally: lease.release()` after the keeper declared the lease lost sent the release,
    # which the server took (nobody had claimed since): the lock-delay was skipped.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    stalls = Client(s.server_url, owner="a", ttl=1.0, progress_within=0.3)
    a = Client(s.server_url, owner="a", ttl=1.0)

    def refused_unsent(lost: pytest.ExceptionInfo, why: str) -> None:
        assert type(lost.value) is LeaseLost, repr(lost.value)  # not the server's LeaseRefused
        reason = lost.value.reason
        assert why in reason and "left to expire" in reason, reason
        assert "lock-delay" in reason and "nothing was sent" in reason, reason

    lease = stalls.claim("no-progress")
    assert lease.lost.wait(10.0)
    with pytest.raises(LeaseLost) as lost:
        lease.release()
    refused_unsent(lost, "no progress")
    with pytest.raises(LeaseLost) as lost:  # asked again: still nothing sent
        lease.release()
    refused_unsent(lost, "no progress")
    assert_left_to_expire(s.server_url, "no-progress")
    lease = a.claim("deadline")
    fail_renewals(lease)
    assert lease.lost.wait(10.0)
    with pytest.raises(LeaseLost) as lost:
        lease.release()
    refused_unsent(lost, DEADLINE_PASSED)
    assert_left_to_expire(s.server_url, "deadline")

    async def from_asyncio() -> None:
        alease = await AsyncClient(s.server_url, owner="a", ttl=1.0,
                                   progress_within=0.3).claim("async-no-progress")
        await asyncio.wait_for(alease.lost.wait(), 10.0)
        with pytest.raises(LeaseLost) as alost:
            await alease.release()
        refused_unsent(alost, "no progress")
        assert_left_to_expire(s.server_url, "async-no-progress")

    asyncio.run(from_asyncio())
    # A completion after a loss is still sent: nobody can claim a completed job. (The lease
    # is still this owner's at the server, so it takes it.)
    lease = stalls.claim("completed-after-loss")
    assert lease.lost.wait(10.0)
    assert lease.complete()["state"] == "completed"
    assert finishes_answered(s.server_url) == 1
    with pytest.raises(LeaseLost) as lost:  # and a release after it is not sent either
        lease.release()
    refused_unsent(lost, "no progress")
    assert finishes_answered(s.server_url) == 1


def record_finishes(lease) -> list:
    """The releases and completions ``lease`` sends from now on (the path's last part)."""
    sent: list = []
    transport = lease._transport

    class Recording:
        def call(self, method, path, *args, **kwargs):
            if path.endswith(("/release", "/complete")):
                sent.append(path.rsplit("/", 1)[1])
            return transport.call(method, path, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(transport, name)

    lease._transport = Recording()
    return sent


def stop_keeper_past_deadline(lease) -> None:
    """Stops ``lease``'s keeper thread without a word, then waits past the local deadline: the
    deadline has passed, and nothing has declared the lease lost yet."""
    lease._finished.set()
    lease._keeper.join(5.0)
    assert not lease._keeper.is_alive()
    time.sleep(max(lease.deadline - monotonic(), 0.0) + 0.02)
    assert lease.loss_reason is None and not lease.lost.is_set()


def assert_slot_left_to_expire(server_url: str, resource: str) -> None:
    """The only slot of ``resource`` (held by owner ``a``) was neither released nor completed:
    another owner's claim of it is refused, and the server answered no release or completion."""
    with pytest.raises(LeaseHeld) as refused:
        Client(server_url, owner="b", ttl=10.0).claim_slot(resource, 1)
    assert refused.value.type in ("urn:fence:lease-held", "urn:fence:lock-delay"), resource
    assert refused.value.owner == "a", refused.value.problem
    assert finishes_answered(server_url) == 0, resource


def test_a_slot_completion_by_hand_after_a_local_loss_sends_nothing(stack):
    # The server takes a slot's completion as a release (the slot is freed at once): sent after
    # a loss here, it let the next claimer in beside a write cut by the loss, skipping the
    # lock-delay, as a release by hand did.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    stalls = Client(s.server_url, owner="a", ttl=1.0, progress_within=0.3)
    a = Client(s.server_url, owner="a", ttl=1.0)

    def refused_unsent(lost: pytest.ExceptionInfo, why: str) -> None:
        assert type(lost.value) is LeaseLost, repr(lost.value)  # not the server's LeaseRefused
        reason = lost.value.reason
        assert why in reason and "left to expire" in reason, reason
        assert "nothing was sent" in reason, reason

    lease = stalls.claim_slot("stalled", 1)
    sent = record_finishes(lease)
    assert lease.lost.wait(10.0), "no progress reported, still held"
    with pytest.raises(LeaseLost) as lost:
        lease.complete()
    refused_unsent(lost, "no progress")
    with pytest.raises(LeaseLost) as lost:  # asked again: still nothing sent
        lease.complete()
    refused_unsent(lost, "no progress")
    assert sent == []
    assert_slot_left_to_expire(s.server_url, "stalled")
    # The local deadline passed, the keeper has not said it yet: refused all the same.
    lease = a.claim_slot("masked", 1)
    sent = record_finishes(lease)
    stop_keeper_past_deadline(lease)
    with pytest.raises(LeaseLost) as lost:
        lease.complete()
    refused_unsent(lost, DEADLINE_PASSED)
    assert sent == [] and lease.loss_reason == DEADLINE_PASSED
    assert_slot_left_to_expire(s.server_url, "masked")
    lease = a.claim_slot("abandoned", 1)
    lease.abandon()
    with pytest.raises(LeaseLost) as lost:
        lease.complete()
    assert "abandoned" in lost.value.reason and "nothing was sent" in lost.value.reason
    assert_slot_left_to_expire(s.server_url, "abandoned")

    async def from_asyncio() -> None:
        astalls = AsyncClient(s.server_url, owner="a", ttl=1.0, progress_within=0.3)
        alease = await astalls.claim_slot("async-stalled", 1)
        asent = record_finishes(alease)
        await asyncio.wait_for(alease.lost.wait(), 10.0)
        with pytest.raises(LeaseLost) as alost:
            await alease.complete()
        refused_unsent(alost, "no progress")
        assert asent == []
        assert_slot_left_to_expire(s.server_url, "async-stalled")
        alease = await AsyncClient(s.server_url, owner="a", ttl=1.0).claim_slot("async-masked", 1)
        asent = record_finishes(alease)
        # The loop blocked past the deadline: the keeper task cannot run to notice it.
        time.sleep(max(alease.deadline - monotonic(), 0.0) + 0.02)
        assert alease.loss_reason is None
        with pytest.raises(LeaseLost) as alost:
            await alease.complete()
        refused_unsent(alost, DEADLINE_PASSED)
        assert asent == []
        assert_slot_left_to_expire(s.server_url, "async-masked")

    asyncio.run(from_asyncio())


def test_a_failed_completion_past_the_deadline_lets_no_release_out(stack):
    # complete() called once the local deadline had passed, before the keeper noticed, marked
    # the lease "finished", hiding the loss; when the completion then failed unapplied (a
    # server blip), a `finally: lease.release()` was sent, and a server that took it let the
    # next holder in at once, skipping the lock-delay.
    s = stack(proxy=False, server_args=["--lock-delay", "30s"])
    lease = Client(s.server_url, owner="a", ttl=1.0).claim("masked")
    sent = record_finishes(lease)
    stop_keeper_past_deadline(lease)
    s.server.kill()  # the completion fails, not applied
    with pytest.raises(ServerUnreachable):
        lease.complete()  # a plain job's completion is still sent after a loss
    assert sent and set(sent) == {"complete"}, sent
    assert lease.loss_reason == DEADLINE_PASSED, lease.loss_reason  # not "finished"
    assert lease.lost.is_set()
    with pytest.raises(LeaseLost) as lost:
        lease.release()
    assert type(lost.value) is LeaseLost, repr(lost.value)
    assert DEADLINE_PASSED in lost.value.reason and "nothing was sent" in lost.value.reason
    assert set(sent) == {"complete"}, sent

    async def from_asyncio() -> None:
        s2 = stack(proxy=False, server_args=["--lock-delay", "30s"])
        alease = await AsyncClient(s2.server_url, owner="a", ttl=1.0).claim("async-masked")
        asent = record_finishes(alease)
        # The loop blocked past the deadline: the keeper task cannot run to notice it.
        time.sleep(max(alease.deadline - monotonic(), 0.0) + 0.02)
        s2.server.kill()
        assert alease.loss_reason is None
        with pytest.raises(ServerUnreachable):
            await alease.complete()
        assert asent and set(asent) == {"complete"}, asent
        assert alease.loss_reason == DEADLINE_PASSED, alease.loss_reason
        with pytest.raises(LeaseLost) as alost:
            await alease.release()
        assert DEADLINE_PASSED in alost.value.reason and "nothing was sent" in alost.value.reason
        assert set(asent) == {"complete"}, asent

    asyncio.run(from_asyncio())


def test_a_worker_that_stops_reporting_progress_loses_its_lease(stack):
    s = stack(proxy=False)
    client = Client(s.server_url, owner="bound", ttl=0.9, progress_within=0.6)
    lease = client.claim("bound-job")
    for _ in range(10):  # 2 s of steady progress: renewed every 300 ms
        time.sleep(0.2)
        lease.progress()
    assert not lease.is_lost()
    assert lease.lost.wait(2.0), "still held 2 s after the last progress"
    assert "no progress" in (lease.loss_reason or "")
    # Not released: still held at the server until it expires.
    assert client.status("bound-job")["state"] == "held"
    with pytest.raises(ValueError):
        Client(s.server_url, progress_within=0)


def test_a_checkpoint_goes_to_the_next_holder_and_a_stale_save_is_refused(stack):
    s = stack(proxy=False)
    first = Client(s.server_url, owner="first", ttl=1.0).claim("resumable")
    assert first.checkpoint is None
    record = first.save_checkpoint("rows 0-999 done")
    assert record["generation"] == 1
    with pytest.raises(ProblemError) as big:
        first.save_checkpoint("x" * 8193)
    assert (big.value.status, big.value.type) == (413, "urn:fence:payload-too-large")
    first.abandon()  # stops renewing: the lease runs out at the server
    time.sleep(1.2)
    second = Client(s.server_url, owner="second").claim("resumable")
    assert second.checkpoint == {"generation": 1, "data": "rows 0-999 done"}
    with pytest.raises(LeaseLost):  # lost here already: nothing is sent
        first.save_checkpoint("rows 0-1999 done")
    second.save_checkpoint("rows 0-2999 done")
    second.release()

    async def from_asyncio() -> None:
        lease = await AsyncClient(s.server_url, owner="third").claim("resumable")
        assert lease.checkpoint == {"generation": 2, "data": "rows 0-2999 done"}
        await lease.save_checkpoint("all done")
        await lease.complete()

    asyncio.run(from_asyncio())


def test_renewals_follow_a_shorter_grant(stack):
    s = stack(proxy=False, server_args=["--max-ttl", "600ms"])
    lease = Client(s.server_url, ttl=30.0).claim("capped")
    assert lease.ttl == 0.6
    assert lease.deadline - monotonic() < 0.6  # counted from the grant, not from what was asked
    time.sleep(1.0)  # renewed every 200 ms, not every 10 s
    assert not lease.is_lost()
    lease.release()


def test_a_fixed_margin_that_takes_most_of_a_capped_grant_still_renews_in_time(stack):
    # 30 s asked, 2 s granted, 1.5 s margin: the deadline is 0.5 s after each send, before a
    # third of the grant; renewals come halfway to it.
    s = stack(proxy=False, server_args=["--max-ttl", "2s"])
    lease = Client(s.server_url, ttl=30.0, margin=1.5).claim("capped-margin")
    time.sleep(2.0)
    assert not lease.is_lost(), lease.loss_reason
    lease.release()


def test_idempotency_key_matches_the_binary():
    out = subprocess.run([fence_bin(), "idempotency-key", "--job", "invoice-42", "--step",
                          "charge"], check=True, capture_output=True, text=True).stdout.strip()
    assert idempotency_key("invoice-42", "charge") == out


def test_timing_options_are_checked():
    with pytest.raises(ValueError):
        Client("http://127.0.0.1:9", ttl=0.05)
    with pytest.raises(ValueError):
        Client("http://127.0.0.1:9", ttl=1.0, margin=1.0)
    with pytest.raises(ValueError):
        Client("127.0.0.1:7700")


def test_a_server_url_with_a_user_or_password_is_refused_without_quoting_them():
    # The server takes bearer secrets only, and the server URL is quoted in error messages.
    for url in ("http://alice:hunter2-pw@127.0.0.1:7700", "https://alice@fence.example/",
                "http://alice:pa/hunter2-pw@127.0.0.1:7700"):
        for make in (Client, AsyncClient):
            with pytest.raises(ValueError) as refused:
                make(url)
            message = str(refused.value)
            assert "user or password" in message and "auth_token" in message, message
            assert "hunter2" not in message and "alice" not in message, message
    # A URL refused for its scheme is quoted without what it carries before an '@'.
    for url in ("ftp://alice:hunter2-pw@127.0.0.1:7700", "alice:hunter2-pw@127.0.0.1:7700",
                "ftp://alice:pa/hunter2-pw@127.0.0.1:7700/x"):
        with pytest.raises(ValueError) as refused:
            Client(url)
        message = str(refused.value)
        assert "must start with http:// or https://" in message and "127.0.0.1:7700" in message, message
        assert "hunter2" not in message and "alice" not in message, message


def lose_first_claim_answer(client, monkeypatch, lost_as: Exception) -> list:
    """The first claim reaches the server and is decided, but ``lost_as`` is raised instead of
    its answer: the answers lost, for the test."""
    real = client._transport.call
    lost: list = []

    def losing(method, path, body=None, timeout=None):
        answer = real(method, path, body, timeout=timeout)
        if path.startswith("/v1/leases/") and "/claim" in path and not lost:
            lost.append(answer)
            raise lost_as
        return answer

    monkeypatch.setattr(client._transport, "call", losing)
    return lost


@pytest.mark.parametrize("lost_as", [
    ServerUnreachable("the answer was lost on its way back"),
    ProblemError({"type": "urn:fence:store-unavailable", "status": 503,
                  "detail": "the store did not confirm the decision within 5 s"}, 503),
    ProblemError({"type": "about:blank", "status": 502, "detail": "bad gateway"}, 502),
], ids=["unreachable", "503", "502 of a gateway"])
def test_a_claim_after_one_whose_answer_was_lost_gets_that_lease_back(stack, monkeypatch,
                                                                        lost_as):
    # Asked again with a new key, the job would be held (by this owner) for the whole TTL.
    s = stack(proxy=False)
    client = Client(s.server_url, owner="lossy", ttl=30.0)
    lost = lose_first_claim_answer(client, monkeypatch, lost_as)
    with pytest.raises(type(lost_as)):
        client.claim("lossy")
    lease = client.claim("lossy")
    assert lease.generation == lost[0]["generation"] == 1
    lease.release()
    assert client.claim("lossy").generation == 2  # settled: a claim like any other

    async def from_asyncio() -> None:
        aclient = AsyncClient(s.server_url, owner="lossy-async", ttl=30.0)
        lost = lose_first_claim_answer(aclient, monkeypatch, lost_as)
        with pytest.raises(type(lost_as)):
            await aclient.claim("alossy")
        lease = await aclient.claim("alossy")
        assert lease.generation == lost[0]["generation"] == 1
        await lease.release()

    asyncio.run(from_asyncio())


class _Recorder:
    """An HTTP server that answers every request with ``status`` and ``headers`` and records
    the method, path and Authorization header of each."""

    def __init__(self, status: int, headers: dict) -> None:
        self.seen: list = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("content-length") or 0))
                outer.seen.append((self.command, self.path, self.headers.get("authorization")))
                body = b'{"state": "completed"}'
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_an_error_and_the_secret_stays_home(status):
    # urllib follows redirects by default, copying the Authorization header to wherever the
    # Location points and turning a POST into a GET; the client must do neither.
    elsewhere = _Recorder(200, {})
    front = _Recorder(status, {"location": elsewhere.url + "/v1/leases/stolen"})
    try:
        client = Client(front.url, auth_token=SECRET, timeout=5.0)
        with pytest.raises(ProblemError) as claim:
            client.claim("redirected")
        assert claim.value.status == status
        with pytest.raises(ProblemError) as status_call:
            client.status("redirected")
        assert status_call.value.status == status
        assert [m for m, _, _ in front.seen] == ["POST", "GET"]
        assert front.seen[0][2] == f"Bearer {SECRET}"
        assert elsewhere.seen == [], "the redirect was followed, with the bearer secret"
    finally:
        front.close()
        elsewhere.close()


def closed_port_url() -> str:
    """The URL of a loopback port nothing listens on (a connection is refused)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


class Hangup:
    """A server that accepts each connection, reads the request and closes it unanswered."""

    def __init__(self) -> None:
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                self.requests += 1

    def close(self) -> None:
        self.sock.close()


def test_a_list_of_servers_moves_on_only_from_one_it_could_not_connect_to(stack, monkeypatch):
    # FENCE_SERVER may name several servers that share one database (`fence run --server
    # http://a:7700,http://b:7700` passes it on as is); before, the whole list was taken for
    # one URL and every call failed.
    s = stack(proxy=False)
    down = closed_port_url()
    monkeypatch.setenv("FENCE_SERVER", f"{down}, {s.server_url}/")
    client = Client(owner="listed", ttl=1.0)
    with client.claim("listed") as lease:
        time.sleep(1.2)  # renewed through the server that answered
        assert not lease.is_lost(), lease.loss_reason
    assert client.server == f"{down},{s.server_url}"
    assert Client(s.server_url).status("listed")["state"] == "completed"

    async def from_asyncio() -> None:
        lease = await AsyncClient(owner="alisted", ttl=5.0).claim("alisted")
        await lease.release()

    asyncio.run(from_asyncio())
    # A server that took the request and did not answer may have decided it: the next one is
    # never asked.
    hangup = Hangup()
    try:
        with pytest.raises(ServerUnreachable) as unanswered:
            Client(f"{hangup.url},{s.server_url}", owner="listed").claim("unanswered")
        assert hangup.url in str(unanswered.value), unanswered.value
        assert hangup.requests == 1
        with pytest.raises(ProblemError) as unknown:
            Client(s.server_url).status("unanswered")
        assert unknown.value.status == 404
    finally:
        hangup.close()
    # None answering: the last one's failure, named.
    with pytest.raises(ServerUnreachable) as unreachable:
        Client(f"{closed_port_url()},{down}").status("x")
    assert down in str(unreachable.value)
    with pytest.raises(ValueError) as refused:
        Client(f"{s.server_url},127.0.0.1:7700")
    assert "must start with http:// or https://" in str(refused.value)


def test_a_claim_ttl_no_longer_than_the_margin_is_refused_before_sending(stack):
    # Before, such a claim was sent with a negative time budget (clamped to 1 ms): the caller
    # saw ServerUnreachable while the server granted the job to this owner, held unused.
    s = stack(proxy=False)
    client = Client(s.server_url, owner="short", ttl=10.0, margin=2.0)
    aclient = AsyncClient(s.server_url, owner="ashort", ttl=10.0, margin=2.0)
    for ttl in (1.0, 2.0):
        with pytest.raises(ValueError, match="margin"):
            client.claim("short", ttl=ttl)
        with pytest.raises(ValueError, match="margin"):
            client.claim_slot("shorts", 2, ttl=ttl)
        with pytest.raises(ValueError, match="margin"):
            aclient.claim("ashort", ttl=ttl)
        with pytest.raises(ValueError, match="margin"):
            aclient.claim_slot("ashorts", 2, ttl=ttl)
    for job in ("short", "shorts#1", "ashort", "ashorts#1"):
        with pytest.raises(ProblemError) as unknown:
            client.status(job)
        assert unknown.value.status == 404, (job, unknown.value)
    client.claim("short", ttl=2.1).release()  # longer than the margin: claimed
