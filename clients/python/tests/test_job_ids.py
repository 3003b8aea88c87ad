"""Job ids that need percent-encoding round-trip through claim, status, the proxy and a revoke
(whose refused renewal must fire the lost signal); ids outside visible ASCII never leave. A '#'
is a semaphore slot's (`<resource>#<slot>`): the slot of resource `a?b` is one of the ids."""

from __future__ import annotations

import httpx
import pytest

from conftest import raw
from fence_client import Client, InvalidJobId, LeaseLost, encode_job
from fence_client.httpx import FenceAuth

IDS = ["a/b", "a%b", "a?b", "a+b", "a%2Fb", "..", ".", "~x_y-z.", "\"'\\<>{}|^`!$&()*,;=:@["]


def test_job_ids_round_trip(stack):
    s = stack()
    client = Client(s.server_url, owner="ids", ttl=1.0)
    leases = {job: client.claim(job) for job in IDS}
    slot = client.claim_slot("a?b", 1)
    leases[slot.job] = slot
    assert list(leases)[-1] == "a?b#1"
    with httpx.Client() as http:
        for job, lease in leases.items():
            assert lease.job == job and lease.generation == 1
            assert client.status(job)["job"] == job
            status, record = raw("GET", f"{s.server_url}/v1/leases/{encode_job(job)}")
            assert (status, record["job"], record["state"]) == (200, job, "held"), record
            r = http.post(f"{s.proxy_url}/w", content=job, auth=FenceAuth(lease))
            assert r.status_code == 200, r.text
    assert [(w.job, w.body) for w in s.upstream.seen] == [(job, job) for job in leases]
    # An operator takes each lease away: the next renewal is refused, and the lease is lost.
    for job in leases:
        status, record = raw("POST", f"{s.server_url}/v1/leases/{encode_job(job)}/revoke")
        assert (status, record["job"], record["generation"]) == (200, job, 2), record
    for job, lease in leases.items():
        assert lease.lost.wait(2.0), f"{job}: the refused renewal fires the lost signal"
        assert "urn:fence:lease-lost" in (lease.loss_reason or ""), lease.loss_reason
        with pytest.raises(LeaseLost):
            httpx.post(f"{s.proxy_url}/w", content="late", auth=FenceAuth(lease))
    assert len(s.upstream.seen) == len(leases)


def test_encoding_is_exactly_the_unreserved_set():
    assert encode_job("a/b") == "a%2Fb"
    assert encode_job("a%b") == "a%25b"
    assert encode_job("a?b#c") == "a%3Fb%23c"
    assert encode_job("a+b") == "a%2Bb"
    assert encode_job("Az09-._~") == "Az09-._~"


@pytest.mark.parametrize("job", ["a b", "", "x" * 257, "caf\u00e9", "tab\there", "\x7f"])
def test_invalid_job_ids_are_refused_before_sending(job):
    nobody = Client("http://127.0.0.1:9", owner="ids")  # would fail to connect if it sent
    with pytest.raises(InvalidJobId):
        nobody.claim(job)
    with pytest.raises(InvalidJobId):
        nobody.status(job)
