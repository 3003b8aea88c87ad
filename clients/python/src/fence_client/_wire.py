"""The wire half of the client: job ids in paths, HTTP calls to the lease server, timing."""

from __future__ import annotations

import base64
import functools
import hashlib
import http.client
import json
import os
import re
import secrets
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar, Union

from ._errors import InvalidJobId, ProtocolError, ServerUnreachable, problem_error, redact

PathLike = Union[str, "os.PathLike[str]"]

_UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")


def check_job(job: str) -> str:
    """Returns ``job`` if it is a valid job id (1 to 256 bytes of visible ASCII, 0x21 to 0x7E),
    else raises :class:`InvalidJobId`: a space or anything outside visible ASCII is refused
    here, before anything is sent."""
    if not isinstance(job, str):
        raise InvalidJobId(f"a job id is a str, not {type(job).__name__}")
    if not 1 <= len(job) <= 256:
        raise InvalidJobId(f"a job id has 1 to 256 characters, not {len(job)}")
    for i, ch in enumerate(job):
        if not 0x21 <= ord(ch) <= 0x7E:
            raise InvalidJobId(
                f"job id {job!r} has {ch!r} at offset {i}: only visible ASCII (0x21 to 0x7E) is allowed")
    return job


MAX_SLOTS = 1000


def check_resource(resource: str) -> str:
    """Returns ``resource`` if it can name a semaphore: a job id of at most 251 characters (its
    slots' job ids ``<resource>#<slot>`` add ``#`` and up to 4 digits) without ``#``, which
    separates a resource from its slot number; else raises :class:`InvalidJobId`, before
    anything is sent."""
    if not isinstance(resource, str):
        raise InvalidJobId(f"a resource name is a str, not {type(resource).__name__}")
    if len(resource) > 251:
        raise InvalidJobId(f"a resource name has 1 to 251 characters, not {len(resource)}"
                           " (its slots' job ids add '#' and up to 4 digits)")
    check_job(resource)
    if "#" in resource:
        raise InvalidJobId(f"resource name {resource!r} holds '#', which separates a resource"
                           " from its slot number in a slot's job id")
    return resource


def check_slots(slots: int) -> int:
    """Returns ``slots`` if it is a semaphore's number of slots, an int from 1 to 1000; else
    raises ValueError, before anything is sent."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"a semaphore has 1 to {MAX_SLOTS} slots, not {slots!r}")
    return slots


def encode_job(job: str) -> str:
    """The job id percent-encoded for a URL path: every byte but ``A-Z a-z 0-9 - . _ ~``."""
    return "".join(chr(b) if b in _UNRESERVED else f"%{b:02X}" for b in check_job(job).encode("ascii"))


def idempotency_key(job: str, step: str) -> str:
    """The derived ``Idempotency-Key`` of one step of a job (contract section 11): the same for
    every holder of every generation, for third-party APIs that deduplicate by key."""
    digest = hashlib.sha256(b"fence-step-v1\0" + check_job(job).encode("ascii") + b"\0"
                            + step.encode("utf-8")).digest()
    return "fence-" + base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


def default_owner() -> str:
    """``<hostname>-<pid>-<random>``, unique per process incarnation."""
    host = "".join(c if 0x21 <= ord(c) <= 0x7E else "-" for c in socket.gethostname()) or "host"
    return f"{host[:200]}-{os.getpid()}-{secrets.token_hex(4)}"


def new_lease_key() -> str:
    """43 base64url characters from 32 OS random bytes: the proof that a lease is ours."""
    return secrets.token_urlsafe(32)


def ttl_to_ms(ttl: float) -> int:
    ms = int(round(ttl * 1000))
    if not 100 <= ms <= 86_400_000:
        raise ValueError(f"a lease TTL is 0.1 s to 24 h, not {ttl!r} s")
    return ms


def lock_delay_to_ms(delay: Optional[float]) -> Optional[int]:
    """A lock-delay in seconds as the wire's ``lock_delay_ms`` (0 to 24 h), or None."""
    if delay is None:
        return None
    ms = int(round(delay * 1000))
    if not 0 <= ms <= 86_400_000:
        raise ValueError(f"a lock-delay is 0 to 24 h, not {delay!r} s")
    return ms


