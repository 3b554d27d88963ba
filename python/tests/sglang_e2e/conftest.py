"""Real SGLang servers on CPU (scripts/test-sglang.sh --e2e); left out without SGLang. With it,
the servers every test shares come from pool.py (session fixtures)."""

import importlib.util


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


if not _installed("sglang"):
    collect_ignore_glob = ["test_*.py"]
else:
    from pool import env, pair, references  # noqa: F401,E402  (fixtures)
