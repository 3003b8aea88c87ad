"""The ``httpx`` adapter: an :class:`httpx.Auth` for ``httpx.Client`` and ``httpx.AsyncClient``
alike that stamps ``X-Fencing-Job`` and ``X-Fencing-Token`` on every request and raises
:class:`~fence_client.LeaseLost` instead of sending once the lease is lost.

    httpx.post(url, content=body, auth=FenceAuth(lease))
    async with httpx.AsyncClient(auth=FenceAuth(lease)) as http: ...
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, AsyncIterator, Dict, Generator, Iterator, Union

import httpx

from ._errors import ProblemError, problem_error
from .aio import AsyncLease
from .client import Lease


#: The moments httpcore is about to write a request's head, over HTTP/1.1 and HTTP/2.
_SENDING = ("http11.send_request_headers.started", "http2.send_request_headers.started")


class _CheckedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A request body that checks the lease before each chunk goes out: a body still being
    sent when the lease is lost (a generator that pauses, a slow upload) raises
    :class:`~fence_client.LeaseLost` there, and the rest of it never leaves."""

    def __init__(self, stream: Any, lease: Union[Lease, AsyncLease]) -> None:
        self._stream = stream
        self._lease = lease

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            self._lease.headers()  # raises LeaseLost: this chunk is not sent
            yield chunk
        # The body's end (HTTP/1.1's last chunk, HTTP/2's END_STREAM) is sent too once the
        # source is done: checked as well, so a request cannot complete after the loss.
        self._lease.headers()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            self._lease.headers()  # raises LeaseLost: this chunk is not sent
            yield chunk
        self._lease.headers()  # the body's end is not sent either

    def close(self) -> None:
        close = getattr(self._stream, "close", None)
        if close is not None:
            close()

    async def aclose(self) -> None:
        close = getattr(self._stream, "aclose", None)
        if close is not None:
            await close()


class FenceAuth(httpx.Auth):
    """Stamps the lease's headers on a request and refuses to send it, or any redirect httpx
    follows from it, once the lease is lost.

    httpx runs an auth flow once per request and follows redirects inside it, copying the
    headers, so stamping alone would let a redirect go out with a lost lease's token. The
    lease is therefore checked again just before each request's head is written (httpcore's
    ``trace`` request extension, which redirects inherit): :class:`~fence_client.LeaseLost`
    is raised there instead of sending. The body is checked too, before each chunk is sent:
    a streamed body (a generator) that is still going when the lease is lost raises
    :class:`~fence_client.LeaseLost`, and the rest of it never goes out (the destination sees
    a request cut short)."""

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
        request.stream = _CheckedStream(request.stream, lease)
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
        request.stream = _CheckedStream(request.stream, lease)
        yield request


def raise_for_problem(response: httpx.Response) -> None:
    """Raises the :class:`~fence_client.ProblemError` of a non-2xx answer (for a destination's
    409 ``stale-token``, :class:`~fence_client.StaleToken`); nothing on success."""
    if response.status_code >= 400:
        raise problem_error(response.status_code, dict(response.headers), response.content)


__all__ = ["FenceAuth", "ProblemError", "raise_for_problem"]
