"""kvbridge's exceptions, grouped by cause as the Rust `kvbridge::Error` is.

Every exception has ``.peer`` (the peer's id, or its address before the id is known) and
``.step`` (the protocol step that failed: ``connect``, ``hello``, ``welcome``, ``data-bind``,
``mem-info``, ``ready``, ``write``, ``read``, ``notify``, ``close``...), either ``None`` when it
does not apply, and ``.code`` (the peer's wire code, for refusals). The message names the peer
and the step.
"""

from __future__ import annotations

__all__ = [
    "KvbridgeError",
    "PeerError",
    "PeerMisbehaved",
    "Incompatible",
    "Unauthenticated",
    "Rejected",
    "PeerClosed",
    "NetworkError",
    "Timeout",
    "UnmapTimeout",
    "ConnectionLost",
    "PeerRestarted",
    "SessionReplaced",
    "UsageError",
    "InvalidOp",
    "UnknownPeer",
    "Closed",
    "Disconnected",
    "LimitExceeded",
    "LocalError",
    "IntegrityError",
]


class KvbridgeError(Exception):
    """Base class of every kvbridge error.

    Attributes:
        peer: the peer concerned (its id, or its address before the id is known), or None.
        step: the step that failed (``"connect"``, ``"write"``, ...), or None.
        code: the peer's wire error code for refusals and closes, or None.
    """

    __module__ = "kvbridge"

    def __init__(
        self,
        message: str,
        peer: str | None = None,
        step: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.step = step
        self.code = code

    def __reduce__(self):  # keeps peer/step/code across pickling (multiprocessing)
        return (type(self), (str(self), self.peer, self.step, self.code))


# ---- the peer: it misbehaved, is incompatible, or refused ----
class PeerError(KvbridgeError):
    """The peer misbehaved, is incompatible, or refused."""

    __module__ = "kvbridge"


class PeerMisbehaved(PeerError):
    """The peer broke the protocol (bad frame, unexpected message, op outside a region)."""

    __module__ = "kvbridge"


class Incompatible(PeerError):
    """The peers cannot work together (protocol version, compatibility description); the
    message names both sides' values."""

    __module__ = "kvbridge"


class Unauthenticated(PeerError):
    """Authentication failed: a side could not prove it knows the shared secret, or one side
    requires it and the other does not."""

    __module__ = "kvbridge"


class Rejected(PeerError):
    """The peer answered with a typed refusal (``.code`` holds its code)."""

    __module__ = "kvbridge"


class PeerClosed(PeerError):
    """The peer closed the session."""

    __module__ = "kvbridge"


# ---- the network and deadlines ----
class NetworkError(KvbridgeError):
    """The network failed or a deadline passed."""

    __module__ = "kvbridge"


class Timeout(NetworkError, TimeoutError):
    """A step passed its deadline."""

    __module__ = "kvbridge"


class UnmapTimeout(Timeout):
    """A peer did not confirm unmapping one of our shared-memory regions in time; its
    session was ended so that the region could be detached."""

    __module__ = "kvbridge"


class ConnectionLost(NetworkError, ConnectionError):
    """The connection broke."""

    __module__ = "kvbridge"


class PeerRestarted(NetworkError):
    """The peer restarted (same id, new incarnation); work on the old session failed."""

    __module__ = "kvbridge"


class SessionReplaced(NetworkError):
    """A newer session of the same peer replaced this one."""

    __module__ = "kvbridge"


# ---- local misuse ----
class UsageError(KvbridgeError):
    """The caller misused the API, or a local resource failed."""

    __module__ = "kvbridge"


class InvalidOp(UsageError, ValueError):
    """An op or argument that can never succeed: a null pointer, a zero or non-dividing size,
    an unknown region, a page or offset out of range, a read-only buffer where a peer or a
    read may write. Raised before any byte moves."""

    __module__ = "kvbridge"


class UnknownPeer(UsageError):
    """No session with that peer: call connect first."""

    __module__ = "kvbridge"


class Closed(UsageError):
    """The channel was closed locally (every call after ``close()`` raises this)."""

    __module__ = "kvbridge"


class Disconnected(UsageError):
    """The session was ended locally."""

    __module__ = "kvbridge"


class LimitExceeded(Rejected, UsageError):
    """The peer refused because a limit (ops per batch, bytes in flight, handshakes) was
    exceeded."""

    __module__ = "kvbridge"


class LocalError(UsageError):
    """A configuration or local resource problem (bind failed, allocation failed, a region
    still in use)."""

    __module__ = "kvbridge"


# ---- the bytes ----
class IntegrityError(KvbridgeError):
    """Bytes that landed differ from the digest (``kvbridge.digest``) their sender computed
    when it wrote them: the load or write they belong to fails. ``.cause`` is
    ``"integrity"``, ``.step`` the step that checked (``"integrity"``), ``.pages`` the pages
    (or blocks) that failed, in the receiver's numbering."""

    __module__ = "kvbridge"
    cause = "integrity"

    def __init__(
        self,
        message: str,
        peer: str | None = None,
        step: str | None = "integrity",
        code: str | None = None,
        pages: list[int] | None = None,
    ) -> None:
        super().__init__(message, peer, step, code)
        self.pages = list(pages or [])

    def __reduce__(self):
        return (type(self), (str(self), self.peer, self.step, self.code, self.pages))
