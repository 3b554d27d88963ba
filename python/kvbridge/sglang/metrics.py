"""The backend's counters (``KvbridgeKVManager.stats``) on SGLang's ``/metrics`` when the
server runs with ``--enable-metrics``.

SGLang serves Prometheus metrics in ``prometheus_client``'s multiprocess mode: the launcher
sets ``PROMETHEUS_MULTIPROC_DIR`` before any process imports ``prometheus_client``, each
scheduler process writes its metrics' values to files there, and the HTTP server's
``/metrics`` adds them up (``add_prometheus_middleware``: a ``CollectorRegistry`` with a
``MultiProcessCollector``). The manager runs in a scheduler process, so its counters are
``prometheus_client`` counters of that process's default registry, as SGLang's own
scheduler metrics (and its Mooncake backend's ``sglang:failed_session_recoveries``) are:
each stat ``NAME`` is the counter ``kvbridge_NAME`` (exposed as ``kvbridge_NAME_total``),
labelled as SGLang labels its scheduler metrics (``model_name``, ``engine_type``:
``prefill`` or ``decode``, ``tp_rank``). Without ``--enable-metrics`` nothing is imported
and ``stats`` is a plain dict of counts.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

#: What each stat counts (its metric's help text); a stat not listed gets a generic one.
HELP = {
    "bytes_sent": "KV and metadata bytes this prefill rank wrote to decode ranks",
    "write_ops": "ranged writes this prefill rank issued (one per run of pages, or per token of a head slice)",
    "transfers_done": "requests whose KV this prefill rank finished writing",
    "transfers_failed": "requests whose writes to a decode rank failed",
    "decode_ranks_sent": "decode ranks this prefill rank finished writing a request to",
    "reconnects": "sessions to a decode rank replaced before a write",
    "aborted_by_decode": "requests the decode aborted while this prefill rank held their KV",
    "layouts_refused": "decode or prefill ranks whose KV layout could not be paired (refused once, at registration)",
    "kv_received": "requests whose KV this decode rank received in full",
    "statuses_received": "status notices from prefill ranks",
    "decode_failed": "requests this decode rank failed (prefill unreachable, or no KV by the deadline)",
    "grants_opened": "requests whose pages this decode rank opened to the writers",
    "grants_closed": "requests whose pages this decode rank closed again",
    "probe_failures": "probes of a prefill rank that failed",
    "bad_messages": "control messages refused (malformed, or from an unregistered peer)",
    "dials_shed": "decode registrations refused because too many others waited to be dialed",
    "unbound_prefills": "prefill ranks refused because the decode's keyring does not bind their id (KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL)",
    "unvouched_lookups": "bootstrap answers refused because the prefill rank's own key does not vouch for them (KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL)",
    "bad_notices": "notifications refused (malformed, or for a room the sender does not serve)",
}

_lock = threading.Lock()
_counters: Dict[str, Any] = {}  # one prometheus Counter per stat, per process
_LABELS = ("model_name", "engine_type", "tp_rank")


def _counter(name: str) -> Any:
    with _lock:
        c = _counters.get(name)
        if c is None:
            # imported here: SGLang sets PROMETHEUS_MULTIPROC_DIR before this process started
            from prometheus_client import Counter

            c = Counter(f"kvbridge_{name}", HELP.get(name, f"kvbridge SGLang backend: {name}"), _LABELS)
            _counters[name] = c
        return c


class Stats(defaultdict):
    """``stats``: counts by name (``stats[name] += n`` as before); with ``labels`` each
    increase also goes to the stat's Prometheus counter. A counter that fails is logged
    once and left: metrics never fail a transfer."""

    def __init__(self, labels: Optional[Dict[str, str]] = None):
        super().__init__(int)
        self._labels = labels
        self._broken = False

    def __setitem__(self, key: str, value: int) -> None:
        old = self.get(key, 0)
        super().__setitem__(key, value)
        if self._labels is None or self._broken or value <= old:
            return
        try:
            _counter(key).labels(**self._labels).inc(value - old)
        except Exception:  # noqa: BLE001 - metrics must not fail the request
            self._broken = True
            logger.exception("kvbridge: the Prometheus counter of %r failed; metrics of this rank stop", key)


def stats(role: str) -> Stats:
    """The manager's counters: exported when SGLang runs with ``--enable-metrics``, with
    the labels SGLang's scheduler metrics of this process carry (``tp_rank`` is the global
    TP rank, as there, not the rank within an attention-DP group)."""
    from sglang.srt.runtime_context import get_observability, get_parallel, get_serving

    try:
        if not get_observability().enable_metrics:
            return Stats()
        model, tp_rank = str(get_serving().served_model_name), get_parallel().tp_rank
    except ValueError:  # SGLang's context not published (a manager made outside a scheduler)
        return Stats()
    labels = {"model_name": model, "engine_type": role, "tp_rank": str(tp_rank)}
    return Stats(labels)
