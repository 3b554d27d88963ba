"""install(), the run module and the vLLM connector module, against the installed LMCache."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import types
import warnings
from unittest.mock import patch

import pytest


def _users():
    from kvbridge.lmcache.install import FACTORY_USERS

    return [importlib.import_module(m) for m in FACTORY_USERS if _importable(m)]


def _importable(name):
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def test_install_rebinds_the_factory_wherever_it_was_imported_and_is_idempotent():
    import kvbridge.lmcache as kl

    kl.install()
    first = {m.__name__: m.CreateTransferChannel for m in _users()}
    kl.install()
    mods = _users()
    assert {m.__name__ for m in mods} >= {
        "lmcache.v1.transfer_channel",
        "lmcache.v1.storage_backend.pd_backend",
        "lmcache.v1.storage_backend.pd_backend_async",
    }
    for m in mods:
        assert getattr(m.CreateTransferChannel, "kvbridge_hook", False), m.__name__
        assert m.CreateTransferChannel is first[m.__name__], "a second install() rebinds again"
        original = m.CreateTransferChannel.__wrapped__
        assert not getattr(original, "kvbridge_hook", False), "a hook wraps a hook"
    assert sorted(kl.installed()) == sorted(m.__name__ for m in mods)


def test_other_channel_types_still_reach_lmcaches_factory():
    import kvbridge.lmcache as kl
    from lmcache.v1.storage_backend import pd_backend_async

    kl.install()
    with pytest.raises(AssertionError, match="Unsupported channel type: carrier-pigeon"):
        pd_backend_async.CreateTransferChannel(
            channel_type="carrier-pigeon", async_mode=False, role="sender", buffer_ptr=0,
            buffer_size=0, align_bytes=1, tp_rank=0, peer_init_url=None,
        )


def test_kvbridge_with_a_gpu_buffer_is_a_clear_error():
    import kvbridge.lmcache as kl
    from lmcache.v1.storage_backend import pd_backend

    kl.install()
    with pytest.raises(ValueError, match="pd_buffer_device: cpu"):
        pd_backend.CreateTransferChannel(
            channel_type="kvbridge", async_mode=False, role="sender", buffer_ptr=0,
            buffer_size=4096, align_bytes=4096, tp_rank=0, peer_init_url=None, device="cuda:0",
        )


def test_a_mock_in_place_is_left_alone():
    import kvbridge.lmcache as kl
    from lmcache.v1.storage_backend import pd_backend_async

    with patch("lmcache.v1.storage_backend.pd_backend_async.CreateTransferChannel") as mock:
        kl.install()
        assert pd_backend_async.CreateTransferChannel is mock
    kl.install()
    assert getattr(pd_backend_async.CreateTransferChannel, "kvbridge_hook", False)


def test_untested_lmcache_versions_warn_loudly():
    from kvbridge.lmcache.install import UntestedLMCacheVersion, check_version

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_version("0.5.6")
    with pytest.warns(UntestedLMCacheVersion, match="LMCache 0.9.9 is installed"):
        assert not check_version("0.9.9")


def test_run_installs_the_hooks_then_runs_the_module_with_its_arguments(tmp_path):
    (tmp_path / "probe_mod.py").write_text(
        "import sys\n"
        "from lmcache.v1.storage_backend import pd_backend_async as m\n"
        "print('hook', getattr(m.CreateTransferChannel, 'kvbridge_hook', False), sys.argv[1:])\n"
        "sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvbridge.lmcache.run", "probe_mod", "--flag", "x"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 3, out.stderr
    assert "hook True ['--flag', 'x']" in out.stdout, out.stdout + out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "kvbridge.lmcache.run"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_vllm_connector_module_subclasses_lmcaches_connector_and_installs():
    # LMCache's vLLM connector module imports vLLM, which the test environment lacks: a
    # stand-in for that one module (with LMCache's class name) is enough to check ours.
    name = "lmcache.integration.vllm.lmcache_connector_v1"
    try:
        real = importlib.import_module(name)
        base = real.LMCacheConnectorV1Dynamic
        stub = None
    except ImportError:
        stub = types.ModuleType(name)
        base = type("LMCacheConnectorV1Dynamic", (), {})
        stub.LMCacheConnectorV1Dynamic = base
    sys.modules.pop("kvbridge.lmcache.vllm", None)
    with patch.dict(sys.modules, {name: stub} if stub else {}):
        mod = importlib.import_module("kvbridge.lmcache.vllm")
    assert issubclass(mod.KvbridgeLMCacheConnectorV1, base)
    import kvbridge.lmcache as kl

    assert "lmcache.v1.storage_backend.pd_backend_async" in kl.installed()


def test_install_registers_kvbridge_in_lmcaches_distributed_registry():
    if importlib.util.find_spec("kvbridge.lmcache.distributed") is None:
        pytest.skip("this build has no distributed channel context")
    import kvbridge.lmcache as kl
    from lmcache.v1.distributed.transfer_channel import factory

    kl.install()
    assert "kvbridge" in factory._TRANSFER_CHANNEL_FACTORY_REGISTRY
