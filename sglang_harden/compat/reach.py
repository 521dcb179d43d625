"""What protects an SGLang release, and what an operator on an unprotected one should do next.

A release is protected by the plugin (``pins.SUPPORTED_PINS``, each proven end to end) and/or by a backport series
(``patches/<release>``). For any other release the plugin refuses to start; :func:`next_step` words what its
refusal and ``sglang-harden patch list --pin`` tell the operator: the series to apply where one exists, else the
nearest protected releases on either side and which path protects each. Pure: the caller passes the releases that
have a series.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sglang_harden.compat.pins import RELEASE_RE, SUPPORTED_PINS, release_key


@dataclass(frozen=True)
class Reach:
    release: str
    plugin: bool
    series: bool
    older: str | None  # the newest protected release before this one ("0.5.18 (series)")
    newer: str | None  # the oldest protected release after it ("0.5.19 (plugin + series)")


def reach_of(release: str, series_pins: Iterable[str]) -> Reach:
    """Where ``release`` stands; ValueError when it is not a final release number (rc, dev, local builds)."""
    key = release_key(release)
    series = frozenset(pin for pin in series_pins if RELEASE_RE.match(pin))  # not a fork's folder name
    protected = sorted(set(SUPPORTED_PINS) | series, key=release_key)
    older = [pin for pin in protected if release_key(pin) < key]
    newer = [pin for pin in protected if release_key(pin) > key]
    return Reach(release, release in SUPPORTED_PINS, release in series,
                 _with_paths(older[-1], series) if older else None, _with_paths(newer[0], series) if newer else None)


def _with_paths(release: str, series: frozenset[str]) -> str:
    paths = [path for path, held in (("plugin", release in SUPPORTED_PINS), ("series", release in series)) if held]
    return f"{release} ({' + '.join(paths)})"


def newest_plugin_pin() -> str:
    return max(SUPPORTED_PINS, key=release_key)


def next_step(release: str, series_pins: Iterable[str]) -> str:
    """What to do on ``release``, in a sentence or two (empty when the plugin supports it)."""
    try:
        reach = reach_of(release, series_pins)
    except ValueError:
        return (f"SGLang {release} is not a final release; the plugin and the backport series are built and proven "
                f"for final releases only (the newest the plugin supports: {newest_plugin_pin()}).")
    if reach.plugin:
        return ""
    if reach.series:
        return (f"This release has a backport series: run `sglang-harden patch apply --pin {release} --tree "
                "<site-packages>`, then `pip uninstall sglang-harden` (docs/deploy.md).")
    if reach.newer is None:
        return (f"SGLang {release} is newer than every release this sglang-harden knows: upgrade sglang-harden, or "
                f"pin SGLang {newest_plugin_pin()}, the newest release its plugin supports.")
    around = f"older: {reach.older}; newer: {reach.newer}" if reach.older else f"newer: {reach.newer}"
    return (f"Nothing here protects SGLang {release}: the plugin does not support it and no backport series exists "
            f"for it. The nearest protected releases: {around}. `sglang-harden compat sweep --releases {release}` "
            "shows why the plugin's adapters do not fit it.")
