"""What SGLang 0.5.23's CPU path needs and PyPI does not ship (docs/sglang.md, and
../shared/design/cpu-real-engines.md section 9), written at test time into a temporary
directory that goes first on the servers' PYTHONPATH. Nothing of SGLang is changed.

* ``vllm/_custom_ops.py``: SGLang's rotary embedding imports ``rotary_embedding`` from it on
  a device it does not take for CUDA, HIP or its CPU engine, and never calls it on this path
  (the stand-in raises if it ever is, so a run that needed it fails loudly). The CPU engine
  itself (``SGLANG_USE_CPU_ENGINE=1``) needs a CPU build of sgl_kernel that PyPI lacks.

* ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`` on a prefill server: with overlap
  scheduling, a request whose prompt hits the prefill's radix cache has its cached prefix
  sent early, behind a ``torch.cuda.Event`` recorded on the forward stream, which fails on
  CPU (``RuntimeError: expected stream to be a torch.Stream``) and kills the scheduler,
  whatever the transfer backend. Off, the prefix goes with the request's last chunk.

Server flags that stand in for the rest, set by servers.py: ``--device cpu``,
``--max-total-tokens`` (else SGLang reserves 9.4 GB of KV), and on a decode server
``--disaggregation-decode-retraction-backup cpu_tensor`` (the default pins host memory with
``cudaHostRegister``).
"""

from __future__ import annotations

from pathlib import Path

PREFILL_ENV = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}

CUSTOM_OPS = '''"""Stand-in written by kvbridge's tests (python/tests/sglang_e2e/standins.py): SGLang
imports these names on CPU and never calls them there."""


def _never(*args, **kwargs):
    raise NotImplementedError("kvbridge test stand-in for vllm._custom_ops was called")


rotary_embedding = _never
'''


def write(root: Path) -> Path:
    pkg = root / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""kvbridge test stand-in (see _custom_ops)."""\n')
    (pkg / "_custom_ops.py").write_text(CUSTOM_OPS)
    return root
