"""The vLLM connector's tests need torch and vLLM (scripts/test-vllm.sh installs them);
without them this directory is left out, so the package's own suite runs anywhere."""

import importlib.util


def _installed(name: str) -> bool:
    # This directory is itself named vllm: without the real package, an import of "vllm"
    # finds it as a namespace package, which has no origin.
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


if not (_installed("torch") and _installed("vllm")):
    collect_ignore_glob = ["test_*.py"]
else:
    from vllm_helpers import workers  # noqa: F401  (fixture)
