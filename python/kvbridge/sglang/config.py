"""The backend's settings, read once per process from the environment (SGLang's command
line has no place for a backend's own options; its own backends use ``SGLANG_*`` variables
the same way).

* ``KVBRIDGE_SECRET``: the shared secret every prefill and decode rank holds. kvbridge
  channels refuse a peer that cannot prove it (``Unauthenticated``), and the bootstrap
  server refuses a rank registration not signed with it. Unset: no authentication (the
  channels warn); set it in any deployment whose network others can reach.
* ``KVBRIDGE_PEER_KEY``: a prefill rank's own key, which a decode's keyring
  (``KVBRIDGE_PEER_KEYS``) lists for the rank's id (``KVBRIDGE_PEER_ID``): the rank proves it
  when it dials a decode that binds its id (the shared secret to any other), and signs its
  bootstrap registration with it, which the bootstrap server (same environment) checks.
  Its listener still takes the shared secret, so the decode's probe gets in. Unset: the
  shared secret does all of it.
* ``KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL`` (a decode's; ``1`` to turn on, default off): the
  decode takes KV only from prefill ranks its keyring (``KVBRIDGE_PEER_KEYS``, required then)
  binds, and only where the rank's own key vouches for it: every rank the bootstrap server
  names must have its id in the keyring, and the registration the server forwards must be
  signed with the key bound to that id and name the address, port, id and rank the lookup
  answered (``trust.py``). Anything else fails the request before the decode registers with
  the rank or opens a page (``kvbridge.Unauthenticated``, step ``keyring`` or ``bootstrap``,
  counted), and the request's pages open only to the bound ids it expects, not to a token.
  Unset: the prefill id the bootstrap server names is taken as it comes.
* ``KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S`` (default 60): seconds a decode request waits, from
  sending its page indices, for its KV; past it the request fails (SGLang's own wait is
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 300 s; the shorter one applies).
* ``KVBRIDGE_SGLANG_PROBE_S`` (default 1): how often a decode checks that the prefill ranks
  it waits on are alive over their kvbridge sessions; a dead one fails its requests at the
  next probe.
* ``KVBRIDGE_SGLANG_LEASE_S`` (default 60): seconds a prefill keeps a request's KV for a
  decode that has not sent its page indices; then the request fails and its KV is freed
  (SGLang's ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, 300 s, still applies if shorter).
* ``KVBRIDGE_TRANSPORT`` and the channel's other ``KVBRIDGE_*`` variables as everywhere.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


#: The decode's setting that takes KV only from prefill ids its keyring binds.
REQUIRE_BOUND_ENV = "KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL"


class ConfigError(ValueError):
    """A ``KVBRIDGE_*`` setting that cannot be used, naming the variable."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "")
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{name} must be 1 or 0, got {raw!r}")


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (value > 0) or math.isinf(value) or math.isnan(value):
        raise ConfigError(f"{name} must be positive and finite, got {raw!r}")
    return value


@dataclass(frozen=True)
class Settings:
    secret: str | None
    peer_key: str | None
    transfer_timeout_s: float
    probe_s: float
    lease_s: float
    require_bound_prefill: bool

    @property
    def registration_key(self) -> tuple[str, str | None]:
        """What signs (and checks) a prefill's bootstrap registration, and its variable: the
        prefill's own key when it has one, else the shared secret."""
        if self.peer_key:
            return "KVBRIDGE_PEER_KEY", self.peer_key
        return "KVBRIDGE_SECRET", self.secret


def settings() -> Settings:
    return Settings(
        secret=os.environ.get("KVBRIDGE_SECRET") or None,
        peer_key=os.environ.get("KVBRIDGE_PEER_KEY") or None,
        transfer_timeout_s=_seconds("KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S", 60.0),
        probe_s=_seconds("KVBRIDGE_SGLANG_PROBE_S", 1.0),
        lease_s=_seconds("KVBRIDGE_SGLANG_LEASE_S", 60.0),
        require_bound_prefill=_flag(REQUIRE_BOUND_ENV),
    )
