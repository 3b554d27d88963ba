"""1P1D with real vLLM CPU servers: needs torch, vLLM (scripts/test-vllm.sh installs them) and a
built ``kvbridge`` binary. Without vLLM this directory is left out (scripts/test-vllm.sh then
fails: its run collects no test); without the binary the tests skip (under CI they fail)."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


if not (_installed("torch") and _installed("vllm")):
    collect_ignore_glob = ["test_*.py"]
