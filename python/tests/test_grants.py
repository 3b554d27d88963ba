"""Grant windows from Python: a region whose reads (or writes) are confined to windows,
windows opened for a peer or for a grant token, transfers that name the token, and peers
that try what their token does not open (they hold the same secret and misbehave on
purpose)."""

import threading

import numpy as np
import pytest

import kvbridge
from conftest import PAGE, channel

SECRET = b"grant-windows-test-secret-0123456789"
PAGES = 8


def denied(e):
    return isinstance(e, kvbridge.Rejected) and e.code == "AccessDenied"


class Owner:
    """A prefiller over TCP: its KV (a pattern) is read-only, reads confined to windows."""

    def __init__(self, **kw):
        self.ch = channel("prefill-0", "127.0.0.1:0", transport="tcp", secret=SECRET, **kw)
        self.kv = (np.arange(PAGES * PAGE, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
        self.region = self.ch.register_buffer(self.kv, PAGE, access="read", windows="read")

    def page(self, i):
        return self.kv[i * PAGE : (i + 1) * PAGE]


class Reader:
    """A decoder holding the secret, with a zeroed landing buffer."""

    def __init__(self, name, owner):
        self.ch = channel(name, transport="tcp", secret=SECRET)
        self.buf = np.zeros(PAGES * PAGE, dtype=np.uint8)
        self.region = self.ch.register_buffer(self.buf, PAGE)
        self.owner = owner
        self.peer = self.ch.connect(owner.ch.local_addr)

    def page(self, i):
        return self.buf[i * PAGE : (i + 1) * PAGE]

    def read(self, local, remote, token=None):
        self.ch.read_pages(self.peer, self.region, local, self.owner.region, remote, token=token)

    def refused(self, local, remote, token=None):
        """Reads, expecting AccessDenied; the session goes on (a refused read ends none)."""
        ended = self.ch.stats()["sessions_ended"], self.owner.ch.stats()["sessions_ended"]
        with pytest.raises(kvbridge.Rejected) as e:
            self.read(local, remote, token)
        assert denied(e.value), e.value
        assert e.value.peer == "prefill-0"
        threading.Event().wait(0.05)  # a session the refusal ended would be down by now
        assert self.ch.stats()["established"] == 1, "the refused read ended the session"
        assert (self.ch.stats()["sessions_ended"], self.owner.ch.stats()["sessions_ended"]) == ended


@pytest.fixture
def owner():
    o = Owner()
    yield o
    o.ch.close()


@pytest.fixture
def readers(owner):
    rs = [Reader(n, owner) for n in ("decode-1", "decode-0")]
    yield rs
    for r in rs:
        r.ch.close()


def test_a_token_opens_exactly_its_window(owner, readers):
    a, _ = readers
    tok = kvbridge.new_grant_token()
    assert isinstance(tok, bytes) and len(tok) == 16
    owner.ch.open_window(owner.region, 2 * PAGE, 3 * PAGE, token=tok, access="read")
    a.read([0, 1, 2], [2, 3, 4], token=tok)
    for i in range(3):
        assert np.array_equal(a.page(i), owner.page(2 + i)), f"page {i}"
    assert owner.ch.token_users(tok) == ["decode-1"]

    # without the token, with another one, outside the window: refused, nothing read
    a.refused([5], [2])
    a.refused([5], [2], token=kvbridge.new_grant_token())
    a.refused([5, 6], [4, 5], token=tok)
    assert not a.page(5).any() and not a.page(6).any(), "a refused read landed"
    assert owner.ch.stats()["access_denied"] == 3
    assert owner.ch.token_users(tok) == ["decode-1"]


def test_every_peer_that_read_under_the_token_is_a_user(owner, readers):
    tok = kvbridge.new_grant_token()
    owner.ch.open_window(owner.region, 0, 2 * PAGE, token=tok, access="read")
    for i, r in enumerate(readers):
        r.read([0], [i], token=tok)
        assert np.array_equal(r.page(0), owner.page(i))
    assert owner.ch.token_users(tok) == ["decode-0", "decode-1"]
    assert owner.ch.close_token(tok, timeout=5) == ["decode-0", "decode-1"]
    assert owner.ch.token_users(tok) == []
    # closed: refused now, and closing again finds nothing
    readers[0].refused([1], [0], token=tok)
    assert owner.ch.close_token(tok) == []


def test_after_close_window_the_token_opens_nothing(owner, readers):
    a, _ = readers
    tok = kvbridge.new_grant_token()
    w = owner.ch.open_window(owner.region, 0, PAGE, token=tok, access="read")
    assert isinstance(w, int)
    a.read([0], [0], token=tok)
    owner.ch.close_window(w, timeout=5)
    a.refused([1], [0], token=tok)
    assert not a.page(1).any()
    with pytest.raises(kvbridge.InvalidOp):
        owner.ch.close_window(w)


class StalledPeer:
    """A peer written by hand (no secret; the owner has none here): it asks for a read under
    a token and does not take the answer, so the owner's response stays in flight."""

    def __init__(self, addr, name="stalled"):
        import socket

        host, port = addr.rsplit(":", 1)
        self.name = name
        self.ctl = socket.create_connection((host, int(port)), timeout=5)
        self.send(self.ctl, {"Hello": {"version": 1, "peer_id": name, "incarnation": 1,
                                       "compat": {"hash": 0, "description": ""}, "auth": None}})
        welcome = self.recv(self.ctl)["Welcome"]
        self.send(self.ctl, {"MemInfo": {"regions": []}})
        self.data = socket.socket()
        # a small receive buffer: the response stops in the owner's send buffer
        self.data.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.data.settimeout(5)
        self.data.connect((host, int(port)))
        self.send(self.data, {"DataHello": {"token": welcome["token"], "peer_id": name, "stream": 0}})
        assert "MemInfo" in self.recv(self.ctl)
        assert "Ready" in self.recv(self.ctl)

    @staticmethod
    def send(sock, msg):
        import struct

        import msgspec

        body = msgspec.msgpack.encode(msg)
        sock.sendall(b"KB\x01\x00" + struct.pack("<I", len(body)) + body)

    @staticmethod
    def exact(sock, n):
        out = bytearray()
        while len(out) < n:
            got = sock.recv(min(n - len(out), 1 << 20))
            assert got, "closed"
            out += got
        return bytes(out)

    def recv(self, sock):
        import struct

        import msgspec

        n = struct.unpack("<I", self.exact(sock, 8)[4:])[0]
        return msgspec.msgpack.decode(self.exact(sock, n))

    def ask(self, region, length, token):
        op = {"region": region.to_bytes(16, "big"), "offset": 0, "len": length}
        self.send(self.data, {"ReadBatch": {"id": 1, "ops": [op], "grant": token}})

    def take(self, length):
        resp = self.recv(self.data)["ReadResp"]
        assert resp["error"] is None, resp
        return self.exact(self.data, length)

    def close(self):
        self.data.close()
        self.ctl.close()


def test_close_window_waits_for_an_admitted_read_and_times_out_typed():
    owner = channel("prefill-0", "127.0.0.1:0", transport="tcp")
    big = 32 << 20
    kv = np.full(big, 5, dtype=np.uint8)
    rid = owner.register_buffer(kv, PAGE, access="read", windows="read")
    tok = kvbridge.new_grant_token()
    w = owner.open_window(rid, 0, big, token=tok, access="read")
    peer = StalledPeer(owner.local_addr)
    try:
        peer.ask(rid, big, tok)
        for _ in range(500):  # admitted: its peer is recorded before any byte moves
            if owner.token_users(tok):
                break
            threading.Event().wait(0.01)
        assert owner.token_users(tok) == ["stalled"]
        with pytest.raises(kvbridge.Timeout) as e:
            owner.close_window(w, timeout=0.3)
        assert e.value.step == "close-window", e.value
        # closed already: a new read under the token is refused
        assert owner.token_users(tok) == [], "the close forgot the token's last window"
        # the peer takes the answer: the read admitted before the close completes, and
        # the close, called again, sees it drained
        got = peer.take(big)
        assert got == bytes(kv), "the admitted read was cut short"
        owner.close_window(w, timeout=5)
        with pytest.raises(kvbridge.InvalidOp):
            owner.close_window(w)
    finally:
        peer.close()
        owner.close()


def test_writes_under_a_token_land_only_inside_its_window():
    rx = channel("receiver", "127.0.0.1:0", transport="tcp", secret=SECRET)
    tx = channel("sender", transport="tcp", secret=SECRET)
    try:
        arena = np.zeros(PAGES * PAGE, dtype=np.uint8)
        rid = rx.register_buffer(arena, PAGE, access="write", windows="write")
        tok = kvbridge.new_grant_token()
        rx.open_window(rid, PAGE, 2 * PAGE, token=tok, access="write")
        src = np.full(2 * PAGE, 9, dtype=np.uint8)
        sid = tx.register_buffer(src, PAGE)
        to = tx.connect(rx.local_addr)
        tx.write(to, [(sid, 0, rid, PAGE, 2 * PAGE)], token=tok)
        assert (arena[PAGE : 3 * PAGE] == 9).all()
        with pytest.raises(kvbridge.Rejected) as e:
            tx.write(to, [(sid, 0, rid, 3 * PAGE, PAGE)], token=tok)
        assert denied(e.value), e.value
        assert not arena[3 * PAGE :].any(), "a refused write landed"
        assert rx.token_users(tok) == ["sender"]
    finally:
        tx.close()
        rx.close()


def test_every_transfer_form_names_the_token(owner, readers):
    import asyncio

    a, _ = readers
    tok = kvbridge.new_grant_token()
    owner.ch.open_window(owner.region, 0, 4 * PAGE, token=tok, access="read")
    ch, p, reg, rem = a.ch, a.peer, a.region, owner.region
    ch.read(p, [(reg, 0, rem, 0, PAGE)], token=tok)
    ch.submit_read(p, [(reg, PAGE, rem, PAGE, PAGE)], token=tok).wait(5)
    ch.submit_read_pages(p, reg, [2], rem, [2], token=tok).wait(5)

    async def both():
        await ch.read_pages_async(p, reg, [3], rem, [3], token=tok)
        await ch.read_async(p, [(reg, 4 * PAGE, rem, 0, PAGE)], token=tok)

    asyncio.run(both())
    for i in range(4):
        assert np.array_equal(a.page(i), owner.page(i)), f"page {i}"
    assert np.array_equal(a.page(4), owner.page(0))


def test_tokens_and_windows_are_checked():
    ch = channel("owner", "127.0.0.1:0", transport="tcp")
    try:
        buf = np.zeros(4 * PAGE, dtype=np.uint8)
        rid = ch.register_buffer(buf, PAGE, windows="read")
        plain = ch.register_buffer(np.zeros(PAGE, dtype=np.uint8), PAGE)
        tok = kvbridge.new_grant_token()
        for bad in (int.from_bytes(tok, "big"), tok.hex(), bytearray(tok), None):
            with pytest.raises(TypeError):
                ch.token_users(bad)
        for bad in (tok[:15], tok + b"\0", bytes(16)):
            with pytest.raises(ValueError):
                ch.open_window(rid, 0, PAGE, token=bad, access="read")
        with pytest.raises(TypeError):
            ch.open_window(rid, 0, PAGE, token=7, access="read")
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, 0, PAGE, access="read")  # no holder
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, 0, PAGE, peer="x", token=tok, access="read")  # two
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, 0, PAGE, token=tok, access="everything")
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, 0, PAGE, token=tok, access="write")  # writes not confined
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(plain, 0, PAGE, token=tok, access="read")  # nothing confined
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, 3 * PAGE, 2 * PAGE, token=tok, access="read")  # past the end
        ch.open_window(rid, 0, 2 * PAGE, token=tok, access="read")
        with pytest.raises(kvbridge.InvalidOp):
            ch.open_window(rid, PAGE, PAGE, token=tok, access="read")  # overlaps
        with pytest.raises(kvbridge.InvalidOp):
            ch.register_buffer(bytearray(PAGE), PAGE, windows="sometimes")
        with pytest.raises(kvbridge.InvalidOp):
            ch.close_window(12345)
        with pytest.raises(TypeError):
            ch.read("peer", [], token="not bytes")
    finally:
        ch.close()


