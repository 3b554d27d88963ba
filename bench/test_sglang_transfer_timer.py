"""bench/sglang_transfer_timer.py and the backends' CPU stand-ins (bench/sglang_nixl_dram.py,
bench/sglang_mooncake_cpu.py) without SGLang, NIXL or Mooncake:
stand-in receiver and sender classes with the calls SGLang makes, timed through the hooked
``get_kv_class``, and ``transfer_spans`` over the events they wrote.

Run: ``python -m pytest bench`` (scripts/test.sh's "bench timers" suite, counted)."""

from __future__ import annotations

import enum
import json
import os
import sys
import types
from pathlib import Path

import pytest
import sglang_mooncake_cpu
import sglang_nixl_dram
import sglang_transfer_timer as timer

FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)  # SGLang's KVPoll


class Receiver:
    """What the timer wraps on a decode: records every call and answers polls from a script."""

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.bootstrap_room = bootstrap_room
        self.calls: list[tuple] = []
        self.statuses = [WAITING]

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None):
        self.calls.append(("metadata", list(kv_indices), aux_index))
        return "sent"

    def poll(self):
        self.calls.append(("poll",))
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


class Sender(Receiver):
    """What the timer wraps on a prefill."""

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None):
        self.calls.append(("send", list(kv_indices), num_kv_tokens))


