"""Answers the real server never gives, from a scripted one: each must leave the lease (or the
claim) as the contract says."""

from __future__ import annotations

import asyncio
import time

import pytest

from fakeserver import FakeServer, grant
from fence_client import Client
from fence_client.aio import AsyncClient


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
    lease = Client(server.url, owner="o", ttl=1.0).claim("j")
    time.sleep(1.5)  # past the claim's deadline: only a later renewal keeps the lease
    assert not lease.is_lost(), lease.loss_reason
    assert server.count("renew") >= 2
    lease.abandon()


def test_an_asyncio_renewal_that_never_answers_is_abandoned_and_asked_again(fake):
    server = fake(first_renewal_hangs)

    async def main() -> None:
        lease = await AsyncClient(server.url, owner="o", ttl=1.0).claim("j")
        await asyncio.sleep(1.5)
        assert not lease.is_lost(), lease.loss_reason
        assert server.count("renew") >= 2
        lease.abandon()

    asyncio.run(main())