def test_a_token_to_a_peer_that_is_not_connected_fails_before_anything():
    ch = channel("lonely", transport="tcp")
    try:
        r = ch.register_buffer(np.zeros(PAGE, dtype=np.uint8), PAGE)
        with pytest.raises(kvbridge.UnknownPeer):
            ch.read("nobody", [(r, 0, 1, 0, PAGE)], token=kvbridge.new_grant_token())
    finally:
        ch.close()


def test_a_batch_of_windows_opens_all_or_none():
    rx = channel("receiver", "127.0.0.1:0", transport="tcp", secret=SECRET)
    try:
        arena = np.zeros(PAGES * PAGE, dtype=np.uint8)
        rid = rx.register_buffer(arena, PAGE, access="write", windows="write")
        src = np.full(PAGE, 4, dtype=np.uint8)

        def lands(page):
            # a fresh session each time: a refused write ends the one it was on
            tx = channel("sender", transport="tcp", secret=SECRET)
            try:
                to = tx.connect(rx.local_addr)
                tx.write_pages(to, tx.register_buffer(src, PAGE), [0], rid, [page])
            except kvbridge.Rejected as e:
                assert denied(e), e
                return False
            finally:
                tx.close()
            return True

        for bad, lengths in [
            ([PAGE, 3 * PAGE, PAGES * PAGE], PAGE),  # the last is past the arena
            ([PAGE, 3 * PAGE, PAGE + 8], PAGE),  # the last overlaps the first
            ([PAGE, 3 * PAGE], [PAGE]),  # one length for two offsets
            ([PAGE, 3 * PAGE], [PAGE, 0]),  # an empty window
        ]:
            with pytest.raises(kvbridge.InvalidOp):
                rx.open_windows(rid, bad, lengths, peer="sender", access="write")
            assert not lands(1), f"{bad}: a window of a refused batch opened"
        with pytest.raises(TypeError):
            rx.open_windows(rid, [PAGE], "4096", peer="sender", access="write")
        with pytest.raises(kvbridge.InvalidOp):
            rx.open_windows(rid, [PAGE], PAGE, access="write")  # no holder
        assert rx.open_windows(rid, [], PAGE, peer="sender", access="write") == []
        ids = rx.open_windows(rid, [5 * PAGE, PAGE, 2 * PAGE], [PAGE, PAGE, 2 * PAGE], peer="sender", access="write")
        assert len(set(ids)) == 3
        assert [lands(p) for p in range(PAGES)] == [False, True, True, True, False, True, False, False]
        assert rx.close_windows([ids[0], ids[2]], timeout=5) == []
        assert [lands(p) for p in range(PAGES)] == [False, True, False, False, False, False, False, False]
    finally:
        rx.close()


