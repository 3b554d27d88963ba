"""Type stubs of kvbridge's native module (PyO3). Import ``kvbridge``, not this."""

from collections.abc import Sequence
from os import PathLike
from typing import Any, Literal, final

from ._call import Call

__version__: str
TRANSPORTS: tuple[str, ...]

def _at_exit(timeout: float = 2.0) -> None:
    """The exit hook: ends blocking calls (they raise Closed) and waits for them."""

def new_grant_token() -> bytes:
    """A fresh grant token: 16 random bytes (keep it out of logs)."""

DIGEST_ALGORITHM: str
"""The integrity digest's hash: ``"xxh3-64"`` (XXH3-64, seed 0)."""

def digest(obj: Any) -> int:
    """The integrity digest of a C-contiguous buffer (bytes, bytearray, memoryview, numpy
    array) or a contiguous CPU tensor, GIL released; ``InvalidOp`` for anything else."""

def digest_ranges(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The digests of raw ``(address, length)`` ranges of this process's memory, in order,
    GIL released. The caller guarantees every range is mapped, readable host memory, not
    freed or reallocated during the call (an unmapped one crashes the process); a range of
    length 0 is the digest of no bytes. ``InvalidOp`` for a null address of a non-empty
    range or an overflowing one, ``TypeError`` for anything but pairs of ints."""

_Access = Literal["readwrite", "read", "write"]

# (local_region, local_offset, remote_region, remote_offset, length)
_Op = tuple[int, int, int, int, int]

@final
class RegionInfo:
    """A region a peer grants us."""

    @property
    def id(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def page_size(self) -> int: ...

@final
class ReadPlanner:
    """A prefiller's and a decoder rank's KV layouts (JSON of kvbridge-pd's ``TpLayout``),
    checked against each other; raises ``Incompatible`` or ``ValueError``."""

    def __init__(self, prefiller: str, decoder: str) -> None: ...
    def source_ranks(self) -> list[int]: ...
    def readers_of(self, rank: int) -> list[int]: ...
    def wanted_bytes(self, tokens: int) -> int: ...
    def plan(
        self, src_blocks: list[int], dst_blocks: list[int], tokens: int
    ) -> tuple[list[tuple[int, int, int, int]], int]: ...

@final
class Transfer:
    """A batch submitted with ``Channel.submit_*``."""

    def poll(self) -> Literal["PROC", "DONE", "ERR"]: ...
    def wait(self, timeout: float | None = None) -> None: ...
    @property
    def error(self) -> Exception | None: ...
    @property
    def done(self) -> bool: ...
    def cancel(self, timeout: float = 5.0) -> bool: ...

@final
class Channel:
    """A kvbridge endpoint (see ``help(kvbridge.Channel)``)."""

    def __init__(
        self,
        peer_id: str,
        listen: str | None = None,
        *,
        secret: bytes | str | None = None,
        peer_key: bytes | str | None = None,
        transport: Literal["auto", "tcp", "shm", "ucx"] | None = None,
        tls_cert: str | PathLike[str] | None = None,
        tls_key: str | PathLike[str] | None = None,
        tls_ca: str | PathLike[str] | None = None,
        tls_server_name: str | None = None,
        compat: str | None = None,
        use_env: bool = True,
        deadlines: dict[str, float] | None = None,
        ucx_trusted_fabric: bool | None = None,
    ) -> None: ...
    @property
    def peer_id(self) -> str: ...
    @property
    def local_addr(self) -> str | None: ...
    @property
    def transport(self) -> str | None: ...
    @property
    def closed(self) -> bool: ...

    # memory
    def register(
        self,
        ptr: int,
        length: int,
        page_size: int,
        *,
        peers: list[str] | None = None,
        access: _Access = "readwrite",
        direct_copies: bool = False,
        windows: _Access | None = None,
    ) -> int: ...
    def register_buffer(
        self,
        obj: Any,
        page_size: int,
        *,
        peers: list[str] | None = None,
        access: _Access = "readwrite",
        direct_copies: bool = False,
        windows: _Access | None = None,
    ) -> int: ...
    def deregister(self, region: int) -> None: ...

    # windows and grant tokens
    def open_window(
        self,
        region: int,
        offset: int,
        length: int,
        *,
        peer: str | None = None,
        token: bytes | None = None,
        access: _Access,
    ) -> int: ...
    def open_windows(
        self,
        region: int,
        offsets: Sequence[int],
        lengths: int | Sequence[int],
        *,
        peer: str | None = None,
        token: bytes | None = None,
        access: _Access,
    ) -> list[int]: ...
    def close_window(self, window_id: int, timeout: float | None = None) -> None: ...
    def close_windows(self, window_ids: Sequence[int], timeout: float | None = None) -> list[int]: ...
    def close_token(self, token: bytes, timeout: float | None = None) -> list[str]: ...
    def token_users(self, token: bytes) -> list[str]: ...

    # peers
    def connect(self, addr: str) -> str: ...
    def connect_async(self, addr: str) -> Call[str]: ...
    def peer_regions(self, peer: str) -> list[RegionInfo]: ...
    def peer_transport(self, peer: str) -> Literal["tcp", "shm", "ucx"]: ...
    def disconnect(self, peer: str, reason: str = "disconnect") -> None: ...

    # transfers by page
    def write_pages(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> None: ...
    def read_pages(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> None: ...
    def write_pages_async(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> Call[None]: ...
    def read_pages_async(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> Call[None]: ...
    def submit_write_pages(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> Transfer: ...
    def submit_read_pages(
        self,
        peer: str,
        local_region: int,
        local_pages: Sequence[int],
        remote_region: int,
        remote_pages: Sequence[int],
        page_len: int | None = None,
        *,
        token: bytes | None = None,
    ) -> Transfer: ...

    # transfers by byte ranges
    def write(self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None) -> None: ...
    def read(self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None) -> None: ...
    def write_async(
        self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None
    ) -> Call[None]: ...
    def read_async(
        self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None
    ) -> Call[None]: ...
    def submit_write(
        self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None
    ) -> Transfer: ...
    def submit_read(
        self, peer: str, ops: Sequence[_Op], *, token: bytes | None = None
    ) -> Transfer: ...

    # notifications
    def notify(self, peer: str, data: bytes) -> None: ...
    def notify_async(self, peer: str, data: bytes) -> Call[None]: ...
    def recv_notification(self, timeout: float | None = None) -> tuple[str, bytes] | None: ...
    def recv_notification_async(
        self, timeout: float | None = None
    ) -> Call[tuple[str, bytes] | None]: ...
    def get_new_notifs(self) -> dict[str, list[bytes]]: ...

    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Channel: ...
    def __exit__(self, *exc: object) -> bool: ...
