"""``python -m kvbridge.lmcache.run MODULE [ARGS...]``: runs an LMCache module with kvbridge.

Installs kvbridge's hooks into LMCache (``transfer_channel: "kvbridge"``, and the distributed
channel registry when present), then runs MODULE as ``python -m MODULE ARGS...`` would, in
this process. For example::

    python -m kvbridge.lmcache.run lmcache.tools.transfer_channel_benchmark \\
        --role server --transfer-channel-type kvbridge --url 127.0.0.1:7600 ...
"""

from __future__ import annotations

import runpy
import sys

USAGE = "usage: python -m kvbridge.lmcache.run MODULE [ARGS...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        print(__doc__.split("\n\n", 1)[1].rstrip(), file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    module = argv[0]
    if module.startswith("-"):
        print(f"{USAGE}\nerror: {module!r} is an option, not a module", file=sys.stderr)
        return 2
    from kvbridge.lmcache.install import install

    install()
    sys.argv = [module, *argv[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
