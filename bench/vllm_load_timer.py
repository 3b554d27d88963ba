"""One load-time span for any vLLM KV connector, timed outside the connector's own code.

``kv_connector_module_path: "vllm_load_timer"`` with ``kv_connector`` left as it was
(``"NixlConnector"`` or ``"KvbridgeConnector"``): vLLM's factory looks the name up in this
module, which hands it a subclass of the real connector class that only calls through and
timestamps three of vLLM's calls. vLLM's own checks by connector name
(``has_connector("NixlConnector")``) still see the same name. The bench (bench/vllm_pd.py)
puts this folder on the decoder's ``PYTHONPATH`` and sets ``KVBRIDGE_LOAD_TIMER_DIR``.

Events, one JSON line each, in ``$KVBRIDGE_LOAD_TIMER_DIR/<pid>.jsonl``, times from
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the host, so the
scheduler's and the workers' times subtract):

- ``arrive`` (scheduler process): the scheduler's first ``get_num_new_matched_tokens`` for
  a request whose ``kv_transfer_params`` ask for a remote prefill: the decode request is in
  the decoder's scheduler (the prefill is behind it).
- ``alloc`` (scheduler process): vLLM's scheduler calls ``update_state_after_alloc`` with
  external tokens to load: it has allocated the request's blocks and hands the load to the
  connector. The span starts here for both connectors: it is the same call of vLLM's, made
  before either connector's own code runs, while the first worker-side call naming the
  request comes only after the scheduler's step reaches the workers (a delay the connector
  pays, and part of what is measured).
- ``meta`` (each worker): the first ``bind_connector_metadata`` whose ``reqs_to_recv`` names
  the request (both connectors' metadata carry that dict): the load reached this rank.
- ``post`` (each worker, NixlConnector only): the first call of its worker's
  ``_read_blocks_for_req`` once the prefiller's agent is known, i.e. the reads posted
  (earlier calls only start its handshake). KvbridgeConnector starts its reads at ``meta``.
- ``done`` / ``failed`` (each worker): the first ``get_transfer_results`` (what vLLM 0.32's
  model runner calls at the end of every step; the base class's version calls
  ``get_finished``) reporting the request in ``finished_recving`` / ``failed_recving``,
  with how many such calls (steps) this rank made since ``meta`` and the longest gap
  between two of them.

Load time of a request on a decoder rank: ``done.t - alloc.t``.

Also ``affinity``: the real connector's constructor changed the cores of the thread that
called it (vLLM's worker thread, which runs the model): NixlConnector's CPU worker moves it
to the last core of each NUMA node ("reserve different cores for start_load_kv() from
model_forward()" in its ``base_worker.py``). With ``KVBRIDGE_LOAD_TIMER_KEEP_AFFINITY`` set
the timer moves it back, to see what that move costs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

ENV = "KVBRIDGE_LOAD_TIMER_DIR"
#: set (a diagnostic, not a measurement of the connector as shipped): the thread that built
#: the connector goes back to the cores it had before (NixlConnector's CPU worker moves it)
KEEP = "KVBRIDGE_LOAD_TIMER_KEEP_AFFINITY"

#: the real connector each name stands for: (module, attribute)
REAL = {
    "NixlConnector": ("vllm.distributed.kv_transfer.kv_connector.v1.nixl", "NixlConnector"),
    "KvbridgeConnector": ("kvbridge.vllm", "KvbridgeConnector"),
}

_classes: dict[str, type] = {}
_lock = threading.Lock()
_out: Any = None


def __getattr__(name: str) -> type:
    """vLLM's factory does ``getattr(module, kv_connector)``: the timed class of that name."""
    if name not in REAL:
        raise AttributeError(f"vllm_load_timer times {sorted(REAL)}, not {name!r}")
    with _lock:
        if name not in _classes:
            module, attr = REAL[name]
            _classes[name] = timed(getattr(__import__(module, fromlist=[attr]), attr))
        return _classes[name]


