"""Two kvbridge channels on 127.0.0.1 in this process, with short deadlines."""

import numpy as np
import pytest

import kvbridge

PAGE = 64 << 10
# Short enough that a test of a failing peer ends in seconds, long enough for a loaded host.
DEADLINES = {"connect": 2.0, "handshake_step": 2.0, "op": 5.0, "close": 2.0}


def channel(peer_id, listen=None, **kw):
    kw.setdefault("deadlines", DEADLINES)
    kw.setdefault("use_env", False)
    return kvbridge.Channel(peer_id, listen, **kw)


class Pair:
    """A listener ("decode") with a 32-page KV buffer and an initiator ("prefill") with an
    8-page staging buffer, connected."""

    def __init__(self):
        self.decoder = channel("decode-0", "127.0.0.1:0")
        self.kv = np.zeros(32 * PAGE, dtype=np.uint8)
        self.kv_region = self.decoder.register_buffer(self.kv, PAGE)
        self.prefiller = channel("prefill-0")
        rng = np.random.default_rng(7)
        self.staging = rng.integers(0, 256, 8 * PAGE, dtype=np.uint8)
        self.staging_region = self.prefiller.register_buffer(self.staging, PAGE)
        self.peer = self.prefiller.connect(self.decoder.local_addr)

    def kv_page(self, i):
        return self.kv[i * PAGE : (i + 1) * PAGE]

    def staging_page(self, i):
        return self.staging[i * PAGE : (i + 1) * PAGE]

    def close(self):
        self.prefiller.close()
        self.decoder.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()
