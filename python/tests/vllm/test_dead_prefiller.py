"""A prefiller that stops answering (stopped, or killed while the kernel still tears its
process down, which keeps its sockets open for seconds on a loaded host) holds up nothing
of the decoder's work with other prefillers: neither their loads nor their "read done"
notices. Once its sockets are closed, loads from it fail at once as a lost peer.

Prefillers run in processes of their own (prefiller_process.py) so that they can be
stopped and killed; the decoder is a worker in this process."""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvbridge.vllm.metadata import KvbridgeConnectorMetadata, RecvJob

from vllm_helpers import LAYERS, kv_caches
from vllm_helpers import recv_job  # noqa: E402

HERE = Path(__file__).parent
READ_TIMEOUT_S = 4.0
#: Well under the read deadline, well over a load between live processes on a loaded host.
PROMPT_S = 2.5
REQS = [f"r{i}" for i in range(8)]


class Prefiller:
    def __init__(self, seed: int):
        self.seed = seed
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "prefiller_process.py"), str(seed), *REQS],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=HERE,
            # no cross-memory attach: the decoder's reads wait on the prefiller process (as
            # from another host), so a stopped prefiller does not answer them
            env={**os.environ, "KVBRIDGE_CMA": "0"},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.lines.get(timeout=120)
        assert line and ":" in line, line
        self.host, port = line.rsplit(":", 1)
        self.port = int(port)

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line.strip())
        self.lines.put("")

    def freed(self, req: str, timeout: float) -> bool:
        """Whether the prefiller says `req`'s blocks were freed by a notice within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            if line == f"freed {req}":
                return True
            if not line:
                return False

    def job(self, local, remote, req) -> RecvJob:
        return recv_job(
            local_block_ids=list(local),
            remote_block_ids=list(remote),
            remote_engine_id=f"P{self.seed}",
            remote_request_id=req,
            remote_host=self.host,
            remote_port=self.port,
        )

    def signal(self, sig: int) -> None:
        os.kill(self.p.pid, sig)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGCONT)
            self.p.kill()
        self.p.wait(30)


@pytest.fixture
def prefillers():
    made: list[Prefiller] = []

    def make(seed):
        made.append(Prefiller(seed))
        return made[-1]

    yield make
    for p in made:
        p.stop()


@pytest.fixture
def decoder(workers):
    caches = kv_caches(seed=None)
    d = workers("kv_consumer", caches, engine_id="D", extra={"kvbridge_read_timeout_s": READ_TIMEOUT_S, "kvbridge_lease_s": 30.0})
    d.caches = caches
    return d


def wait_reported(worker, *reqs: str, timeout: float = READ_TIMEOUT_S + 15) -> float:
    """Polls get_finished as vLLM's steps would until every one of `reqs` is reported; the
    seconds it took."""
    t0 = time.monotonic()
    left = set(reqs)
    while time.monotonic() - t0 < timeout:
        _, recving = worker.get_finished(set())
        left -= recving or set()
        if not left:
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"{sorted(left)} not reported in {timeout} s")


def load(worker, req: str, job: RecvJob) -> None:
    worker.start_load_kv(KvbridgeConnectorMetadata(reqs_to_recv={req: job}))


def assert_read(decoder, local: int, prefiller: Prefiller, remote: int) -> None:
    theirs = kv_caches(seed=prefiller.seed)
    for name in LAYERS:
        assert torch.equal(decoder.caches[name][local], theirs[name][remote]), name


def test_a_hung_prefillers_connect_holds_up_no_load_from_another(decoder, prefillers):
    hung, live = prefillers(11), prefillers(12)
    # The decoder never spoke to `hung`: its next load dials it, and the kernel completes
    # the TCP connect into the stopped process's backlog, so the handshake waits.
    hung.signal(signal.SIGSTOP)
    load(decoder, "d-hung", hung.job([1], [1], "r0"))
    time.sleep(0.3)  # let the dial start first (the order under test), not a readiness wait
    load(decoder, "d-live", live.job([2], [3], "r1"))
    took = wait_reported(decoder, "d-live")
    assert "d-live" not in decoder.take_failed_recving()
    assert took < PROMPT_S, f"a load from a live prefiller took {took:.2f} s while another prefiller hung"
    assert_read(decoder, 2, live, 3)
    assert live.freed("r1", PROMPT_S), "the live prefiller's notice was held up"
    # the hung one's load ends too, at its deadline, as a failure
    wait_reported(decoder, "d-hung")
    assert "d-hung" in decoder.take_failed_recving()


def test_notices_to_a_silent_prefiller_hold_up_no_notice_to_another_and_its_death_is_seen(decoder, prefillers):
    victim, live = prefillers(21), prefillers(22)
    load(decoder, "d-0", victim.job([0], [0], "r0"))
    wait_reported(decoder, "d-0")
    assert decoder.take_failed_recving() == set()
    assert victim.freed("r0", PROMPT_S)

    # The victim stops answering with its sockets open: reads from it end at their
    # deadline, and their notices wait on it (more of them than the decoder has threads).
    victim.signal(signal.SIGSTOP)
    for i in range(1, 4):
        load(decoder, f"d-{i}", victim.job([i], [i], f"r{i}"))
    wait_reported(decoder, "d-1", "d-2", "d-3")
    assert decoder.take_failed_recving() == {"d-1", "d-2", "d-3"}

    # Another prefiller's load and notice go through at once.
    load(decoder, "d-live", live.job([5], [6], "r4"))
    took = wait_reported(decoder, "d-live")
    assert decoder.take_failed_recving() == set()
    assert took < PROMPT_S, took
    assert_read(decoder, 5, live, 6)
    assert live.freed("r4", PROMPT_S), "the live prefiller's notice waited behind notices to a silent one"

    # Killed for good (its sockets closed): the next load from it fails as a lost peer or
    # an unreachable one, at once, not at the read deadline.
    victim.signal(signal.SIGKILL)
    victim.p.wait(30)
    before = dict(decoder.stats)
    load(decoder, "d-after", victim.job([7], [7], "r5"))
    took = wait_reported(decoder, "d-after")
    assert decoder.take_failed_recving() == {"d-after"}
    assert took < PROMPT_S, f"a load from a dead prefiller failed only after {took:.2f} s"
    lost = ("loads_failed_unreachable", "loads_failed_peer_lost")
    assert sum(decoder.stats[k] - before[k] for k in lost) == 1, decoder.stats
    assert decoder.stats["loads_failed_timeout"] == before["loads_failed_timeout"]


def test_a_slow_load_is_logged_with_the_time_of_each_step(decoder, prefillers):
    slow = prefillers(31)
    load(decoder, "d-0", slow.job([0], [0], "r0"))  # the session exists from here on
    wait_reported(decoder, "d-0")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("kvbridge.vllm.worker").addHandler(handler)
    try:
        slow.signal(signal.SIGSTOP)
        load(decoder, "d-1", slow.job([1], [1], "r1"))
        time.sleep(1.5)  # the stall under test: the read waits on the stopped prefiller
        slow.signal(signal.SIGCONT)
        wait_reported(decoder, "d-1")
    finally:
        logging.getLogger("kvbridge.vllm.worker").removeHandler(handler)
    assert decoder.take_failed_recving() == set()
    assert_read(decoder, 1, slow, 1)
    slow_logs = [m for m in seen if "slow load of d-1" in m]
    assert len(slow_logs) == 1, seen
    reading = float(re.search(r"([0-9.]+) s reading", slow_logs[0]).group(1))
    assert reading >= 1.0, slow_logs[0]


def test_reads_given_up_at_the_deadline_land_nothing_once_their_blocks_are_reported(decoder, prefillers):
    """A load whose reads pass the read deadline is reported failed, and vLLM may hand its
    blocks to another request at once. So nothing of the given-up reads may land there
    afterwards, even when the stopped prefiller wakes and answers the read it was sent: the
    connector ends the session the reads went over before it reports the blocks."""
    slow = prefillers(41)
    load(decoder, "d-0", slow.job([0], [0], "r0"))  # the session exists from here on
    wait_reported(decoder, "d-0")
    assert decoder.take_failed_recving() == set()
    slow.signal(signal.SIGSTOP)
    try:
        load(decoder, "d-1", slow.job([2], [1], "r1"))
        wait_reported(decoder, "d-1")  # at the read deadline
        assert decoder.take_failed_recving() == {"d-1"}
        # vLLM gave block 2 to another request, which wrote its own KV there
        for name in LAYERS:
            decoder.caches[name][2].fill_(1.5)
    finally:
        slow.signal(signal.SIGCONT)
    # the woken prefiller reads the request it was sent while stopped, and answers it if
    # the session is still up; a load from it after that (a fresh session, or the same
    # one behind that answer) shows it has caught up
    load(decoder, "d-2", slow.job([3], [2], "r2"))
    wait_reported(decoder, "d-2")
    assert decoder.take_failed_recving() == set()
    assert_read(decoder, 3, slow, 2)
    for name in LAYERS:
        assert bool((decoder.caches[name][2] == 1.5).all()), f"a given-up read landed in block 2 of {name}"
