"""install() adds the backend to an unmodified SGLang, and leaves the others alone."""

import subprocess
import sys

import pytest
from sglang.srt.arg_groups import choices
from sglang.srt.disaggregation import utils
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

import kvbridge.sglang
from kvbridge.sglang.bootstrap import KvbridgeKVBootstrapServer
from kvbridge.sglang.manager import KvbridgeKVManager
from kvbridge.sglang.receiver import KvbridgeKVReceiver
from kvbridge.sglang.sender import KvbridgeKVSender


def test_install_adds_the_backend_everywhere_sglang_looks_and_is_idempotent():
    kvbridge.sglang.install()
    kvbridge.sglang.install()
    assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("kvbridge") == 1
    b = TransferBackend("kvbridge")
    assert b is TransferBackend.KVBRIDGE and list(TransferBackend).count(b) == 1
    assert set(kvbridge.sglang.installed()) == {
        "sglang.srt.disaggregation.utils",
        "sglang.srt.disaggregation.prefill",
        "sglang.srt.disaggregation.decode",
        "sglang.srt.managers.disagg_service",
    }
    assert utils.get_kv_class(b, KVClassType.MANAGER) is KvbridgeKVManager
    assert utils.get_kv_class(b, KVClassType.SENDER) is KvbridgeKVSender
    assert utils.get_kv_class(b, KVClassType.RECEIVER) is KvbridgeKVReceiver
    assert utils.get_kv_class(b, KVClassType.BOOTSTRAP_SERVER) is KvbridgeKVBootstrapServer
    # the other backends are SGLang's own
    from sglang.srt.disaggregation.fake import FakeKVManager

    assert utils.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER) is FakeKVManager


def test_sglangs_command_line_takes_the_backend():
    kvbridge.sglang.install()
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(
        ["--model-path", "m", "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "kvbridge"]
    )
    assert args.disaggregation_transfer_backend == "kvbridge"


def test_sglang_loads_the_backend_as_a_plugin_in_a_fresh_process():
    # what SGLang's scheduler and detokenizer do first (load_plugins); needs kvbridge
    # installed as a distribution (its entry point), as scripts/test-sglang.sh does
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.disaggregation.utils import TransferBackend;"
        "print(TransferBackend('kvbridge'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TransferBackend.KVBRIDGE" in out.stdout


def test_the_launcher_installs_at_import_for_spawned_children():
    code = (
        "import runpy; runpy.run_module('kvbridge.sglang.launch_server', run_name='__mp_main__');"
        "from sglang.srt.disaggregation.utils import TransferBackend; print(TransferBackend('kvbridge'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "SGLANG_PLUGINS": "none"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TransferBackend.KVBRIDGE" in out.stdout


def _policy_check(backend: str, **fields):
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path="m", disaggregation_mode="prefill", disaggregation_transfer_backend=backend,
        disaggregation_decode_allocation_policy="prefill_complete", **fields,
    )  # fmt: skip
    # what SGLang's resolution step calls, looked up where it looks it up
    return hook.handle_pd_disaggregation.__globals__["_validate_prefill_complete"](args)


def test_sglang_takes_prefill_complete_with_the_backend_and_keeps_its_other_refusals():
    kvbridge.sglang.install()
    kvbridge.sglang.install()
    _policy_check("kvbridge")
    _policy_check("mooncake")  # SGLang's own answer, unchanged
    with pytest.raises(ValueError, match="transfer backends other than Mooncake"):
        _policy_check("nixl")
    with pytest.raises(ValueError) as refused:
        _policy_check("kvbridge", tp_size=2)
    assert "attention tensor parallelism greater than one" in str(refused.value)
    assert "Mooncake" not in str(refused.value)
