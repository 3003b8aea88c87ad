"""The errors of the fence client: a lease lost locally, and problem+json answers."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, Mapping, Optional, Type


class FenceError(Exception):
    """Base class of every error this package raises."""


class InvalidJobId(FenceError, ValueError):
    """A job id that is not 1 to 256 visible ASCII characters, or a semaphore's resource name
    that is not 1 to 251 of them without ``#``; nothing was sent."""


class ServerUnreachable(FenceError):
    """No answer from the lease server (refused, reset, timed out, TLS failure).

    The outcome of the request is unknown; the cause is kept as ``__cause__``.
    """


class ProtocolError(FenceError):
    """An answer of the lease server that does not follow the contract."""


class GrantTooShort(FenceError):
    """The server granted a lease no longer than the client's safety margin (its ``--max-ttl``
    is below the TTL asked for): it could not be held at all, and is given back at once. Lower
    the client's margin or raise the server's maximum TTL. ``job``; ``granted`` and ``margin``
    in seconds."""

    def __init__(self, job: str, granted: float, margin: float) -> None:
        self.job, self.granted, self.margin = job, granted, margin
        super().__init__(
            f"job {job}: the server granted a lease of {granted} s, not longer than the safety "
            f"margin of {margin} s, so it could not be held at all; lower the client's safety "
            "margin or raise the server's maximum TTL")


class LeaseLost(FenceError):
    """The lease is lost: stop all work and effects on the job; nothing was sent.

    Raised by ``lease.token``, ``lease.headers()`` and the ``requests``/``httpx``
    adapters once the local deadline has passed or the server refused a renewal, and by
    ``lease.release()`` then (or after ``abandon()``): the lease is left to expire.
    ``LeaseRefused`` (the server's own 409 ``lease-lost`` or 403 ``lease-key-mismatch``)
    is a ``LeaseLost`` too, so one ``except LeaseLost`` covers both.
    """

    def __init__(self, job: str, generation: int, reason: str) -> None:
        super().__init__(f"the lease on job {job} (generation {generation}) is lost: {reason}")
        self.job = job
        self.generation = generation
        self.reason = reason


class ProblemError(FenceError):
    """A refusal answered as ``application/problem+json`` (RFC 9457).

    ``type`` is the problem type (``urn:fence:lease-held``), ``status`` the HTTP status,
    ``detail`` the explanation, ``problem`` the whole object (with members such as
    ``job``, ``owner``, ``generation``, ``highest``), ``retry_after`` the seconds of a
    ``Retry-After`` header, if any.
    """

    type: str
    status: int
    title: str
    detail: str
    problem: Dict[str, Any]
    retry_after: Optional[float]

    def __init__(self, problem: Dict[str, Any], status: int,
                 retry_after: Optional[float] = None) -> None:
        self.problem = problem
        self.type = str(problem.get("type", "about:blank"))
        # The answer's own status when the problem's is missing or not a number.
        member = problem.get("status")
        self.status = member if type(member) is int and 100 <= member <= 599 else status
        self.title = str(problem.get("title", ""))
        # Whatever the detail's type (an object echoing the request, say), its text is redacted.
        self.detail = redact(str(problem.get("detail", "")))
        self.retry_after = retry_after
        # Not super(): LeaseRefused is also a LeaseLost, whose constructor takes other arguments.
        FenceError.__init__(self, f"{self.status} {self.type}: {self.detail}")

    def __getattr__(self, name: str) -> Any:
        # Problem members (job, owner, generation, highest, expires_in_ms...) as attributes.
        problem = self.__dict__.get("problem", {})
        if name in problem:
            return problem[name]
        raise AttributeError(name)


class LeaseHeld(ProblemError):
    """409 ``urn:fence:lease-held``: another owner holds the job (``owner``, ``expires_in_ms``).
    For a semaphore claim: every slot is taken, and ``job`` is the slot that frees first."""


class LockDelay(LeaseHeld):
    """409 ``urn:fence:lock-delay``: the job's last lease expired and its lock-delay runs;
    nobody can claim it for ``claimable_in_ms`` (``owner`` and ``generation`` are the expired
    lease's). A :class:`LeaseHeld`, so code that waits for a held job waits for this too."""


class SemaphoreSize(ProblemError):
    """409 ``urn:fence:semaphore-size``: slots of the resource are in force (held or expired with
    their holder, or revoked before their lease would have ended) under another number of
    slots; ``slots`` is the number in force. The number of slots of a resource changes only
    while none of its slots is in force: claim with ``slots``, or later."""

    slots: int

    def __init__(self, problem: Dict[str, Any], status: int,
                 retry_after: Optional[float] = None) -> None:
        ProblemError.__init__(self, problem, status, retry_after)
        slots = problem.get("slots")
        self.slots = slots if isinstance(slots, int) and not isinstance(slots, bool) else 0


