"""The vLLM connector's tests need torch and vLLM (scripts/test-vllm.sh installs them);
without them this directory is left out, so the package's own suite runs anywhere."""

import importlib.util

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from vllm_helpers import workers  # noqa: F401  (fixture)