def margin_ms(granted_ms: int, margin: Optional[float]) -> int:
    """The safety margin of a grant: 10% of its TTL, at least 50 ms, unless configured."""
    if margin is not None:
        return int(round(margin * 1000))
    return max(granted_ms // 10, 50)


def wait_param(seconds: float) -> str:
    return f"{max(1, int(seconds * 1000))}ms"


def read_auth_token(auth_token: Optional[str], auth_token_file: Optional[PathLike]) -> Optional[str]:
    """The bearer secret: given, else read from the file, else ``FENCE_AUTH_TOKEN``, else
    none; white space around it trimmed, refused unless visible ASCII."""
    if auth_token is not None and auth_token_file is not None:
        raise ValueError("give auth_token or auth_token_file, not both")
    source = "auth_token"
    if auth_token_file is not None:
        with open(auth_token_file, encoding="utf-8") as f:
            auth_token = f.read().strip()
        if not auth_token:
            raise ValueError(f"the auth token file {os.fspath(auth_token_file)} is empty")
        source = f"the auth token file {os.fspath(auth_token_file)}"
    if auth_token is None:
        auth_token, source = os.environ.get("FENCE_AUTH_TOKEN"), "FENCE_AUTH_TOKEN"
    # An empty secret is none (os.environ.get("X", "") passed on), as it always was.
    if not auth_token:
        return None
    # A secret read from an environment variable or a file often ends in a newline: white
    # space around it is no part of it. What is left goes in a header, so it must be visible
    # ASCII; the error never repeats it (http.client's would, in every failed call's message).
    auth_token = auth_token.strip()
    if not auth_token:
        raise ValueError(f"the bearer secret ({source}) is only white space")
    if any(not 0x21 <= ord(c) <= 0x7E for c in auth_token):
        raise ValueError(f"the bearer secret ({source}) holds a character an HTTP header cannot "
                         "carry (a space, a control character or non-ASCII); it is not shown here")
    return auth_token


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def without_userinfo(url: str) -> str:
    """``url`` to quote in an error message: everything from its scheme's ``//`` (or its start)
    up to its last ``@`` removed, so no user or password it carries is shown, whatever its
    syntax (the ``@`` may follow a ``/`` of the password)."""
    head, at, rest = url.rpartition("@")
    if not at:
        return url
    scheme = _SCHEME.match(head)
    return (scheme.group(0) if scheme else "") + rest


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """Follows no redirect: a 3xx reaches the caller as an ``HTTPError``, as the Go and
    TypeScript clients see it."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


#: The longest one connection attempt may take while other servers are left to try (seconds).
MAX_CONNECT_SHARE = 2.0


class _NoConnection(OSError):
    """No connection to a server could be made (refused, unreachable, a name that does not
    resolve, a TLS handshake that failed): no request reached it, so the next may be asked."""


class _Request(urllib.request.Request):
    #: How long connecting may take (seconds), or None: as long as the call's timeout.
    connect_within: Optional[float] = None


def _connecting(base: Any) -> Any:
    """``base`` (``HTTPConnection`` or ``HTTPSConnection``) whose failure to connect, TLS
    handshake included, raises :class:`_NoConnection`, within its own time limit if given."""

    class Connection(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, connect_within: Optional[float] = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._connect_within = connect_within

        def connect(self) -> None:
            timeout = self.timeout
            if self._connect_within is not None:
                self.timeout = self._connect_within
            try:
                super().connect()
            except OSError as e:
                raise _NoConnection(f"no connection: {e}") from e
            finally:
                self.timeout = timeout
            self.sock.settimeout(timeout)

    return Connection


_HTTPConnection = _connecting(http.client.HTTPConnection)
_HTTPSConnection = _connecting(http.client.HTTPSConnection)


def _within(req: urllib.request.Request) -> Optional[float]:
    return getattr(req, "connect_within", None)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_HTTPConnection, connect_within=_within(req)), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> Any:
        return self.do_open(functools.partial(_HTTPSConnection, connect_within=_within(req)),
                            req, context=self._context)  # type: ignore[attr-defined]


def servers_of(given: str) -> List[str]:
    """The servers of ``given``: one URL, or several that share one database separated by
    commas (``http://a:7700,http://b:7700``, as ``FENCE_SERVER`` may hold and ``fence run``
    passes on), each without a trailing ``/``. ValueError for one that is not ``http://`` or
    ``https://``, or for any user or password (``@``)."""
    servers = [one.strip().rstrip("/") for one in given.split(",")]
    for one in servers:
        if not one.startswith(("http://", "https://")):
            raise ValueError("the server URL must start with http:// or https://, not "
                             f"{without_userinfo(one)!r}")
    if "@" in given:
        # The server knows bearer secrets only: a user or password here is a mistake, and
        # would be quoted in every error message (self.server is).
        raise ValueError("the server URL must not carry a user or password ('@'): give the "
                         "bearer secret as auth_token (or auth_token_file, FENCE_AUTH_TOKEN)")
    return servers


class Transport:
    """Blocking HTTP calls to a lease server (``urllib``; thread safe).

    Several servers that share one database act as one: a call goes to the one that answered
    last, and moves on to the next only when no connection could be made to it (refused,
    unreachable, TLS handshake failed), never once a request may have reached it, so no
    decision is ever asked of two servers (as the Rust client)."""

    def __init__(self, server: Optional[str], auth_token: Optional[str],
                 auth_token_file: Optional[PathLike], ca_file: Optional[PathLike],
                 timeout: float) -> None:
        self._servers = servers_of(server or os.environ.get("FENCE_SERVER")
                                   or "http://127.0.0.1:7700")
        self.server = ",".join(self._servers)
        self._preferred = 0  # the index of the server that answered last
        self.timeout = timeout
        secret = read_auth_token(auth_token, auth_token_file)
        self._headers = {"accept": "application/json"}
        if secret:
            self._headers["authorization"] = f"Bearer {secret}"
        if ca_file is None:
            ca_file = os.environ.get("FENCE_CA_CERT") or None
        # With a CA file, its certificates replace the system roots (as curl --cacert does).
        context = ssl.create_default_context(cafile=os.fspath(ca_file) if ca_file else None)
        self._opener = urllib.request.build_opener(
            _HTTPHandler(),
            _HTTPSHandler(context=context),
            # The lease server is reached directly, never through an environment proxy.
            urllib.request.ProxyHandler({}),
            # Nor through a redirect: urllib would send the bearer secret wherever it points
            # (another host, https to http), and turn a release's POST into a GET whose answer
            # could pass for the release's. A 3xx is answered as the error it is here.
            _NoRedirects())

    def call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
             timeout: Optional[float] = None) -> Dict[str, Any]:
        """One request; the decoded JSON answer on 2xx, else the problem as an exception."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = dict(self._headers)
        if data is not None:
            headers["content-type"] = "application/json"
        wait = self.timeout if timeout is None else max(timeout, 0.001)
        deadline = time.monotonic() + wait
        # The server asked last, for messages.
        asked = [self._servers[self._preferred % len(self._servers)]]

        def fetch() -> Tuple[int, Dict[str, str], bytes]:
            n = len(self._servers)
            first = self._preferred % n
            for tried in range(n):
                i = (first + tried) % n
                asked[0] = self._servers[i]
                request = _Request(self._servers[i] + path, data=data, method=method,
                                   headers=headers)
                if tried + 1 < n:
                    # A silent server must not use up the call while others are left to try:
                    # its share of what is left, at most 2 s; the last one may take it all.
                    left = max(deadline - time.monotonic(), 0.001)
                    request.connect_within = min(left / (n - tried), MAX_CONNECT_SHARE)
                try:
                    with self._opener.open(request, timeout=wait) as response:
                        answer = response.status, {}, read_at_most(response)
                except urllib.error.HTTPError as e:
                    # An error's body is read here too, under the same bound as a success's.
                    try:
                        body = read_at_most(e)
                    except (OSError, http.client.HTTPException):  # a cut body: IncompleteRead
                        body = b""
                    answer = e.code, dict(e.headers.items()), body
                except urllib.error.URLError as e:
                    # No connection was made, so no request reached this server: the next one
                    # may be asked. Any other failure may have reached it: never.
                    if isinstance(e.reason, _NoConnection) and tried + 1 < n:
                        continue
                    raise
                if tried > 0:
                    self._preferred = i
                return answer
            raise AssertionError("unreachable")  # the last server's failure is raised above

        try:
            # urllib's timeout bounds each socket operation, not the call: a server that
            # trickles its answer a byte at a time would hold the call for as long as it
            # likes. The whole call ends at ``wait``; a late answer is dropped.
            status, error_headers, payload = bounded(fetch, wait, "fence-call")
        except Timeout:
            raise ServerUnreachable(
                f"{method} {asked[0]}{path}: no whole answer within {wait:.3g} s") from None
        except (OSError, urllib.error.URLError, ValueError, http.client.HTTPException) as e:
            # http.client's RemoteDisconnected is an OSError; a truncated answer an
            # IncompleteRead (an HTTPException) or a ValueError.
            raise ServerUnreachable(f"{method} {asked[0]}{path}: {e}") from e
        if not 200 <= status <= 299:
            raise problem_error(status, error_headers, payload)
        where = f"{method} {asked[0]}{path}"
        if len(payload) > MAX_ANSWER:
            raise ProtocolError(f"{where}: an answer larger than {MAX_ANSWER} bytes")
        try:
            answer = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            # RecursionError: nested deeper than the interpreter's stack (a megabyte of "[").
            # Redacted before it is cut: a key cut short at the end would escape the redaction.
            raise ProtocolError(f"{where}: not JSON: {redact(repr(payload))[:200]}") from e
        if not isinstance(answer, dict):
            raise ProtocolError(f"{where}: not a JSON object")
        return answer


T = TypeVar("T")

#: The largest answer a call reads (bytes), as the Go and TypeScript clients: the lease API's
#: largest is a 64 KiB checkpoint, escaped.
MAX_ANSWER = 1 << 20


def read_at_most(response: Any) -> bytes:
    """The answer's body, or its first ``MAX_ANSWER + 1`` bytes when it is longer."""
    return response.read(MAX_ANSWER + 1)  # type: ignore[no-any-return]


