"""The only package that knows SGLang's internal names, one module per version family.

``activate()`` reads the installed SGLang version without importing SGLang, picks the family adapter and
registers its hooks; each hook installs itself when its target module is imported in this process. An
unknown pin is refused with a message naming it and the override (``SGLANG_HARDEN_ALLOW_UNKNOWN_PIN=1``,
``--harden-allow-unknown-pin 1``), which then takes the family whose hooks resolve on that release's code (read
without importing it, as ``compat sweep`` judges it) and still fails closed on any hook whose target or signature
does not match.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from dataclasses import dataclass

from sglang_harden._importhook import when_imported
from sglang_harden.compat import control_auth, hooks
from sglang_harden.compat.pins import SUPPORTED_PINS, patched_tree_marker  # SUPPORTED_PINS re-exported
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.config import GUARDS, Mode, load_config

logger = logging.getLogger("sglang_harden")

_lock = threading.Lock()
PATCHED_TREE = "patched-tree"  # the family reported where the backport series holds the guards
_active: Activation | None = None


@dataclass(frozen=True)
class Activation:
    pin: str
    family: str
    source: str
    hooks: tuple[str, ...]


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def family_module_for(pin: str | None, allow_unknown: bool) -> str:
    if pin in SUPPORTED_PINS:
        return SUPPORTED_PINS[pin]
    supported = ", ".join(sorted(SUPPORTED_PINS))
    if pin is None:
        raise HardenRefusal("sglang-harden: SGLang is not installed in this environment")
    if not allow_unknown:
        raise HardenRefusal(
            f"sglang-harden: SGLang {pin} is not a supported pin (supported: {supported}). "
            f"Refusing to start unguarded. {_next_step_for(pin)} Or override at your own risk with "
            "SGLANG_HARDEN_ALLOW_UNKNOWN_PIN=1 (or --harden-allow-unknown-pin 1); every hook is still checked "
            "against this pin's code."
        )
    fitting, family, missing = probe_family()
    if fitting is None:
        logger.warning("sglang-harden: unknown SGLang pin %s allowed by override; no adapter family fits its code, "
                       "taking %s (fewest gaps), whose armed hooks still refuse where they do not resolve: %s", pin,
                       family, "; ".join(missing[:5]) or "-")
    else:
        logger.warning("sglang-harden: unknown SGLang pin %s allowed by override; family %s (every hook of it "
                       "resolves on this release's code)", pin, family)
    return family


def _next_step_for(pin: str) -> str:
    from sglang_harden.compat.reach import next_step
    from sglang_harden.tools.patch import available_pins, default_patches_dir

    return next_step(pin, available_pins(default_patches_dir()))


def probe_family() -> tuple[str | None, str, list[str]]:
    """The adapter family for the installed SGLang, judged from its code (``compat_sweep.choose_family``)."""
    from sglang_harden.tools._source import SourceTree
    from sglang_harden.tools.compat_sweep import choose_family

    tree = SourceTree.installed()
    if tree is None:
        raise HardenRefusal("sglang-harden: SGLang's code is not readable here, so no adapter can be chosen for it")
    return choose_family(tree)


def activate(source: str) -> Activation:
    """Register this family's hooks in this process (idempotent). Raises HardenRefusal on an unknown pin."""
    global _active
    with _lock:
        if _active is not None:
            return _active
        pin = installed_sglang_version()
        RUNTIME.configure(pin or "none", "", source)
        marker = patched_tree_marker()
        if marker is not None:
            logger.warning("sglang-harden: this SGLang %s carries the backport series (%s), which holds the guards; "
                           "the plugin stays off. Next step: pip uninstall sglang-harden (docs/deploy.md)",
                           pin, marker)
            RUNTIME.family = PATCHED_TREE
            _active = Activation(pin or "none", PATCHED_TREE, source, ())
            return _active
        module_name = family_module_for(pin, RUNTIME.config.allow_unknown_pin)
        family = importlib.import_module(f"sglang_harden.compat.{module_name}")
        RUNTIME.family = family.FAMILY
        _check_control_auth(family.HOOKS)
        enabled = _register_enabled(family.HOOKS)
        for module, callback in family.MODULE_CALLBACKS.items():
            when_imported(module, callback)
        _active = Activation(pin or "none", family.FAMILY, source, tuple(h.target for h in enabled))
        return _active


def reconfigure() -> None:
    """Re-read the configuration after the environment changed (the launcher, armed early by the start-up
    hook, learns its ``--harden-*`` options only afterwards); arms guards that became enabled."""
    with _lock:
        if _active is None or _active.family == PATCHED_TREE:
            return
        RUNTIME.config = load_config()
        family_hooks = _family_hooks(_active.pin)
        _check_control_auth(family_hooks)
        _register_enabled(family_hooks)


def _register_enabled(family_hooks: list[hooks.Hook]) -> list[hooks.Hook]:
    enabled = [h for h in family_hooks if _owner_enabled(h.owner)]
    for hook in enabled:
        hooks.register(hook)
    RUNTIME.armed = tuple(sorted({h.owner for h in enabled} & set(GUARDS)))
    return enabled


def _owner_enabled(owner: str) -> bool:
    if owner == "bootstrap_auth":
        return control_auth.configured()  # no secret: nothing to check tokens against, not armed
    if owner == "zmq_auth":
        from sglang_harden.compat import zmq_settings

        return zmq_settings.auth_configured()
    if owner == hooks.PAGE_LEDGER_OWNER:  # the lifecycle hooks keep the ledger whenever that guard is on
        return RUNTIME.config.page_tags is not Mode.OFF and RUNTIME.config.lifecycle is Mode.OFF
    return owner not in GUARDS or RUNTIME.config.mode(owner) is not Mode.OFF


def _check_control_auth(family_hooks: list[hooks.Hook]) -> None:
    """A named secret file must be usable, enforce needs one, and the pin must have somewhere to check it."""
    control_auth.load(RUNTIME.config)
    if control_auth.configured() and not any(h.owner == "bootstrap_auth" for h in family_hooks):
        raise HardenRefusal(f"sglang-harden: control-plane authentication is not available on SGLang {RUNTIME.pin} "
                            "(a bootstrap secret file is configured); remove it or use a supported 0.5.x pin")


def _family_hooks(pin: str | None) -> list[hooks.Hook]:
    name = SUPPORTED_PINS.get(pin or "", "sglang_v05")
    module = importlib.import_module(f"sglang_harden.compat.{name}")
    return list(module.HOOKS)


def active() -> Activation | None:
    return _active


def describe() -> dict[str, object]:
    """What an operator tool needs: pin, family, whether supported, guards supplied and active here."""
    pin = installed_sglang_version()
    supported = pin in SUPPORTED_PINS
    activation = _active
    installed = {h.target: hooks.is_in_place(h) for h in hooks.registered_hooks() if not hooks.probed_absent(h)}
    return {
        "pin": pin,
        "family": SUPPORTED_PINS.get(pin or ""),
        "supported": supported,
        "supported_pins": sorted(SUPPORTED_PINS),
        "guards_supplied": sorted({h.owner for h in _family_hooks(pin)} & set(GUARDS)) if supported else [],
        "guards_armed_here": list(RUNTIME.armed),
        "active_in_this_process": activation is not None,
        "hooks_in_place": installed,
    }
