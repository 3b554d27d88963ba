"""The peer id an integration's channel goes by (``kvbridge.identity``): the operator's
template, checked so that a keyring line can name it, or a random one, which is said once
when the deployment uses keyrings."""

import logging

import pytest

from kvbridge import identity


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(identity.PEER_ID_ENV, raising=False)
    monkeypatch.delenv(identity.PEER_KEYS_ENV, raising=False)
    monkeypatch.delenv(identity.PEER_KEY_ENV, raising=False)
    monkeypatch.setattr(identity, "_random_logged", False)


def test_the_template_names_role_and_rank(monkeypatch):
    monkeypatch.setenv(identity.PEER_ID_ENV, "prefill-a-{role}-tp{tp_rank}")
    assert identity.peer_id("random-1", role="sender", rank=3) == "prefill-a-sender-tp3"
    monkeypatch.setenv(identity.PEER_ID_ENV, "dec-{rank:02d}")
    assert identity.peer_id("random-1", role="decode", rank=7) == "dec-07"
    # an explicit template wins over the environment
    assert identity.peer_id("random-1", role="x", rank=1, template="p{tp_rank}") == "p1"
    monkeypatch.setenv(identity.PEER_ID_ENV, "")
    assert identity.peer_id("random-1", role="x", rank=1) == "random-1"


@pytest.mark.parametrize(
    "template,says",
    [
        ("prefill-a", "names no rank"),
        ("prefill-{role}", "names no rank"),
        ("p-{host}-{tp_rank}", "unknown placeholder"),
        ("p-{}-{tp_rank}", "unknown placeholder"),
        ("p-{role.upper}-{tp_rank}", "unknown placeholder"),
        ("p-{tp_rank", "expected '}'"),
        ("p {tp_rank}", "cannot be named in a keyring"),
        ("#p{tp_rank}", "cannot be named in a keyring"),
        ("p{tp_rank}" + "x" * 256, "1 to 256"),
        ("p{tp_rank:q}", "ValueError"),
    ],
)
def test_a_template_that_cannot_be_an_id_of_a_keyring_fails_naming_the_variable(monkeypatch, template, says):
    monkeypatch.setenv(identity.PEER_ID_ENV, template)
    with pytest.raises(ValueError) as e:
        identity.peer_id("random-1", role="sender", rank=0)
    assert identity.PEER_ID_ENV in str(e.value) and says in str(e.value), e.value


def test_a_random_id_under_a_keyring_is_said_once(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="kvbridge.identity")
    identity.peer_id("random-1", role="sender", rank=0)
    assert not caplog.records, "no keyring: nothing to say"
    monkeypatch.setenv(identity.PEER_KEYS_ENV, "/etc/kvbridge/keys")
    identity.peer_id("random-1", role="sender", rank=0)
    identity.peer_id("random-2", role="sender", rank=1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "random-1" in said[0] and identity.PEER_ID_ENV in said[0], said
    monkeypatch.setattr(identity, "_random_logged", False)
    monkeypatch.setenv(identity.PEER_ID_ENV, "p{tp_rank}")
    identity.peer_id("random-3", role="sender", rank=0)
    assert len(caplog.records) == 1, "a stable id is not random"


def test_an_own_key_with_a_random_id_fails_naming_both_variables(monkeypatch):
    """A key no keyring could list under a random id binds nothing: refused, not ignored."""
    monkeypatch.setenv(identity.PEER_KEY_ENV, "key-of-prefill-a-0123")
    with pytest.raises(ValueError) as e:
        identity.peer_id("random-1", role="prefill", rank=0)
    assert identity.PEER_KEY_ENV in str(e.value) and identity.PEER_ID_ENV in str(e.value), e.value
    assert "random-1" in str(e.value) and "key-of" not in str(e.value), e.value
    monkeypatch.setenv(identity.PEER_ID_ENV, "prefill-a-{role}-r{rank}")
    assert identity.peer_id("random-1", role="prefill", rank=0) == "prefill-a-prefill-r0"