def record(ev: str, req: str, **fields: Any) -> None:
    """Appends one event line (one write per line: the lines of the processes' files never
    interleave)."""
    global _out
    line = json.dumps({"ev": ev, "req": req, "t": time.monotonic(), "pid": os.getpid(), **fields}) + "\n"
    with _lock:
        if _out is None:
            _out = open(os.path.join(os.environ[ENV], f"{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(line)


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no TP group in this process (the scheduler)
        return -1


def timed(real: type) -> type:
    """A subclass of ``real`` that calls through and records the events above."""

    class Timed(real):  # type: ignore[misc, valid-type]
        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            if not os.environ.get(ENV):
                raise RuntimeError(f"vllm_load_timer: set {ENV} to the folder the load times go to")
            before = os.sched_getaffinity(0)
            super().__init__(vllm_config, role, kv_cache_config)
            after = os.sched_getaffinity(0)
            if after != before:
                kept = KEEP in os.environ
                record("affinity", "", role=str(role), before=sorted(before), after=sorted(after), kept=kept)
                if kept:
                    os.sched_setaffinity(0, before)
            self._timer = StepTimer()
            self._arrived: set[str] = set()
            worker = getattr(self, "connector_worker", None)
            if worker is not None and hasattr(worker, "_read_blocks_for_req"):
                hook_nixl_posts(worker, self._timer)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            params = getattr(request, "kv_transfer_params", None) or {}
            if params.get("do_remote_prefill") and request.request_id not in self._arrived:
                self._arrived.add(request.request_id)
                record("arrive", request.request_id)
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens > 0:
                record("alloc", request.request_id, tokens=num_external_tokens)
            super().update_state_after_alloc(request, blocks, num_external_tokens)

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            for req in getattr(connector_metadata, "reqs_to_recv", None) or ():
                self._timer.meta(req)
            super().bind_connector_metadata(connector_metadata)

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            results = super().get_transfer_results(finished_req_ids)
            self._timer.step(results.finished_recving or (), getattr(results, "failed_recving", None) or ())
            return results

    Timed.__name__ = Timed.__qualname__ = "Timed" + real.__name__
    return Timed


class StepTimer:
    """One worker's requests between ``meta`` and ``done``, and its steps meanwhile."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.steps = 0
        self.last_step = time.monotonic()
        # req -> [steps at meta, longest gap between steps since meta, time of meta]
        self.pending: dict[str, list[float]] = {}
        self.seen: set[str] = set()
        self.posted: set[str] = set()

    def _rank(self) -> int:
        if self.rank is None:
            self.rank = tp_rank()
        return self.rank

    def meta(self, req: str) -> None:
        if req in self.seen:
            return
        self.seen.add(req)
        self.pending[req] = [self.steps, 0.0, time.monotonic()]
        record("meta", req, rank=self._rank())

    def post(self, req: str) -> None:
        if req not in self.posted:
            self.posted.add(req)
            record("post", req, rank=self._rank())

    def step(self, finished: Any, failed: Any) -> None:
        now = time.monotonic()
        last, self.last_step = self.last_step, now
        self.steps += 1
        for state in self.pending.values():
            state[1] = max(state[1], now - max(last, state[2]))
        for ev, reqs in (("done", finished), ("failed", failed)):
            for req in reqs:
                state = self.pending.pop(req, None)
                if state is not None:
                    record(ev, req, rank=self._rank(), steps=self.steps - int(state[0]), max_step_gap=state[1])


def hook_nixl_posts(worker: Any, timer: StepTimer) -> None:
    """Times NixlConnector's reads being posted: its worker's ``_read_blocks_for_req`` for a
    prefiller whose agent it has (otherwise the call starts the handshake and returns)."""
    real = worker._read_blocks_for_req

    def read_blocks_for_req(req_id: str, meta: Any) -> Any:
        remote = getattr(meta, "remote", None)
        if remote is not None and remote.engine_id in getattr(worker, "_remote_agents", {}):
            timer.post(req_id)
        return real(req_id, meta)

    worker._read_blocks_for_req = read_blocks_for_req


#: the events a decoder rank records (the others come from the scheduler, with no rank)
WORKER_EVENTS = ("meta", "post", "done", "failed")


def read_events(folder: str) -> list[dict]:
    events: list[dict] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                events += [json.loads(line) for line in f if line.strip()]
    return events


def load_spans(folder: str, since: float) -> tuple[list[dict], list[str]]:
    """The loads the scheduler handed over at or after ``since`` (``time.monotonic()``), one
    per request and decoder rank that reported it done: load time (``load_s``: alloc to
    done) and its parts (``to_meta_s``: alloc to the rank's metadata; ``to_post_s``: to the
    reads posted, NixlConnector only; ``after_post_s``: from then to done), and the steps
    between. Also what is missing: a handed-over request that some rank never reported done,
    or reported failed."""
    events = read_events(folder)
    alloc = {e["req"]: e["t"] for e in events if e["ev"] == "alloc" and e["t"] >= since}
    per_rank: dict[tuple[str, int], dict[str, dict]] = {}
    for e in events:
        if e["ev"] in WORKER_EVENTS and e["req"] in alloc:
            per_rank.setdefault((e["req"], e["rank"]), {}).setdefault(e["ev"], e)
    spans, problems = [], []
    for (req, rank), evs in sorted(per_rank.items()):
        if "failed" in evs or "done" not in evs:
            problems.append(f"{req} rank {rank}: {'failed' if 'failed' in evs else 'never reported done'}")
            continue
        t0, done = alloc[req], evs["done"]
        meta = evs.get("meta", done)["t"]
        post = evs.get("post", evs.get("meta", done))["t"]
        spans.append({
            "req": req, "rank": rank, "load_s": done["t"] - t0, "to_meta_s": meta - t0,
            "to_post_s": post - meta, "after_post_s": done["t"] - post,
            "steps": done["steps"], "max_step_gap_s": done["max_step_gap"],
        })  # fmt: skip
    ranks = {rank for _, rank in per_rank}
    for req in alloc:
        for rank in ranks:
            if (req, rank) not in per_rank:
                problems.append(f"{req} rank {rank}: the load never reached this rank")
    return spans, problems


def request_times(folder: str, since: float) -> list[dict]:
    """Per request the scheduler handed over at or after ``since``, in order of arrival:
    when it arrived in the decoder's scheduler (``arrive``), when its blocks were allocated
    (``alloc``), and when its last decoder rank reported it done (``done``, absent if none)."""
    events = read_events(folder)
    out: dict[str, dict] = {}
    for e in events:
        if e["ev"] == "alloc" and e["t"] >= since:
            out[e["req"]] = {"req": e["req"], "alloc": e["t"]}
    for e in events:
        if e["req"] in out and e["ev"] == "arrive":
            out[e["req"]]["arrive"] = e["t"]
        if e["req"] in out and e["ev"] == "done":
            out[e["req"]]["done"] = max(e["t"], out[e["req"]].get("done", e["t"]))
    return sorted(out.values(), key=lambda r: r.get("arrive", r["alloc"]))
