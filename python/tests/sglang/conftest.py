"""The SGLang backend's tests need SGLang (scripts/test-sglang.sh installs it into
.venv-sglang); without it this directory is left out, so the package's own suite runs
anywhere. With it, every test here runs against SGLang's real classes."""

import importlib.util
import os


def _installed(name: str) -> bool:
    # This directory is itself named sglang: without the real package, an import of
    # "sglang" finds it as a namespace package, which has no origin.
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


if not _installed("sglang"):
    collect_ignore_glob = ["test_*.py"]
else:
    # Short deadlines, so the failure tests end in seconds; read once, when the session's
    # managers are made (sglang_pd.py).
    os.environ["KVBRIDGE_SECRET"] = "sglang-test-secret-0123456789"
    os.environ["KVBRIDGE_SGLANG_TRANSFER_TIMEOUT_S"] = "6"
    os.environ["KVBRIDGE_SGLANG_LEASE_S"] = "4"
    os.environ["KVBRIDGE_SGLANG_PROBE_S"] = "0.2"
    from sglang_pd import pd  # noqa: F401,E402  (fixture)