def test_close_windows_returns_the_ones_whose_ops_still_run():
    owner = channel("prefill-0", "127.0.0.1:0", transport="tcp")
    big = 32 << 20
    kv = np.full(2 * big, 6, dtype=np.uint8)
    rid = owner.register_buffer(kv, PAGE, access="read", windows="read")
    tok = kvbridge.new_grant_token()
    w0, w1 = owner.open_windows(rid, [0, big], big, token=tok, access="read")
    peer = StalledPeer(owner.local_addr)
    try:
        peer.ask(rid, big, tok)  # through w0
        for _ in range(500):
            if owner.token_users(tok):
                break
            threading.Event().wait(0.01)
        assert owner.token_users(tok) == ["stalled"]
        assert owner.close_windows([w0, w1], timeout=0) == [w0]
        assert owner.close_windows([w0, w1], timeout=0.3) == [w0]
        assert owner.token_users(tok) == [], "closed already: the token's windows are gone"
        assert peer.take(big) == bytes(kv[:big]), "the admitted read was cut short"
        assert owner.close_windows([w0], timeout=5) == []
        # drained and forgotten: counts as drained for a closer that comes late, and
        # close_window (one id) says it is not open
        assert owner.close_windows([w0, w1, 12345]) == []
        with pytest.raises(kvbridge.InvalidOp):
            owner.close_window(w0)
    finally:
        peer.close()
        owner.close()
