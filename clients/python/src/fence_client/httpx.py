"""The ``httpx`` adapter: an :class:`httpx.Auth` for ``httpx.Client`` and ``httpx.AsyncClient``
alike that stamps ``X-Fencing-Job`` and ``X-Fencing-Token`` on every request and raises
:class:`~fence_client.LeaseLost` instead of sending once the lease is lost.

    httpx.post(url, content=body, auth=FenceAuth(lease))
    async with httpx.AsyncClient(auth=FenceAuth(lease)) as http: ...
"""

from __future__ import annotations

from typing import Generator, Union

import httpx

from ._errors import ProblemError, problem_error
from .aio import AsyncLease
from .client import Lease


class FenceAuth(httpx.Auth):
    """Stamps the lease's headers on each request (redirects included) as it is sent."""

    def __init__(self, lease: Union[Lease, AsyncLease]) -> None:
        self.lease = lease

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self.lease.headers())  # raises LeaseLost: nothing is sent
        yield request


def raise_for_problem(response: httpx.Response) -> None:
    """Raises the :class:`~fence_client.ProblemError` of a non-2xx answer (for a destination's
    409 ``stale-token``, :class:`~fence_client.StaleToken`); nothing on success."""
    if response.status_code >= 400:
        raise problem_error(response.status_code, dict(response.headers), response.content)


__all__ = ["FenceAuth", "ProblemError", "raise_for_problem"]
