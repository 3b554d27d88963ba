"""bench/vllm_load_timer.py without vLLM: a stand-in connector class with the calls vLLM
makes, timed through ``timed``, and ``load_spans`` over the events it wrote.

Run: ``python -m pytest bench/test_vllm_load_timer.py`` (scripts/test.sh runs it in its
"bench timers" suite, counted)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import vllm_load_timer as timer


@dataclass
class Results:
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


@dataclass
class Meta:
    reqs_to_recv: dict


@dataclass
class Request:
    request_id: str
    kv_transfer_params: dict | None = None


class Connector:
    """What the timer wraps: records every call, so a test sees each one went through."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        self.calls: list[tuple] = []
        self.finish: set = set()
        self.fail: set = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("matched", request.request_id))
        return 64, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.request_id, num_external_tokens))

    def bind_connector_metadata(self, meta):
        self.calls.append(("bind", sorted(meta.reqs_to_recv)))

    def get_transfer_results(self, finished_req_ids):
        self.calls.append(("results", set(finished_req_ids)))
        out = Results(set(self.finish), set(self.fail))
        self.finish.clear()
        self.fail.clear()
        return out


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(timer.ENV, str(tmp_path))
    monkeypatch.setattr(timer, "_out", None)
    monkeypatch.setattr(timer, "tp_rank", lambda: 0)  # no vLLM TP group here
    yield tmp_path
    if timer._out is not None:
        timer._out.close()