class KVClassType(enum.Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"


def get_kv_class(transfer_backend, class_type):
    return {KVClassType.RECEIVER: Receiver, KVClassType.SENDER: Sender, KVClassType.MANAGER: dict}.get(class_type)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(timer.ENV, str(tmp_path))
    monkeypatch.setattr(timer, "_out", None)
    yield tmp_path
    if timer._out is not None:
        timer._out.close()


@pytest.fixture
def classes(folder):
    hooked = timer.wrap(get_kv_class, KVClassType.RECEIVER, KVClassType.SENDER)
    return hooked("nixl", KVClassType.RECEIVER), hooked("nixl", KVClassType.SENDER)


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_the_timed_classes_call_through_and_return_what_the_backend_returned(classes):
    recv_cls, send_cls = classes
    r = recv_cls("mgr", "addr", bootstrap_room=7)
    r.statuses = [TRANSFERRING, SUCCESS]
    assert r.send_metadata([1, 2], aux_index=3) == "sent"
    assert [r.poll(), r.poll()] == [TRANSFERRING, SUCCESS]
    assert r.calls == [("metadata", [1, 2], 3), ("poll",), ("poll",)]
    s = send_cls("mgr", "addr", 7)
    s.send([5], num_kv_tokens=32)
    assert s.calls == [("send", [5], 32)]
    assert isinstance(r, Receiver) and type(r).__name__ == "TimedReceiver"
    assert isinstance(s, Sender) and type(s).__name__ == "TimedSender"


def test_the_hook_times_receivers_and_senders_only_and_makes_each_class_once(folder):
    hooked = timer.wrap(get_kv_class, KVClassType.RECEIVER, KVClassType.SENDER)
    assert hooked("x", KVClassType.RECEIVER) is hooked("y", KVClassType.RECEIVER)
    assert hooked("x", KVClassType.MANAGER) is dict and hooked("x", KVClassType.KVARGS) is None
    assert hooked.__wrapped__ is get_kv_class


def test_a_transfer_spans_from_the_metadata_to_the_first_success_poll(folder, classes):
    recv_cls, send_cls = classes
    r = recv_cls("mgr", "addr", 7)
    r.poll()  # before the metadata: bootstrapping, not timed
    r.send_metadata([1])
    s = send_cls("mgr", "addr", 7)
    s.send([1])
    s.send([2])
    r.statuses = [TRANSFERRING, TRANSFERRING, SUCCESS]
    r.poll(), r.poll(), r.poll(), r.poll()  # the last: after Success, not recorded again
    s.statuses = [SUCCESS]
    s.poll(), s.poll()
    evs = events(folder)
    assert [e["ev"] for e in evs] == ["metadata", "send", "send", "done", "sent"]
    by = {e["ev"]: e for e in evs}
    assert by["done"]["polls"] == 3
    (sp,), problems = timer.transfer_spans([str(folder)], since=0.0)
    assert problems == []
    assert sp["transfer_s"] == pytest.approx(by["done"]["t"] - by["metadata"]["t"])
    assert sp["tail_s"] == pytest.approx(by["done"]["t"] - evs[2]["t"])  # from the last chunk
    assert sp["to_first_chunk_s"] == pytest.approx(evs[1]["t"] - by["metadata"]["t"])
    assert sp["to_first_chunk_s"] + sp["chunks_s"] + sp["tail_s"] == pytest.approx(sp["transfer_s"])
    assert (sp["room"], sp["chunks"], sp["polls"]) == (7, 2, 3)


def test_a_failed_transfer_is_a_problem_on_either_side_even_before_the_metadata(folder, classes):
    recv_cls, send_cls = classes
    early = recv_cls("mgr", "addr", 1)
    early.statuses = [FAILED]
    early.poll()  # failed while bootstrapping: no metadata was ever sent
    late = recv_cls("mgr", "addr", 2)
    late.send_metadata([1])
    late.statuses = [FAILED]
    late.poll()
    ok = recv_cls("mgr", "addr", 3)
    ok.send_metadata([1])
    ok.statuses = [SUCCESS]
    ok.poll()
    s = send_cls("mgr", "addr", 3)
    s.send([1])
    s.statuses = [FAILED]
    s.poll()
    spans, problems = timer.transfer_spans([str(folder)], since=0.0)
    assert spans == []
    assert sorted(problems) == ["room 1: failed", "room 2: failed", "room 3: failed"]


def test_transfers_before_since_are_left_out_and_a_missing_end_is_a_problem(folder, classes):
    recv_cls, _ = classes
    warm = recv_cls("mgr", "addr", 1)
    warm.send_metadata([1])
    warm.statuses = [SUCCESS]
    warm.poll()
    since = events(folder)[-1]["t"] + 1e-9
    assert timer.transfer_spans([str(folder)], since) == ([], [])
    timer.record("metadata", 2)
    assert timer.transfer_spans([str(folder)], since) == ([], ["room 2: the decode never reported it done"])


def test_with_the_prefills_events_a_room_the_prefill_never_reported_sent_is_a_problem(folder, classes):
    recv_cls, send_cls = classes
    for room in (1, 2):
        r = recv_cls("mgr", "addr", room)
        r.send_metadata([1])
        r.statuses = [SUCCESS]
        r.poll()
    s = send_cls("mgr", "addr", 1)
    s.send([1])
    s.statuses = [SUCCESS]
    s.poll()
    spans, problems = timer.transfer_spans([str(folder)], since=0.0)
    assert [sp["room"] for sp in spans] == [1]
    assert problems == ["room 2: the prefill never reported it sent"]


def test_events_of_two_processes_folders_join_by_room(folder, classes, tmp_path_factory):
    recv_cls, _ = classes
    r = recv_cls("mgr", "addr", 5)
    r.send_metadata([1])
    r.statuses = [SUCCESS]
    r.poll()
    other = tmp_path_factory.mktemp("prefill")
    t = events(folder)[0]["t"]
    lines = [{"ev": "send", "room": 5, "t": t, "pid": 1, "chunk": 1}, {"ev": "sent", "room": 5, "t": t, "pid": 1}]
    (other / "1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    (sp,), problems = timer.transfer_spans([str(folder), str(other)], since=0.0)
    assert problems == [] and sp["tail_s"] == pytest.approx(sp["transfer_s"])


def test_without_the_folder_the_timed_classes_refuse_to_start(monkeypatch):
    monkeypatch.delenv(timer.ENV, raising=False)
    hooked = timer.wrap(get_kv_class, KVClassType.RECEIVER, KVClassType.SENDER)
    with pytest.raises(RuntimeError, match=timer.ENV):
        hooked("nixl", KVClassType.RECEIVER)("mgr", "addr", 1)


def test_each_process_writes_its_own_file(folder):
    timer.record("metadata", 1)
    assert [p.name for p in folder.iterdir()] == [f"{os.getpid()}.jsonl"]


@pytest.fixture
def sglang_modules(monkeypatch):
    """SGLang's modules that import get_kv_class, as stand-ins in sys.modules."""
    mods = {}
    for name in timer.GET_KV_CLASS_USERS:
        mod = types.ModuleType(name)
        mod.get_kv_class = get_kv_class
        mod.KVClassType = KVClassType
        monkeypatch.setitem(sys.modules, name, mod)
        mods[name] = mod
    return mods


def test_install_hooks_every_module_that_imported_get_kv_class_once(folder, sglang_modules):
    assert timer.install() == list(timer.GET_KV_CLASS_USERS)
    assert timer.install() == []  # already hooked: not wrapped twice
    decode = sglang_modules["sglang.srt.disaggregation.decode"]
    assert decode.get_kv_class.__wrapped__ is get_kv_class
    assert decode.get_kv_class("kvbridge", KVClassType.RECEIVER).__name__ == "TimedReceiver"
    # kvbridge.sglang.install() skips a function so marked instead of wrapping it again
    assert decode.get_kv_class.kvbridge_hook is True


class Agent:
    """NIXL's agent's calls that take a memory kind, recording what they were given."""

    def __init__(self):
        self.got: list = []

    def register_memory(self, reg_list, mem_type=None, backends=()):
        self.got.append(("register", mem_type, backends))

    def get_reg_descs(self, descs, mem_type=None):
        self.got.append(("reg", mem_type))

    def get_xfer_descs(self, descs, mem_type=None):
        self.got.append(("xfer", mem_type))

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        self.got.append(("prep", agent_name, mem_type))


def test_nixl_is_told_dram_where_sglang_says_vram_and_nothing_else_changes(monkeypatch):
    cls = type("Agent", (Agent,), {})
    sglang_nixl_dram.install(cls)
    sglang_nixl_dram.install(cls)  # once only
    a = cls()
    a.register_memory([1], "VRAM", ["UCX"])
    a.register_memory([1], mem_type="VRAM")
    a.register_memory([1], "DRAM")
    a.get_reg_descs([1], "VRAM")
    a.get_xfer_descs([1], mem_type="VRAM")
    a.prep_xfer_dlist("VRAM", [1], "VRAM")  # an agent named VRAM keeps its name
    a.prep_xfer_dlist("peer", [1], mem_type="FILE")
    assert a.got == [
        ("register", "DRAM", ["UCX"]), ("register", "DRAM", ()), ("register", "DRAM", ()),
        ("reg", "DRAM"), ("xfer", "DRAM"), ("prep", "VRAM", "DRAM"), ("prep", "peer", "FILE"),
    ]  # fmt: skip


def test_mooncakes_sender_takes_its_page_indices_as_every_other_backends_on_cpu():
    sender = type("MooncakeKVSender", (), {"supports_host_tensor_indices": True})
    sglang_mooncake_cpu.install(sender)
    assert sender.supports_host_tensor_indices is False
