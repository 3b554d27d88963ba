"""LMCache's own transfer-channel tests, unmodified, from its PyPI sdist, against kvbridge.

``test_nixl_impl.py`` runs against ``KvbridgeTransferChannelContext`` (``sdist_conftest.py``
substitutes the class while pytest imports that module); ``test_factory.py``,
``test_context_lifecycle.py`` and ``test_api.py`` run with ``"kvbridge"`` registered. Every
test of theirs must pass: a skip, an error or a missing test fails here.
"""

from __future__ import annotations

import os

import pytest

import contract_sdist

# test_nixl_impl.py of lmcache 0.5.6: each must run against kvbridge and pass
NIXL_CONTRACT = (
    "test_get_address_returns_matching_offsets_and_sizes",
    "test_get_address_out_of_region_raises_value_error",
    "test_read_copies_remote_data_into_local_buffer",
    "test_read_into_offset_region",
    "test_submit_read_mismatched_lengths_raises_value_error",
    "test_query_unknown_task_id_raises_key_error",
    "test_get_client_is_idempotent",
    "test_register_client_keeps_first_and_closes_duplicate",
    "test_remove_client_closes_and_drops_it",
    "test_remove_unknown_client_is_noop",
    "test_remove_client_after_connect",
    "test_connecting_registers_clients_on_both_sides",
    "test_server_is_available_from_context",
)


@pytest.fixture(scope="module")
def outcome(request):
    request.getfixturevalue("interop")
    try:
        contract_sdist.sdist()
    except OSError as err:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"cannot fetch lmcache-{contract_sdist.VERSION}.tar.gz: {err}")
    files = (contract_sdist.SUBSTITUTED, *contract_sdist.WITH_KVBRIDGE_REGISTERED)
    return contract_sdist.run(files)


def _tail(out: contract_sdist.Outcome) -> str:
    return "\n".join(out.output.splitlines()[-60:])


def test_lmcache_run_passes(outcome):
    assert outcome.returncode == 0, _tail(outcome)
    assert not outcome.not_passed, outcome.not_passed


@pytest.mark.parametrize("name", NIXL_CONTRACT)
def test_nixl_contract_passes_against_kvbridge(outcome, name):
    assert name in outcome.passed.get(contract_sdist.SUBSTITUTED, []), _tail(outcome)


def test_every_nixl_contract_test_is_known(outcome):
    # a test LMCache adds in a later sdist must be looked at, not silently counted
    assert sorted(outcome.passed.get(contract_sdist.SUBSTITUTED, [])) == sorted(NIXL_CONTRACT)


@pytest.mark.parametrize("path", contract_sdist.WITH_KVBRIDGE_REGISTERED)
def test_registry_tests_pass_with_kvbridge_registered(outcome, path):
    assert outcome.passed.get(path), _tail(outcome)
