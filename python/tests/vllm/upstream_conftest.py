"""Root conftest for vLLM's own connector unit tests (copied from the vllm sdist at test
time, never committed): points their ``create_vllm_config`` at ``KvbridgeConnector`` and at a
local model config instead of the Hugging Face hub.

scripts/test-vllm.sh copies this file to the top of the directory that holds the copied tests.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

UPSTREAM_MODEL = "facebook/opt-125m"
MODEL_DIR = Path(__file__).resolve().parent / "opt-125m-config"


def _local_model() -> str:
    """The tests only read the model's config: transformers' OPTConfig defaults are opt-125m's."""
    if not (MODEL_DIR / "config.json").exists():
        from transformers import OPTConfig

        MODEL_DIR.mkdir(parents=True, exist_ok=True)
        OPTConfig(architectures=["OPTForCausalLM"], torch_dtype="float16").to_json_file(MODEL_DIR / "config.json")
    return str(MODEL_DIR)


@pytest.fixture(autouse=True)
def _kvbridge_connector(request, monkeypatch):
    module = request.module
    upstream = getattr(module, "create_vllm_config", None)
    if upstream is None:
        return

    def create_vllm_config(*args, **kwargs):
        kwargs.setdefault("kv_connector", "KvbridgeConnector")
        kwargs.setdefault("kv_connector_module_path", "kvbridge.vllm")
        if request.node.get_closest_marker("kvbridge_hybrid_manager_off"):
            kwargs["disable_hybrid_kv_cache_manager"] = True
        if kwargs.get("model", UPSTREAM_MODEL) == UPSTREAM_MODEL:
            kwargs["model"] = _local_model()
        config = upstream(*args, **kwargs)
        assert config.kv_transfer_config.kv_connector_module_path == "kvbridge.vllm"
        return config

    monkeypatch.setattr(module, "create_vllm_config", create_vllm_config)

    from kvbridge.vllm.scheduler import KvbridgeScheduler

    built = []
    init = KvbridgeScheduler.__init__

    def counting_init(self, *a, **kw):
        built.append(self)
        init(self, *a, **kw)

    monkeypatch.setattr(KvbridgeScheduler, "__init__", counting_init)
    yield
    # the test's scheduler ran kvbridge's connector, not vLLM's default
    call = getattr(request.node, "rep_call", None)
    if call is not None and call.passed:
        assert built, "no KvbridgeConnector scheduler was built"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report


#: vLLM's refusal of a connector without SupportsHMA while the hybrid KV-cache manager is on
#: (vllm/distributed/kv_transfer/kv_connector/factory.py, 0.32.0).
NO_HMA = (
    "Connector KvbridgeConnector does not support HMA but HMA is enabled. "
    "Please set `--disable-hybrid-kv-cache-manager`."
)

#: vLLM tests that cannot pass against this connector: (test id, the exact message of the
#: ValueError each must raise, why). Strict: one that starts passing, or fails with any other
#: error or message, fails the run, so this list cannot go stale.
EXPECTED_FAILURES = {
    "test_p_side_chunked_prefill_mamba": (
        NO_HMA,
        "hybrid KV-cache manager (Mamba group + NixlConnector's N-1 prompt truncation): "
        "KvbridgeConnector does not declare SupportsHMA, so vLLM refuses the config",
    ),
    "test_async_load_reserves_blocks_for_promotion_margin[multiple-groups]": (
        NO_HMA,
        "hybrid KV-cache manager (sliding-window group): KvbridgeConnector does not declare "
        "SupportsHMA, so vLLM refuses the config",
    ),
    "test_async_load_reserves_blocks_for_promotion_margin[different-block-sizes]": (
        NO_HMA,
        "hybrid KV-cache manager (sliding-window group, block sizes 64 and 16): KvbridgeConnector "
        "does not declare SupportsHMA, so vLLM refuses the config",
    ),
    "test_async_load_does_not_double_reserve_mamba_spec_blocks[none-128-18]": (
        NO_HMA,
        "hybrid KV-cache manager (Mamba group): KvbridgeConnector does not declare SupportsHMA, "
        "so vLLM refuses the config",
    ),
    "test_async_load_does_not_double_reserve_mamba_spec_blocks[align-16-18]": (
        NO_HMA,
        "hybrid KV-cache manager (Mamba group): KvbridgeConnector does not declare SupportsHMA, "
        "so vLLM refuses the config",
    ),
}

#: Tests whose config turns the hybrid KV-cache manager on with a single full-attention
#: group, where it has nothing to manage: run with it off, so that what they test (here the
#: promotion margin with 3 speculative tokens) runs against KvbridgeConnector instead of
#: stopping at vLLM's refusal above.
HYBRID_MANAGER_OFF = {"test_async_load_reserves_blocks_for_promotion_margin[single-group]"}


def _expect_message(test, message: str):
    """``test`` as pytest calls it, a ValueError with another message than ``message`` turned
    into an AssertionError (which the xfail's ``raises=ValueError`` does not accept)."""

    @functools.wraps(test)
    def checked(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except ValueError as e:
            if str(e) != message:
                raise AssertionError(f"expected ValueError({message!r}), got ValueError({str(e)!r})") from e
            raise

    return checked


def pytest_collection_modifyitems(config, items):
    for item in items:
        expected = EXPECTED_FAILURES.get(item.name)
        if expected is not None:
            message, reason = expected
            item.obj = _expect_message(item.obj, message)
            item.add_marker(pytest.mark.xfail(reason=f"{reason}: {message}", raises=ValueError, strict=True))
        if item.name in HYBRID_MANAGER_OFF:
            item.add_marker(pytest.mark.kvbridge_hybrid_manager_off)


def pytest_configure(config):
    config.addinivalue_line("markers", "kvbridge_hybrid_manager_off: run with the hybrid KV-cache manager off")
