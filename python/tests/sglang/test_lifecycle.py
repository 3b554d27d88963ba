"""A request's whole life over the kvbridge backend, on SGLang's real Common* classes and
bootstrap server, over real sockets: the decode's pages and metadata slot receive exactly
the prefill's, chunk by chunk, and the grant that let them in is closed afterwards."""

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang_pd import AUX_ITEM, ITEM, LAYERS, until_done, wait_for

import kvbridge


def write_as_prefill(pd, op, token):
    """A write from the prefill rank's channel (a stale session, ended by an earlier refused
    write, is replaced once, as the manager does)."""
    peer = pd.decode.kvbridge_peer_id
    for attempt in (0, 1):
        pd.prefill.channel.connect(pd.decode.kvbridge_addr)
        try:
            return pd.prefill.channel.write(peer, [op], token=token)
        except (kvbridge.ConnectionLost, kvbridge.UnknownPeer):
            if attempt:
                raise


def transfer(pd, src, dst, chunks, aux=(1, 3)):
    room = pd.room()
    sender = pd.sender(room)
    receiver = pd.receiver(room)
    assert receiver.poll() == KVPoll.WaitingForInput
    receiver.send_metadata(np.array(dst, dtype=np.int32), aux_index=aux[1])
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "the decode's indices")
    sender.init(len(src), aux_index=aux[0])
    start = 0
    for n in chunks:
        sender.send(np.array(src[start : start + n], dtype=np.int32))
        start += n
    return room, sender, receiver


def test_chunked_transfer_lands_every_page_and_the_metadata(pd):
    src, dst = [1, 2, 3, 9, 10, 40], [5, 6, 7, 20, 33, 34]
    before = dict(pd.decode.stats)
    room, sender, receiver = transfer(pd, src, dst, chunks=[2, 3, 1])
    assert until_done(sender) == KVPoll.Success
    assert until_done(receiver) == KVPoll.Success
    for buf in range(2 * LAYERS):
        for s, d in zip(src, dst):
            assert pd.dpool.page(buf, d) == pd.ppool.page(buf, s), (buf, s, d)
    for buf in range(2):
        assert pd.dpool.aux_slot(buf, 3) == pd.ppool.aux_slot(buf, 1)
    # the KV came over kvbridge: counted on both sides
    assert pd.decode.stats["kv_received"] == before.get("kv_received", 0) + 1
    assert pd.prefill.stats["bytes_sent"] >= len(src) * ITEM * 2 * LAYERS + 2 * AUX_ITEM
    sender.clear()
    receiver.clear()


def test_the_grant_closes_when_the_request_ends(pd):
    room, sender, receiver = transfer(pd, [4], [11], chunks=[1])
    assert until_done(receiver) == KVPoll.Success
    assert room not in pd.decode._grants
    # the prefill's token no longer opens the page it wrote: its write is refused
    info = pd.prefill.transfer_infos[room][pd.decode.kvbridge_peer_id]
    op = (pd.prefill.kv_regions[0], 0, pd.decode.kv_regions[0], 11 * ITEM, ITEM)
    try:
        write_as_prefill(pd, op, info.token)
        raise AssertionError("a write through a closed grant landed")
    except kvbridge.Rejected as e:
        assert e.code == "AccessDenied"
    sender.clear()
    receiver.clear()


def test_a_grant_opens_only_the_requests_pages(pd):
    room = pd.room()
    receiver = pd.receiver(room)
    receiver.send_metadata(np.array([21, 22], dtype=np.int32), aux_index=5)
    token = pd.decode._grants[room]
    wait_for(lambda: pd.prefill.transfer_infos.get(room), 10, "the decode's indices at the prefill")
    before = pd.dpool.page(0, 23)
    op = (pd.prefill.kv_regions[0], 0, pd.decode.kv_regions[0], 23 * ITEM, ITEM)  # page 23: not granted
    try:
        write_as_prefill(pd, op, token)
        raise AssertionError("a write outside the grant landed")
    except kvbridge.Rejected as e:
        assert e.code == "AccessDenied"
    assert pd.dpool.page(0, 23) == before
    receiver.abort()
    assert receiver.is_abort_release_safe()
    receiver.clear()


def test_rooms_interleave(pd):
    a = transfer(pd, [12, 13], [40, 41], chunks=[1])
    b = transfer(pd, [14], [42], chunks=[1])
    a[1].send(np.array([13], dtype=np.int32))
    for _, sender, receiver in (a, b):
        assert until_done(sender) == KVPoll.Success
        assert until_done(receiver) == KVPoll.Success
        sender.clear()
        receiver.clear()
    assert pd.dpool.page(1, 41) == pd.ppool.page(1, 13)
    assert pd.dpool.page(1, 42) == pd.ppool.page(1, 14)


def test_releasing_the_pools_memory_is_refused_while_peers_can_write_it(pd):
    import pytest

    for mgr in (pd.prefill, pd.decode):
        with pytest.raises(NotImplementedError, match="release_memory_occupation"):
            mgr.deregister_buffer_to_engine()
