"""A channel's own key (``peer_key=``, ``KVBRIDGE_PEER_KEY``) through the binding: it proves
the channel's id to a listener whose keyring (``KVBRIDGE_PEER_KEYS``) binds that id, the
shared secret to any other, and its own listener still takes the shared secret. Bad keys
fail the channel at creation, naming the setting."""

import time

import pytest

import kvbridge

SHARED = "the-shared-secret-0123"
KEY = "key-of-prefill-0-0123"


@pytest.fixture
def binding_decode(tmp_path, monkeypatch):
    """A listener whose keyring binds "prefill-0" to KEY (read from KVBRIDGE_PEER_KEYS at
    creation), beside the shared secret."""
    ring = tmp_path / "peer-keys"
    ring.write_text(f"prefill-0 {KEY}\n")
    monkeypatch.setenv("KVBRIDGE_PEER_KEYS", str(ring))
    ch = kvbridge.Channel("decode-0", "127.0.0.1:0", secret=SHARED, use_env=False)
    monkeypatch.delenv("KVBRIDGE_PEER_KEYS")
    yield ch
    ch.close()


def test_the_own_key_proves_a_bound_id_and_the_listener_takes_the_shared_secret(binding_decode):
    pre = kvbridge.Channel("prefill-0", "127.0.0.1:0", secret=SHARED, peer_key=KEY, use_env=False)
    probe = kvbridge.Channel("decode-0/probe", secret=SHARED, use_env=False)
    plain = kvbridge.Channel("decode-1", "127.0.0.1:0", secret=SHARED, use_env=False)
    try:
        assert pre.connect(binding_decode.local_addr) == "decode-0"
        assert pre.connect(plain.local_addr) == "decode-1"  # binds nothing: the shared secret
        assert probe.connect(pre.local_addr) == "prefill-0"
    finally:
        for ch in (pre, probe, plain):
            ch.close()


@pytest.mark.parametrize("own", [None, "not-the-key-of-prefill-0"])
def test_a_holder_of_the_shared_secret_cannot_claim_the_bound_id(binding_decode, own):
    before = binding_decode.stats()["auth_failed"]
    imp = kvbridge.Channel("prefill-0", secret=SHARED, peer_key=own, use_env=False)
    try:
        with pytest.raises(kvbridge.Unauthenticated):
            imp.connect(binding_decode.local_addr)
    finally:
        imp.close()
    # counted once the listener has ended that session (a moment after the dialer's error)
    deadline = time.monotonic() + 10
    while binding_decode.stats()["auth_failed"] == before and time.monotonic() < deadline:
        time.sleep(0.01)
    now = binding_decode.stats()
    assert now["auth_failed"] == before + 1 and now["established"] == 0, now


@pytest.mark.parametrize(
    "listen,secret,key,error,says",
    [
        ("127.0.0.1:0", SHARED, "short-key", kvbridge.LocalError, "9 bytes"),
        (None, SHARED, SHARED, kvbridge.LocalError, "is the shared secret"),
        ("127.0.0.1:0", None, KEY, kvbridge.LocalError, "unauthenticated"),
        (None, SHARED, "", kvbridge.InvalidOp, "peer_key is empty"),
    ],
)
def test_a_bad_own_key_fails_the_channel_naming_the_setting(listen, secret, key, error, says):
    with pytest.raises(error) as e:
        kvbridge.Channel("prefill-0", listen, secret=secret, peer_key=key, use_env=False)
    assert says in str(e.value) and ("peer_key" in str(e.value)), e.value


def test_the_environment_gives_the_own_key_and_use_env_false_drops_it(binding_decode, monkeypatch):
    monkeypatch.setenv("KVBRIDGE_PEER_KEY", KEY)
    monkeypatch.setenv("KVBRIDGE_SECRET", SHARED)
    pre = kvbridge.Channel("prefill-0")
    try:
        assert pre.connect(binding_decode.local_addr) == "decode-0"
    finally:
        pre.close()
    bare = kvbridge.Channel("prefill-0", secret=SHARED, use_env=False)
    try:
        with pytest.raises(kvbridge.Unauthenticated):
            bare.connect(binding_decode.local_addr)
    finally:
        bare.close()