class Timeout(Exception):
    """A bounded call did not finish in time (internal)."""


def bounded(fn: Callable[[], T], timeout: float, name: str = "fence-renewal") -> T:
    """Runs ``fn`` in a thread of its own and waits for it at most ``timeout`` seconds.

    The keeper uses it so that a renewal hanging on a server that stopped answering cannot
    hold the lost signal past the deadline, and every call so that a server trickling its
    answer cannot hold it past its timeout; a late answer is dropped.
    """
    done = threading.Event()
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the waiting thread
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(max(timeout, 0.0)):
        raise Timeout()
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


def monotonic() -> float:
    return time.monotonic()


def grant_token(job: str, generation: int, answer: Dict[str, Any]) -> Tuple[str, int, int]:
    """(token, granted ttl_ms, expires_at_ms) of a lease answer for ``generation``."""
    # Not JSON true for generation 1: in Python, True == 1.
    if not _is_integer(answer.get("generation")) or answer.get("generation") != generation:
        raise ProtocolError(
            f"the server granted generation {answer.get('generation')!r} of {job}, expected {generation}")
    token = answer.get("token")
    if token is None:
        token = str(generation)
    elif not isinstance(token, str) or not token.startswith(f"{generation}."):
        raise ProtocolError(f"the server signed token {redact(repr(token))[:200]} for generation "
                            f"{generation}")
    ttl_ms, expires_at_ms = answer.get("ttl_ms"), answer.get("expires_at_ms")
    if not (_is_integer(ttl_ms) and _is_integer(expires_at_ms)):
        raise ProtocolError("a lease answer without ttl_ms and expires_at_ms: "
                            f"{redact(repr(answer))[:300]}")
    if not 100 <= ttl_ms <= 86_400_000 or not 0 <= expires_at_ms <= MAX_U64:
        # A TTL outside what a server grants (0.1 s to 24 h; 0 is malformed, not a grant too
        # short to hold), or an expiry no unsigned 64-bit integer holds: as the Rust client.
        raise ProtocolError(f"a lease answer with ttl_ms {ttl_ms} and expires_at_ms {expires_at_ms}")
    return token, ttl_ms, expires_at_ms


#: The largest unsigned 64-bit integer: generations and expiries on the wire are such numbers.
MAX_U64 = 2**64 - 1


def checkpoint_of(job: str, answer: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The checkpoint of a claim's answer, ``{"generation", "data"}``, or None when it has
    none; :class:`ProtocolError` when it is not an object with an unsigned 64-bit integer
    ``generation`` and a text ``data`` (as the Rust client)."""
    checkpoint = answer.get("checkpoint")
    if checkpoint is None:
        return None
    generation = checkpoint.get("generation") if isinstance(checkpoint, dict) else None
    data = checkpoint.get("data") if isinstance(checkpoint, dict) else None
    if not (_is_integer(generation) and 0 <= generation <= MAX_U64 and isinstance(data, str)):
        raise ProtocolError(f"a claim of {job} was answered with checkpoint "
                            f"{redact(repr(checkpoint))[:200]}")
    return {"generation": generation, "data": data}


def _is_integer(value: Any) -> bool:
    """Whether ``value`` decoded from a JSON integer (``true`` decodes to a bool, an int)."""
    return isinstance(value, int) and not isinstance(value, bool)
