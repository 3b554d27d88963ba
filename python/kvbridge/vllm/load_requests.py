"""The scheduler's direct line to the decoder's load threads.

vLLM hands a worker its step's connector metadata only when the worker takes that step.
A decoder worker that is not running (vLLM CPU binds every server's worker thread to the
same compute cores, where another engine's worker may be spinning between its own steps)
would take a load's start with it, while the prefiller holds the request's blocks and its
lease runs: loads then end ``lease_ended`` on an idle host. So the scheduler also sends each
load, the moment it allocates the blocks, as one datagram to every rank's load inbox; a
thread on the transfer cores starts it there. The step's metadata still carries the job,
and the worker reports a load to vLLM only once that step delivered it.

Only with synchronous scheduling (``max_concurrent_batches == 1``): then no step runs while
the scheduler allocates, so no write of an earlier step can land in the freshly allocated
blocks after the load's. With async scheduling or pipeline parallelism the inbox is off
and loads start from the step, as before.

The inbox is a Unix datagram socket in a directory only this user can enter (checked, not
assumed), named with a random token the worker hands the scheduler through vLLM's
handshake metadata; a datagram is a hint, validated like any input, and a load it starts
is the same load the step would start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from .cores import run_on
from .metadata import RecvJob

log = logging.getLogger(__name__)

#: A datagram is at most this long (a job of about 20 000 blocks); a longer job goes by the
#: step only.
MAX_DATAGRAM = 200_000
#: A datagram whose job was allocated longer ago is dropped: its step has delivered it.
STALE_S = 10.0
#: How often the inbox thread looks whether it was closed.
POLL_S = 0.5
#: ``sockaddr_un.sun_path`` holds 108 bytes, the terminating NUL included.
MAX_PATH = 107

_FIELDS = {
    "local_block_ids": list,
    "remote_block_ids": list,
    "remote_engine_id": str,
    "remote_request_id": str,
    "remote_host": str,
    "remote_port": int,
    "allocated": float,
    "remote_tp_size": int,
    "hit_block_ids": list,
    "prompt_tokens": int,
    "grant": str,
}

#: The largest prefiller TP size a datagram may name (kvbridge-pd's bound on ranks).
MAX_TP_SIZE = 1 << 16


@dataclass
class InboxAddress(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler at startup: where its inbox is (empty: none)."""

    path: str


def encode(req_id: str, job: RecvJob) -> bytes:
    doc = {k: v for k, v in asdict(job).items() if k in _FIELDS}
    return json.dumps({"req_id": req_id, "job": doc}, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple[str, RecvJob]:
    """The request id and job of a datagram; ``ValueError`` naming what is wrong."""
    if len(data) > MAX_DATAGRAM:
        raise ValueError(f"{len(data)} bytes, more than {MAX_DATAGRAM}")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("req_id"), str) or not isinstance(doc.get("job"), dict):
        raise ValueError("not a {req_id, job} object")
    job = doc["job"]
    fields: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        value = job.get(name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"job.{name} is not a {kind.__name__}")
        fields[name] = value
    for name in ("local_block_ids", "remote_block_ids", "hit_block_ids"):
        ids = fields[name]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
            raise ValueError(f"job.{name} holds something other than block ids")
    # whether the prefiller's blocks cover the prompt depends on its block size, which the
    # load checks against the prefiller's own layout
    if not fields["local_block_ids"] or not fields["remote_block_ids"]:
        raise ValueError("job reads no blocks, or the prefiller offers none")
    if not 0 < fields["remote_port"] < 65536:
        raise ValueError("job.remote_port is not a port")
    if not 0 < fields["remote_tp_size"] <= MAX_TP_SIZE or not 0 <= fields["prompt_tokens"] < 2**40:
        raise ValueError("job.remote_tp_size or job.prompt_tokens is out of range")
    return doc["req_id"], RecvJob(**fields)


def private_dir() -> str | None:
    """``$TMPDIR/kvbridge-<uid>``, made mode 0700; None (with the reason logged) when it
    exists but another user owns it or others can enter it."""
    path = os.path.join(tempfile.gettempdir(), f"kvbridge-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.warning(
            "kvbridge: %s is not a directory of this user's alone (mode %o, uid %d); loads start from vLLM's "
            "steps only", path, stat.S_IMODE(st.st_mode), st.st_uid,
        )  # fmt: skip
        return None
    return path


class LoadRequestInbox:
    """The worker's end: a thread that hands each valid datagram to ``on_job``."""

    def __init__(self, tp_rank: int, on_job: Callable[[str, RecvJob], None], cores: set[int]) -> None:
        self._on_job = on_job
        self._cores = cores
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.path = ""
        self.malformed = 0
        self.received = 0
        where = private_dir()
        if where is None:
            return
        path = os.path.join(where, f"inbox-{os.getpid()}-{tp_rank}-{secrets.token_hex(8)}")
        if len(path.encode()) > MAX_PATH:
            log.warning("kvbridge: inbox path %s is too long for a Unix socket; loads start from vLLM's steps", path)
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_DATAGRAM)
            sock.settimeout(POLL_S)
        except OSError as e:
            sock.close()
            log.warning("kvbridge: cannot open the load inbox %s (%s); loads start from vLLM's steps", path, e)
            return
        self._sock, self.path = sock, path
        self._thread = threading.Thread(target=self._run, name="kvbridge-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        run_on(self._cores)
        sock = self._sock
        assert sock is not None
        while not self._closed.is_set():
            try:
                data = sock.recv(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                raise
            try:
                req_id, job = decode(data)
            except ValueError as e:
                self.malformed += 1
                if self.malformed == 1 or self.malformed % 1000 == 0:
                    log.warning("kvbridge: load inbox: dropped a malformed datagram (%d so far): %s", self.malformed, e)
                continue
            if time.monotonic() - job.allocated <= STALE_S:
                try:
                    self._on_job(req_id, job)
                except Exception:  # a bug, not input: the step still starts the load
                    log.exception("kvbridge: load inbox: starting %s failed", req_id)
            self.received += 1

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(2 * POLL_S)
        if self._sock is not None:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)


class LoadRequestSender:
    """The scheduler's end: sends a job to every rank's inbox, never blocking."""

    def __init__(self) -> None:
        self._paths: list[str] = []
        self._sock: socket.socket | None = None
        self.sent = 0
        self.unsent = 0

    def set_addresses(self, addresses: dict[int, Any], ranks: int) -> None:
        """Every rank's inbox address; with any of the ``ranks`` lacking one, loads start
        from the step only."""
        paths = [a.path for _, a in sorted(addresses.items()) if isinstance(a, InboxAddress) and a.path]
        if len(paths) != ranks or sorted(addresses) != list(range(ranks)):
            return
        self._paths = paths
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        log.info("kvbridge: loads start at allocation, through %d rank inbox(es)", len(paths))

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, req_id: str, job: RecvJob) -> None:
        if self._sock is None:
            return
        data = encode(req_id, job)
        if len(data) > MAX_DATAGRAM:
            self.unsent += 1
            return
        for path in self._paths:
            try:
                self._sock.sendto(data, path)
                self.sent += 1
            except OSError as e:
                # full or gone: this rank starts the load from its step
                self.unsent += 1
                if self.unsent == 1 or self.unsent % 1000 == 0:
                    log.warning("kvbridge: load inbox %s: %s (%d unsent so far)", path, e, self.unsent)
