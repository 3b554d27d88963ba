"""SGLang's ``--disaggregation-decode-allocation-policy prefill_complete`` on its real classes
(policy_process.py: the cases in one process of its own, since the policy lives in the
per-process runtime context): the decode allocates after the prefill computed, and the
kvbridge backend follows that order without a deadline or lease firing while the prefill
computes, frees the room on both sides when it ends, and still learns of a dead prefill
from its probe."""

import pytest

from case_runs import result, run_cases

CASES = ["order", "lease", "dead"]


@pytest.fixture(scope="module")
def results():
    return run_cases("policy_process.py", CASES, timeout=300)


def test_the_decode_allocates_after_the_prefill_computed_and_the_kv_lands(results):
    # the prefill computed past the transfer deadline and the lease before it was ready
    assert result(results, "order")["computed_s"] > 2.0


def test_a_computed_request_whose_decode_never_allocates_is_freed_at_the_lease(results):
    got = result(results, "lease")
    assert "timed out" in got["sender"], got


def test_a_prefill_that_dies_while_it_computes_fails_the_decode_at_the_probe(results):
    assert result(results, "dead")["failed_after_s"] < 3.0