class JobCompleted(ProblemError):
    """410 ``urn:fence:job-completed``: the job is done; do not run it."""


class LeaseRefused(ProblemError, LeaseLost):
    """The server says this lease is no longer ours: 409 ``urn:fence:lease-lost`` or
    403 ``urn:fence:lease-key-mismatch``. Stop all work at once; do not complete."""

    def __init__(self, problem: Dict[str, Any], status: int,
                 retry_after: Optional[float] = None) -> None:
        ProblemError.__init__(self, problem, status, retry_after)
        self.reason = f"the server refused it: {self.type}: {self.detail}"
        generation = problem.get("generation")
        self.generation = generation if isinstance(generation, int) else 0


class StaleToken(ProblemError):
    """409 ``urn:fence:stale-token`` or ``urn:fence:token-expired`` from a destination:
    a newer holder exists; stop, do not retry, do not complete. One exception: a
    ``token-expired`` (``self.type``) while your lease still holds (not lost) means the
    request waited past the end of the token it carried (a signing server gives a new
    token at each renewal): send it again with the lease's current token."""


_BY_TYPE: Dict[str, Type[ProblemError]] = {
    "urn:fence:lease-held": LeaseHeld,
    "urn:fence:lock-delay": LockDelay,
    "urn:fence:job-completed": JobCompleted,
    "urn:fence:semaphore-size": SemaphoreSize,
    "urn:fence:lease-lost": LeaseRefused,
    "urn:fence:lease-key-mismatch": LeaseRefused,
    "urn:fence:stale-token": StaleToken,
    "urn:fence:token-expired": StaleToken,
}


_LEASE_KEY_VALUE = re.compile(r"""(lease_key\W{0,8}?)[A-Za-z0-9_\-]{8,}""")


def redact(text: str) -> str:
    """``text`` (an answer quoted into a message) with any ``lease_key`` value replaced: an
    endpoint that echoes the request would otherwise put the lease's proof into errors and
    loss reasons, which end up in logs."""
    return _LEASE_KEY_VALUE.sub(r"\1<redacted>", text)


BODY_TIMEOUT = "urn:fence:body-timeout"
TOO_MANY_WAITERS = "urn:fence:too-many-waiters"


def answer_lost(error: BaseException) -> bool:
    """Whether ``error`` means the request may have been applied and its answer lost: the
    server unreachable, a timeout, a 502, 503 or 504, or a 408 that is not the lease server's
    own ``body-timeout`` (a gateway's: envoy answers 408 when the server sent no head in time,
    after it forwarded the request)."""
    if isinstance(error, ServerUnreachable):
        return True
    return isinstance(error, ProblemError) and (
        error.status in (502, 503, 504) or (error.status == 408 and error.type != BODY_TIMEOUT))


def busy(error: BaseException) -> bool:
    """Whether ``error`` is the lease server's own 408 ``body-timeout``: the request did not
    arrive whole in time, nothing was applied, and asking again may pass."""
    return isinstance(error, ProblemError) and error.status == 408 and error.type == BODY_TIMEOUT


#: The most of a ``Retry-After`` a client waits for (seconds); its own wait still applies.
MAX_RETRY_AFTER = 60.0


def problem_error(status: int, headers: Mapping[str, str], body: bytes) -> ProblemError:
    """The error for a non-2xx answer: its problem+json, or a problem made from the status."""
    problem: Any = None
    content_type = ""
    retry_after: Optional[float] = None
    for name, value in headers.items():
        lowered = name.lower()
        if lowered == "content-type":
            content_type = value.lower()
        elif lowered == "retry-after":
            try:
                retry_after = float(value)
            except ValueError:
                retry_after = None
            # Seconds, at most MAX_RETRY_AFTER: an HTTP-date, a negative or not-a-number
            # value is no answer (backoff decides), and a huge one no reason to sleep for days.
            if retry_after is not None:
                retry_after = min(retry_after, MAX_RETRY_AFTER) if retry_after >= 0.0 else None
    if "json" in content_type:
        try:
            problem = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # nested too deep to decode
            problem = None
    if not isinstance(problem, dict) or not isinstance(problem.get("type"), str):
        text = body.decode("utf-8", "replace").strip()
        # Redacted before it is cut: a key cut short at the end would escape the redaction.
        problem = {"type": "about:blank", "status": status, "title": "", "detail": redact(text)[:500]}
    if isinstance(problem.get("detail"), str):
        problem["detail"] = redact(problem["detail"])
    cls = _BY_TYPE.get(problem["type"], ProblemError)
    return cls(problem, status, retry_after)
