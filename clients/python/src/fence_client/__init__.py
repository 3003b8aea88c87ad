"""A client for fence lease servers: claim a job, keep the lease renewed, and send the newest
fencing token with every write, refusing to send once the lease is lost.

    from fence_client import Client, ProblemError
    from fence_client.requests import FenceAuth, raise_for_problem

    client = Client("http://127.0.0.1:7700", ttl=10)
    with client.claim("invoice-42") as lease:        # completes on a clean exit
        try:
            raise_for_problem(session.post("http://127.0.0.1:7800/ledger", data="charge",
                                           auth=FenceAuth(lease), timeout=5))
        except (requests.RequestException, ProblemError):
            lease.abandon()  # a timeout, a 502 or 504 may land: not released, left to expire
            raise
    with client.claim_slot("exports", 3) as lease:   # a semaphore: one of 3 slots, released on exit
        ...

The asyncio twin is :mod:`fence_client.aio`; adapters for ``requests`` and ``httpx`` are
:mod:`fence_client.requests` and :mod:`fence_client.httpx`. The wire contract is
``docs/protocol.md`` of the fence repository.
"""

from ._errors import (FenceError, GrantTooShort, InvalidJobId, JobCompleted, LeaseHeld,
                      LeaseLost, LeaseRefused, LockDelay, ProblemError, ProtocolError,
                      SemaphoreSize, ServerUnreachable, StaleToken, problem_error)
from ._wire import check_job, encode_job, idempotency_key
from .aio import AsyncClient, AsyncLease
from .client import Client, Lease

__all__ = [
    "AsyncClient", "AsyncLease", "Client", "FenceError", "GrantTooShort", "InvalidJobId",
    "JobCompleted", "Lease", "LeaseHeld", "LeaseLost", "LeaseRefused", "LockDelay", "ProblemError",
    "ProtocolError", "SemaphoreSize",
    "ServerUnreachable", "StaleToken", "check_job", "encode_job", "idempotency_key",
    "problem_error",
]
__version__ = "0.1.0"