def events(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_the_timed_class_calls_through_and_returns_what_the_connector_returned(folder):
    c = timer.timed(Connector)("cfg", "role")
    c.update_state_after_alloc(Request("a"), "blocks", 64)
    c.bind_connector_metadata(Meta({"a": object()}))
    c.finish.add("a")
    out = c.get_transfer_results({"x"})
    assert out.finished_recving == {"a"}
    assert c.calls == [("alloc", "a", 64), ("bind", ["a"]), ("results", {"x"})]
    assert type(c).__name__ == "TimedConnector" and isinstance(c, Connector)


def test_a_load_spans_from_alloc_to_the_step_that_reported_it(folder):
    c = timer.timed(Connector)("cfg", "role")
    c.update_state_after_alloc(Request("local"), "blocks", 0)  # nothing to load: no event
    c.update_state_after_alloc(Request("a"), "blocks", 64)
    c.bind_connector_metadata(Meta({"a": object()}))
    c.get_transfer_results(set())
    c.get_transfer_results(set())
    c.finish.add("a")
    c.get_transfer_results(set())
    evs = events(folder)
    assert [e["ev"] for e in evs] == ["alloc", "meta", "done"]
    by = {e["ev"]: e for e in evs}
    assert by["done"]["steps"] == 3
    spans, problems = timer.load_spans(str(folder), since=0.0)
    assert problems == []
    (sp,) = spans
    assert sp["load_s"] == pytest.approx(by["done"]["t"] - by["alloc"]["t"])
    assert sp["to_meta_s"] + sp["to_post_s"] + sp["after_post_s"] == pytest.approx(sp["load_s"])


def test_loads_handed_over_before_since_are_left_out(folder):
    c = timer.timed(Connector)("cfg", "role")
    c.update_state_after_alloc(Request("warm"), "blocks", 64)
    c.bind_connector_metadata(Meta({"warm": object()}))
    c.finish.add("warm")
    c.get_transfer_results(set())
    assert timer.load_spans(str(folder), since=events(folder)[-1]["t"] + 1) == ([], [])


def test_a_failed_load_and_a_rank_that_never_reported_are_problems(folder):
    rank0 = timer.timed(Connector)("cfg", "role")
    rank1 = timer.timed(Connector)("cfg", "role")
    rank0._timer.rank, rank1._timer.rank = 0, 1
    rank0.update_state_after_alloc(Request("a"), "blocks", 64)
    rank0.update_state_after_alloc(Request("b"), "blocks", 64)
    for c in (rank0, rank1):
        c.bind_connector_metadata(Meta({"a": object(), "b": object()}))
    rank0.fail.add("a")
    rank0.finish.add("b")
    rank0.get_transfer_results(set())
    rank1.finish.add("a")
    rank1.get_transfer_results(set())
    spans, problems = timer.load_spans(str(folder), since=0.0)
    assert [(s["req"], s["rank"]) for s in spans] == [("a", 1), ("b", 0)]
    assert sorted(problems) == ["a rank 0: failed", "b rank 1: never reported done"]


def test_without_the_folder_the_timer_refuses_to_start(monkeypatch):
    monkeypatch.delenv(timer.ENV, raising=False)
    with pytest.raises(RuntimeError, match=timer.ENV):
        timer.timed(Connector)("cfg", "role")


def test_vllm_finds_only_the_connectors_it_times():
    with pytest.raises(AttributeError, match="not 'Other'"):
        timer.Other  # noqa: B018


def test_each_process_writes_its_own_file(folder):
    timer.record("alloc", "a")
    assert [p.name for p in folder.iterdir()] == [f"{os.getpid()}.jsonl"]


def test_a_request_arrives_once_and_its_times_follow_each_other(folder):
    c = timer.timed(Connector)("cfg", "role")
    remote = Request("a", {"do_remote_prefill": True})
    assert c.get_num_new_matched_tokens(Request("local"), 0) == (64, True)  # no remote prefill
    c.get_num_new_matched_tokens(remote, 0)
    c.get_num_new_matched_tokens(remote, 0)  # asked again while it waits: the same arrival
    c.update_state_after_alloc(remote, "blocks", 64)
    c.bind_connector_metadata(Meta({"a": object()}))
    c.finish.add("a")
    c.get_transfer_results(set())
    assert [e["ev"] for e in events(folder)] == ["arrive", "alloc", "meta", "done"]
    (r,) = timer.request_times(str(folder), since=0.0)
    assert r["req"] == "a" and r["arrive"] <= r["alloc"] <= r["done"]
    spans, problems = timer.load_spans(str(folder), since=0.0)  # the scheduler's events have no rank
    assert [(sp["req"], sp["rank"]) for sp in spans] == [("a", 0)] and problems == []


def test_the_longest_step_gap_counts_from_the_metadata_not_from_the_idle_time_before(folder, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(timer.time, "monotonic", lambda: clock[0])
    c = timer.timed(Connector)("cfg", "role")
    c.get_transfer_results(set())
    clock[0] += 30.0  # idle: no request yet
    c.update_state_after_alloc(Request("a"), "blocks", 64)
    c.bind_connector_metadata(Meta({"a": object()}))
    clock[0] += 0.5
    c.get_transfer_results(set())
    clock[0] += 2.0
    c.finish.add("a")
    c.get_transfer_results(set())
    done = events(folder)[-1]
    assert (done["ev"], done["steps"], done["max_step_gap"]) == ("done", 2, 2.0)


class Repinning(Connector):
    """Moves the thread that builds it to the last core, as NixlConnector's CPU worker does."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


@pytest.fixture
def all_cores():
    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("needs 2 cores")
    yield mine
    os.sched_setaffinity(0, mine)


@pytest.mark.parametrize("keep", [False, True])
def test_a_connector_that_moves_its_builders_thread_is_recorded_and_kept_back_on_request(
    folder, all_cores, monkeypatch, keep
):
    if keep:
        monkeypatch.setenv(timer.KEEP, "1")
    timer.timed(Repinning)("cfg", "worker")
    (ev,) = events(folder)
    assert (ev["ev"], ev["before"], ev["after"], ev["kept"]) == ("affinity", sorted(all_cores), [max(all_cores)], keep)
    assert os.sched_getaffinity(0) == (all_cores if keep else {max(all_cores)})


def test_a_connector_that_leaves_the_thread_alone_records_nothing(folder, all_cores):
    timer.timed(Connector)("cfg", "worker")
    assert events(folder) == []
