"""The ``requests`` adapter: an auth hook that stamps ``X-Fencing-Job`` and ``X-Fencing-Token``
on every request and raises :class:`~fence_client.LeaseLost` instead of sending once the lease
is lost.

    session.post(url, data=body, auth=FenceAuth(lease))
    session.auth = FenceAuth(lease)                     # or for every request of a session
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union

import requests
from requests.auth import AuthBase

from ._errors import ProblemError, problem_error
from .aio import AsyncLease
from .client import Lease


class FenceAuth(AuthBase):
    """Stamps the lease's headers, read when the request is prepared, and again before each
    redirect is followed (``requests`` does not run auth hooks for redirects itself): once the
    lease is lost, :class:`~fence_client.LeaseLost` is raised instead of sending. ``auth`` is
    another hook to apply first (the destination's own credentials).

    The check runs before ``requests`` connects: name resolution, the TCP and TLS handshakes
    and a wait for a pooled connection come after it, and ``requests`` sets no timeout of its
    own. Pass ``timeout=`` (a few seconds, well inside the lease's margin) so that a request
    cannot go out long after the lease was lost; the destination's fence refuses one that
    does once a newer holder exists. The ``httpx`` adapter checks again as the request's
    headers are written. A streamed body (a generator or other iterator, sent chunked) is
    checked before each chunk: once the lease is lost, :class:`~fence_client.LeaseLost` is
    raised and the rest of it never goes out (a file's body is sent as it is).

    Retries inside urllib3 (``HTTPAdapter(max_retries=...)``) resend the request as it was
    prepared, token included, without this check; the destination's fence still refuses it
    once a newer holder exists."""

    def __init__(self, lease: Union[Lease, AsyncLease], auth: Optional[AuthBase] = None) -> None:
        self.lease = lease
        self.auth = auth

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        if self.auth is not None:
            r = self.auth(r)
        r.headers.update(self.lease.headers())  # raises LeaseLost: nothing is sent
        r.register_hook("response", self._before_redirect)
        body = r.body
        if (body is not None and hasattr(body, "__iter__") and not hasattr(body, "read")
                and not isinstance(body, (bytes, bytearray, str, list, tuple, dict))
                and not _is_buffer(body)):
            r.body = _checked(body, self.lease)
        return r

    def _before_redirect(self, response: requests.Response, **_: Any) -> requests.Response:
        # The redirect is built from this request: stamped afresh, or LeaseLost raised
        # before it is sent.
        if response.is_redirect and response.request is not None:
            response.request.headers.update(self.lease.headers())
        return response


def _is_buffer(body: Any) -> bool:
    """Whether ``body`` supports the buffer protocol (memoryview, array.array, mmap...):
    sent whole as bytes, while iterating one yields ints."""
    try:
        memoryview(body)
    except TypeError:
        return False
    return True


def _checked(body: Iterable[Any], lease: Union[Lease, AsyncLease]) -> Iterator[Any]:
    """A streamed body that checks the lease before each chunk goes out: once the lease is
    lost, LeaseLost is raised there and the rest of the body is never sent."""
    for chunk in body:
        lease.headers()  # raises LeaseLost: this chunk is not sent
        yield chunk
    # The body's end (the last, empty chunk) is written once the source is done: checked as
    # well, so a request cannot complete after the loss.
    lease.headers()


def raise_for_problem(response: requests.Response) -> None:
    """Raises the :class:`~fence_client.ProblemError` of a non-2xx answer (for a destination's
    409 ``stale-token``, :class:`~fence_client.StaleToken`); nothing on success."""
    if response.status_code >= 400:
        raise problem_error(response.status_code, dict(response.headers), response.content)


__all__ = ["FenceAuth", "ProblemError", "raise_for_problem"]
