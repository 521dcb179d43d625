"""Install wrappers on SGLang functions by dotted path, check their signatures, and verify them later.

A hook names its target by module and qualified name, the parameter names it expects, and the guard that
owns it. Installation happens when the target module is imported (see ``_importhook``), in whatever process
that is. A target that is missing or whose signature moved raises :class:`HookInstallError` at once: a guard
that silently failed to install is a hole, so we refuse to run instead of logging and carrying on.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from sglang_harden._importhook import when_imported
from sglang_harden.compat import hook_timer

logger = logging.getLogger("sglang_harden")

WRAPPED_MARK = "__sglang_harden_hook__"
Wrapper = Callable[[Callable[..., object]], Callable[..., object]]


class HookInstallError(RuntimeError):
    """A hook target is missing or changed shape on this SGLang pin."""


# The owner of the hooks that keep decode's page ledger for the page-tag guard when the lifecycle guard (which
# otherwise keeps it) is off: armed only then, so that each guard works without the other.
PAGE_LEDGER_OWNER = "page_ledger"


@dataclass(frozen=True)
class Hook:
    owner: str
    module: str
    qualname: str
    params: tuple[str, ...]
    make_wrapper: Wrapper
    # Feature-probed: installed where this release has the target; a release without it lacks the behaviour the
    # hook answers, so its absence is no gap. A present target whose signature moved still refuses.
    optional: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.qualname}"


_lock = threading.Lock()
_registered: dict[str, Hook] = {}
_installed: dict[str, str] = {}


def register(hook: Hook) -> None:
    """Install ``hook`` when (or as soon as) its module is imported. Idempotent per target+owner."""
    key = f"{hook.target}#{hook.owner}"
    with _lock:
        if key in _registered:
            return
        _registered[key] = hook
    when_imported(hook.module, functools.partial(_install, hook, key))


def _resolve(module: ModuleType, qualname: str) -> tuple[object, str, Callable[..., object]]:
    owner: object = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise HookInstallError(f"{module.__name__}.{qualname}: {part} not found")
    attr = parts[-1]
    raw = inspect.getattr_static(owner, attr, None)
    if raw is None:
        raise HookInstallError(f"{module.__name__}.{qualname}: not found")
    return owner, attr, raw


def _way_out(owner: str) -> str:
    guard = "page_tags" if owner == PAGE_LEDGER_OWNER else owner
    return f"start with --harden-{guard.replace('_', '-')} off to run without that guard, or see `sglang-harden doctor`"


def _check_params(hook: Hook, func: Callable[..., object]) -> None:
    names = tuple(inspect.signature(func).parameters)
    if names[: len(hook.params)] != hook.params:
        raise HookInstallError(
            f"{hook.target}: expected parameters {hook.params}, found {names} "
            "(is this SGLang pin supported? see `sglang-harden doctor`)"
        )


def _install(hook: Hook, key: str, module: ModuleType) -> None:
    try:
        owner, attr, raw = _resolve(module, hook.qualname)
    except HookInstallError as exc:
        if not hook.optional:
            raise HookInstallError(f"{exc}; the {hook.owner} hook needs it ({_way_out(hook.owner)})") from exc
        logger.debug("sglang-harden: %s not in this release; %s's hook on it not needed", hook.target, hook.owner)
        return
    is_static = isinstance(raw, staticmethod)
    func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
    _check_params(hook, func)
    wrapped = _wrap(hook, key, func)
    if wrapped is not func:  # a hook that joins a wrapper already there (the commit chain) adds only its mark
        functools.update_wrapper(wrapped, func)
    marks = set(getattr(func, WRAPPED_MARK, ())) | {hook.owner}
    setattr(wrapped, WRAPPED_MARK, frozenset(marks))
    if is_static:
        wrapped = staticmethod(wrapped)
    elif isinstance(raw, classmethod):
        wrapped = classmethod(wrapped)
    setattr(owner, attr, wrapped)
    with _lock:
        _installed[key] = hook.target
    logger.debug("sglang-harden hook %s installed on %s", hook.owner, hook.target)


def _wrap(hook: Hook, key: str, func: Callable[..., object]) -> Callable[..., object]:
    """``hook``'s wrapper around ``func``; with its owner in ``SGLANG_HARDEN_TIME_HOOKS``, inside a timer."""
    if hook.owner not in hook_timer.timed_owners() or getattr(hook.make_wrapper, "times_itself", False):
        return hook.make_wrapper(func)
    return hook_timer.outer(hook.make_wrapper(hook_timer.inner(func)), key)


def is_in_place(hook: Hook) -> bool:
    import sys

    module = sys.modules.get(hook.module)
    if module is None:
        return False
    try:
        _, _, raw = _resolve(module, hook.qualname)
    except HookInstallError:
        return False
    func = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
    return hook.owner in getattr(func, WRAPPED_MARK, ())


def probed_absent(hook: Hook) -> bool:
    """An optional hook whose target module is imported here and lacks the target (this release's shape)."""
    import sys

    module = sys.modules.get(hook.module)
    if not hook.optional or module is None:
        return False
    try:
        _resolve(module, hook.qualname)
    except HookInstallError:
        return True
    return False


def _optional_not_loaded(hook: Hook) -> bool:
    """An optional hook whose module this process has not imported (or this release does not have): nothing here
    calls its target; were the module imported later, the hook is installed on that import."""
    import sys

    return hook.optional and hook.module not in sys.modules


def missing(hooks: list[Hook]) -> list[str]:
    """Targets of ``hooks`` that are not wrapped in this process right now (an optional hook whose target this
    release lacks, or whose module is not loaded here, is not missing)."""
    return [f"{h.owner} -> {h.target}" for h in hooks
            if not is_in_place(h) and not probed_absent(h) and not _optional_not_loaded(h)]


def registered_hooks() -> list[Hook]:
    with _lock:
        return list(_registered.values())
