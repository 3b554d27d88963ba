"""One transfer-time span for any SGLang PD transfer backend, timed outside the backend's code.

SGLang asks ``get_kv_class(backend, KVClassType.RECEIVER)`` for a decode request's receiver
class and ``KVClassType.SENDER`` for a prefill request's sender class each time it makes one
(``disaggregation/decode.py``, ``prefill.py``). ``install()`` rebinds that function in the
modules that imported it to one that hands out a subclass of the backend's real class which
only calls through and timestamps SGLang's calls; the classes of every backend (``mooncake``,
``nixl``, ``kvbridge``) derive from SGLang's ``CommonKVReceiver`` / ``CommonKVSender`` and get
the same calls, so the span is the same for all. bench/sglang_launch.py calls ``install()``
in every process of a server when ``KVBRIDGE_TRANSFER_TIMER_DIR`` is set.

Events, one JSON line each, in ``$KVBRIDGE_TRANSFER_TIMER_DIR/<pid>.jsonl``, times from
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host, so the prefill's
and the decode's times subtract), keyed by SGLang's ``bootstrap_room``:

- ``metadata`` (decode): the receiver's first ``send_metadata``: the decode allocated the
  request's pages and hands their indices to the backend, which sends them to the prefill.
  The span starts here. (SGLang's default ``--disaggregation-decode-allocation-policy early``
  does this as soon as the prefill is known, so the prefill's compute is inside the span.)
- ``done`` / ``failed`` (decode): the first ``poll()`` that returns ``KVPoll.Success`` (after
  ``metadata``) / ``KVPoll.Failed`` (also before it: a failed bootstrap), with how many
  polls (scheduler steps) it took since ``metadata``. The span ends at ``done``.
- ``send`` (prefill): each ``send()`` of a chunk's pages (chunked prefill sends as it computes);
  the last one hands over the request's last chunk.
- ``sent`` / ``send_failed`` (prefill): the sender's first ``poll()`` returning Success / Failed.

Transfer time of a request: ``done.t - metadata.t``. Its tail: ``done.t - last send.t``, from
the prefill handing over its last chunk to the decode seeing the KV complete (the part of
the transfer that no compute hides).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from typing import Any, Callable

ENV = "KVBRIDGE_TRANSFER_TIMER_DIR"
#: SGLang's ``KVPoll`` values (``disaggregation/base/conn.py``): plain ints, compared as such
FAILED, SUCCESS = 0, 4
#: Modules that import ``get_kv_class`` by name (kvbridge.sglang.install's list)
GET_KV_CLASS_USERS = (
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)

_lock = threading.Lock()
_out: Any = None
_timed: dict[type, type] = {}


def record(ev: str, room: Any, **fields: Any) -> None:
    """Appends one event line (one write per line: the lines of the processes' files never
    interleave)."""
    global _out
    line = json.dumps({"ev": ev, "room": room, "t": time.monotonic(), "pid": os.getpid(), **fields}) + "\n"
    with _lock:
        if _out is None:
            _out = open(os.path.join(os.environ[ENV], f"{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(line)


def _check_env() -> None:
    if not os.environ.get(ENV):
        raise RuntimeError(f"sglang_transfer_timer: set {ENV} to the folder the transfer times go to")


def timed_receiver(real: type) -> type:
    """A subclass of the decode-side ``real`` that calls through and records ``metadata``,
    ``done`` and ``failed``."""

    class Timed(real):  # type: ignore[misc, valid-type]
        _t_polls = 0
        _t_sent = False
        _t_ended = False

        def __init__(self, *args: Any, **kwargs: Any):
            _check_env()
            super().__init__(*args, **kwargs)

        def send_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if not self._t_sent:
                self._t_sent = True
                record("metadata", getattr(self, "bootstrap_room", None))
            return super().send_metadata(*args, **kwargs)

        def poll(self) -> Any:
            status = super().poll()
            if not self._t_ended:
                self._t_polls += self._t_sent
                # a request may fail before its metadata (bootstrap); it succeeds only after
                if status == FAILED or (status == SUCCESS and self._t_sent):
                    self._t_ended = True
                    ev = "done" if status == SUCCESS else "failed"
                    record(ev, getattr(self, "bootstrap_room", None), polls=self._t_polls)
            return status

    Timed.__name__ = Timed.__qualname__ = "Timed" + real.__name__
    return Timed


def timed_sender(real: type) -> type:
    """A subclass of the prefill-side ``real`` that calls through and records ``send``,
    ``sent`` and ``send_failed``."""

    class Timed(real):  # type: ignore[misc, valid-type]
        _t_chunks = 0
        _t_ended = False

        def __init__(self, *args: Any, **kwargs: Any):
            _check_env()
            super().__init__(*args, **kwargs)

        def send(self, *args: Any, **kwargs: Any) -> Any:
            self._t_chunks += 1
            record("send", getattr(self, "bootstrap_room", None), chunk=self._t_chunks)
            return super().send(*args, **kwargs)

        def poll(self) -> Any:
            status = super().poll()
            if self._t_chunks and not self._t_ended and (status == SUCCESS or status == FAILED):
                self._t_ended = True
                record("sent" if status == SUCCESS else "send_failed", getattr(self, "bootstrap_room", None))
            return status

    Timed.__name__ = Timed.__qualname__ = "Timed" + real.__name__
    return Timed


def timed(real: type, kind: str) -> type:
    """The timed subclass of ``real`` (``kind``: "receiver" or "sender"), made once per class:
    SGLang asks for the class per request."""
    with _lock:
        if real not in _timed:
            _timed[real] = (timed_receiver if kind == "receiver" else timed_sender)(real)
        return _timed[real]


def wrap(get_kv_class: Callable[..., Any], receiver: Any, sender: Any) -> Callable[..., Any]:
    """``get_kv_class`` whose receiver and sender classes (``receiver``, ``sender``: SGLang's
    ``KVClassType`` members) come back timed; anything else as it was."""

    def timed_get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        cls = get_kv_class(transfer_backend, class_type)
        if cls is not None and class_type == receiver:
            return timed(cls, "receiver")
        if cls is not None and class_type == sender:
            return timed(cls, "sender")
        return cls

    timed_get_kv_class.__wrapped__ = get_kv_class  # type: ignore[attr-defined]
    timed_get_kv_class.transfer_timer = True  # type: ignore[attr-defined]
    # kvbridge.sglang.install() leaves a function so marked alone (it runs again in each
    # process as SGLang's plugin, after this hook; the hook already wraps its own)
    timed_get_kv_class.kvbridge_hook = True  # type: ignore[attr-defined]
    return timed_get_kv_class


def install() -> list[str]:
    """Times every backend's receivers and senders in this process; returns the modules
    patched. Call it after anything else that rebinds ``get_kv_class`` (kvbridge's hook)."""
    _check_env()
    utils = importlib.import_module(GET_KV_CLASS_USERS[0])
    kinds = utils.KVClassType
    patched = []
    for name in GET_KV_CLASS_USERS:
        mod = importlib.import_module(name)
        fn = getattr(mod, "get_kv_class", None)
        if fn is None or getattr(fn, "transfer_timer", False):
            continue
        mod.get_kv_class = wrap(fn, kinds.RECEIVER, kinds.SENDER)
        patched.append(name)
    return patched


def read_events(folder: str) -> list[dict]:
    events: list[dict] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                events += [json.loads(line) for line in f if line.strip()]
    return events


def transfer_spans(folders: list[str], since: float) -> tuple[list[dict], list[str]]:
    """The transfers whose decode sent its metadata at or after ``since``
    (``time.monotonic()``), one per room, in order of ``metadata``: ``transfer_s`` (metadata
    to done) and, with the prefill's events, its three parts: ``to_first_chunk_s`` (to the
    prefill's first ``send``: its queue and first chunk's compute), ``chunks_s`` (first to
    last ``send``: the other chunks' compute, their transfers overlapping it) and ``tail_s``
    (the last ``send`` to done); ``chunks``, ``polls``. Also what is wrong: a room that failed on either side
    at or after ``since`` (with or without metadata), never reported done, or whose prefill
    never reported it sent."""
    events = [e for f in folders for e in read_events(f)]
    first: dict[tuple[str, Any], dict] = {}
    last_send: dict[Any, dict] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        first.setdefault((e["ev"], e["room"]), e)
        if e["ev"] == "send":
            last_send[e["room"]] = e
    rooms = sorted(
        (room for (ev, room), e in first.items() if ev == "metadata" and e["t"] >= since),
        key=lambda room: first[("metadata", room)]["t"],
    )
    failed = sorted({e["room"] for e in events if e["ev"] in ("failed", "send_failed") and e["t"] >= since}, key=str)
    problems = [f"room {room}: failed" for room in failed]
    spans = []
    prefill_seen = any(e["ev"] == "send" for e in events)
    for room in rooms:
        meta, done = first[("metadata", room)], first.get(("done", room))
        if room in failed:
            continue
        if done is None:
            problems.append(f"room {room}: the decode never reported it done")
            continue
        span = {"room": room, "transfer_s": done["t"] - meta["t"], "polls": done["polls"]}
        if prefill_seen:
            if room not in last_send or ("sent", room) not in first:
                problems.append(f"room {room}: the prefill never reported it sent")
                continue
            first_send, last = first[("send", room)], last_send[room]
            span.update(
                to_first_chunk_s=first_send["t"] - meta["t"], chunks_s=last["t"] - first_send["t"],
                tail_s=done["t"] - last["t"], chunks=last["chunk"],
            )  # fmt: skip
        spans.append(span)
    return spans, problems
