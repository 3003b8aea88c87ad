"""The ``httpx`` adapter: an :class:`httpx.Auth` for ``httpx.Client`` and ``httpx.AsyncClient``
alike that stamps ``X-Fencing-Job`` and ``X-Fencing-Token`` on every request and raises
:class:`~fence_client.LeaseLost` instead of sending once the lease is lost.

    httpx.post(url, content=body, auth=FenceAuth(lease))
    async with httpx.AsyncClient(auth=FenceAuth(lease)) as http: ...
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Dict, Generator, Union

import httpx

from ._errors import ProblemError, problem_error
from .aio import AsyncLease
from .client import Lease


#: The moments httpcore is about to write a request's head, over HTTP/1.1 and HTTP/2.
_SENDING = ("http11.send_request_headers.started", "http2.send_request_headers.started")


class FenceAuth(httpx.Auth):
    """Stamps the lease's headers on a request and refuses to send it, or any redirect httpx
    follows from it, once the lease is lost.

    httpx runs an auth flow once per request and follows redirects inside it, copying the
    headers, so stamping alone would let a redirect go out with a lost lease's token. The
    lease is therefore checked again just before each request's head is written (httpcore's
    ``trace`` request extension, which redirects inherit): :class:`~fence_client.LeaseLost`
    is raised there instead of sending."""

    def __init__(self, lease: Union[Lease, AsyncLease]) -> None:
        self.lease = lease

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.update(self.lease.headers())  # raises LeaseLost: nothing is sent
        earlier = request.extensions.get("trace")
        lease = self.lease

        def trace(event: str, info: Dict[str, Any]) -> None:
            if event in _SENDING:
                lease.headers()  # raises LeaseLost before the head is written
            if earlier is not None:
                earlier(event, info)

        request.extensions["trace"] = trace
        yield request

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        request.headers.update(self.lease.headers())  # raises LeaseLost: nothing is sent
        earlier = request.extensions.get("trace")
        lease = self.lease

        async def trace(event: str, info: Dict[str, Any]) -> None:
            if event in _SENDING:
                lease.headers()  # raises LeaseLost before the head is written
            if earlier is not None:
                await earlier(event, info)

        request.extensions["trace"] = trace
        yield request


def raise_for_problem(response: httpx.Response) -> None:
    """Raises the :class:`~fence_client.ProblemError` of a non-2xx answer (for a destination's
    409 ``stale-token``, :class:`~fence_client.StaleToken`); nothing on success."""
    if response.status_code >= 400:
        raise problem_error(response.status_code, dict(response.headers), response.content)


__all__ = ["FenceAuth", "ProblemError", "raise_for_problem"]
