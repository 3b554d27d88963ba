"""Attention TP on the two sides, on SGLang's real classes (tp_process.py: every case below
in one process of its own, one after another, so SGLang is imported once; the runtime
context is per process)."""

import pytest

from case_runs import result, run_cases

CASES = [
    "2,2,mha,4",  # decode rank r receives prefill rank r's heads, whole pages
    "1,2,mla,1",  # MLA: both decode ranks receive prefill rank 0's
    "1,2,mha,4",  # each decode rank: half of the prefill's heads
    "2,1,mha,4",  # the decode rank: both prefill ranks' heads
    "2,4,mha,4",  # one prefill rank writes two decode ranks
    "4,2,mha,2",  # heads replicated on the prefill: one replica writes each
    "2,1,mha,4,bound",  # bound prefills required: the decode's pages open to both prefill ids
    "1,2,mla,1,bound",  # bound prefills required, MLA: dummies vouched for, write nothing
]
REFUSED = "1,2,mha,4,refuse"  # decode pages of another head size


@pytest.fixture(scope="module")
def results():
    return run_cases("tp_process.py", [*CASES, REFUSED], timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_tp_pairs_that_work(results, case):
    counted = result(results, case)
    if ",mha," in case:
        # checked against the heads in tp_process.py; here: that there were some
        assert counted["write_ops"] > 0 and counted["bytes_sent"] > 0, counted


def test_mha_pages_of_another_head_size_are_refused_once_at_registration(results):
    counted = result(results, REFUSED)
    assert counted["layouts_refused"] == [2], counted
    assert "is not 4 tokens of 2 heads of 16 bytes" in counted["failure"], counted["failure"]
