"""Real SGLang servers on CPU (scripts/test-sglang.sh --e2e); left out without SGLang."""

import importlib.util


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


if not _installed("sglang"):
    collect_ignore_glob = ["test_*.py"]
