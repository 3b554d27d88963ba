"""Makes ``--disaggregation-transfer-backend kvbridge`` work in an unmodified SGLang.

SGLang's backend list is fixed in three places: the CLI choices
(``sglang.srt.arg_groups.choices.DISAGG_TRANSFER_BACKEND_CHOICES``, which SGLang extends for
plugins with ``add_disagg_transfer_backend_choices``), the ``TransferBackend`` enum and
``get_kv_class`` (``sglang.srt.disaggregation.utils``), which ``prefill.py``, ``decode.py`` and
``disagg_service.py`` import by name. ``install()`` adds the name to the choices, a
``KVBRIDGE`` member to the enum, and rebinds ``get_kv_class`` in its module and in every
module that imported it to a wrapper that returns kvbridge's classes for
``TransferBackend.KVBRIDGE`` and calls SGLang's own for anything else.

SGLang also refuses ``--disaggregation-decode-allocation-policy prefill_complete`` with any
backend but Mooncake (``_validate_prefill_complete`` in
``sglang.srt.arg_groups.pd_disaggregation_hook``): that policy needs a backend to carry the
decode's ``BOOTSTRAP`` request and the prefill's readiness, which this one does
(receiver.py, manager.py). ``install()`` rebinds the check to a wrapper that drops that one
reason for ``kvbridge`` and keeps every other (TP, PP, role switch...).

It runs in every SGLang process: SGLang calls its general plugins (entry point group
``sglang.srt.plugins``, which kvbridge's package declares) early in the main process, the
scheduler and the detokenizer; ``python -m kvbridge.sglang.launch_server`` also calls it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import warnings
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

#: The name a user passes to ``--disaggregation-transfer-backend``.
BACKEND_NAME = "kvbridge"
#: SGLang releases this backend was tested against (it patches SGLang internals).
TESTED_SGLANG_VERSIONS = ("0.5.23",)
#: Modules that import ``get_kv_class`` by name (its own module first).
GET_KV_CLASS_USERS = (
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.managers.disagg_service",
)

#: The module whose ``_validate_prefill_complete`` refuses other backends than Mooncake.
POLICY_CHECK_MODULE = "sglang.srt.arg_groups.pd_disaggregation_hook"
#: How that check starts its refusal, and the reason it gives for the backend.
POLICY_REFUSAL = "--disaggregation-decode-allocation-policy prefill_complete does not yet support "
MOONCAKE_ONLY = "transfer backends other than Mooncake"

_lock = threading.Lock()
_original: Optional[Callable[..., Any]] = None


class UntestedSGLangVersion(UserWarning):
    """SGLang is a release this backend was not tested against."""


def check_version(version: str) -> bool:
    """Whether ``version`` is a tested SGLang release; warns loudly when it is not."""
    if version in TESTED_SGLANG_VERSIONS:
        return True
    msg = (
        f"kvbridge.sglang was tested with SGLang {', '.join(TESTED_SGLANG_VERSIONS)} but SGLang "
        f"{version} is installed: its hook patches SGLang internals (TransferBackend, "
        "get_kv_class), which may have changed. Run scripts/test-sglang.sh against it first."
    )
    warnings.warn(msg, UntestedSGLangVersion, stacklevel=3)
    logger.warning(msg)
    return False


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    """Adds ``name = value`` to an existing Enum class (idempotent), as if declared."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    if hasattr(member, "_sort_order_"):
        member._sort_order_ = len(enum_cls._member_names_)
    # EnumType.__setattr__ refuses to rebind members only; set the attribute first.
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _wrap(original: Callable[..., Any], backend_member: Any) -> Callable[..., Any]:
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is backend_member:
            from kvbridge.sglang import classes

            return classes.kv_class(class_type)
        return original(transfer_backend, class_type)

    get_kv_class.__doc__ = f"SGLang's get_kv_class, plus TransferBackend.KVBRIDGE ({BACKEND_NAME!r})."
    get_kv_class.__wrapped__ = original  # type: ignore[attr-defined]
    get_kv_class.kvbridge_hook = True  # type: ignore[attr-defined]
    return get_kv_class


def _wrap_policy_check(original: Callable[..., Any]) -> Callable[..., Any]:
    def _validate_prefill_complete(server_args: Any) -> None:
        try:
            original(server_args)
        except ValueError as e:
            text = str(e)
            if getattr(server_args, "disaggregation_transfer_backend", None) != BACKEND_NAME:
                raise
            if not text.startswith(POLICY_REFUSAL):
                raise
            rest = [r for r in text[len(POLICY_REFUSAL) :].split(", ") if r != MOONCAKE_ONLY]
            if rest:
                raise ValueError(POLICY_REFUSAL + ", ".join(rest)) from None

    _validate_prefill_complete.__wrapped__ = original  # type: ignore[attr-defined]
    _validate_prefill_complete.kvbridge_hook = True  # type: ignore[attr-defined]
    return _validate_prefill_complete


def _allow_prefill_complete() -> None:
    try:
        mod = importlib.import_module(POLICY_CHECK_MODULE)
    except ImportError as e:  # a release without the policy, or that moved its check
        logger.warning(
            "kvbridge: %s not importable, prefill_complete left as SGLang has it: %s", POLICY_CHECK_MODULE, e
        )
        return
    check = getattr(mod, "_validate_prefill_complete", None)
    if check is None or _is_hook(check):
        return
    mod._validate_prefill_complete = _wrap_policy_check(check)


def _is_hook(fn: Any) -> bool:
    return bool(getattr(fn, "kvbridge_hook", False))


def install() -> None:
    """Adds the ``kvbridge`` transfer backend to SGLang. Idempotent and thread-safe.

    Raises ``ImportError`` when SGLang is not installed.
    """
    global _original
    with _lock:
        import sglang

        check_version(getattr(sglang, "__version__", "unknown"))
        from sglang.srt.arg_groups import choices

        if BACKEND_NAME not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
            choices.add_disagg_transfer_backend_choices([BACKEND_NAME])
        utils = importlib.import_module(GET_KV_CLASS_USERS[0])
        member = _add_enum_member(utils.TransferBackend, "KVBRIDGE", BACKEND_NAME)
        current = utils.get_kv_class
        if _original is None:
            _original = getattr(current, "__wrapped__", current) if _is_hook(current) else current
        hook = _wrap(_original, member)
        for name in GET_KV_CLASS_USERS:
            try:
                mod = importlib.import_module(name)
            except ImportError as e:  # a module a release moved: the others still work
                logger.warning("kvbridge: %s not importable, get_kv_class not patched there: %s", name, e)
                continue
            fn = getattr(mod, "get_kv_class", None)
            if fn is None or _is_hook(fn):
                continue
            if fn is not _original:
                logger.warning("kvbridge: %s.get_kv_class is not SGLang's; left as is", name)
                continue
            mod.get_kv_class = hook
        _allow_prefill_complete()


def installed() -> list[str]:
    """The modules whose ``get_kv_class`` knows the kvbridge backend."""
    return [
        name
        for name in GET_KV_CLASS_USERS
        if _is_hook(getattr(sys.modules.get(name), "get_kv_class", None))
    ]


def plugin() -> None:
    """SGLang's general-plugin entry point (``sglang.srt.plugins``): ``install()``, with the
    failure logged loudly rather than raised (SGLang logs and goes on either way)."""
    try:
        install()
    except Exception:  # noqa: BLE001 - see the docstring
        logger.exception("kvbridge: the SGLang transfer backend could not be installed")
