"""What the plugin's refusal and `patch list --pin` tell an operator on a release nothing protects: the series
where one exists, else the nearest protected releases and which path protects each (sglang_harden.compat.reach)."""

from __future__ import annotations

import pytest

from sglang_harden.compat import family_module_for
from sglang_harden.compat.reach import next_step, reach_of
from sglang_harden.compat.runtime import HardenRefusal
from sglang_harden.tools import patch

SERIES = ("0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")


def test_a_release_between_two_series_names_both_and_the_plugin_path() -> None:
    reach = reach_of("0.5.11", SERIES)
    assert (reach.plugin, reach.series) == (False, False)
    assert (reach.older, reach.newer) == ("0.5.10.post1 (series)", "0.5.18 (series)")
    assert reach_of("0.5.18.post1", SERIES).newer == "0.5.19 (plugin + series)"
    step = next_step("0.5.11", SERIES)
    assert "Nothing here protects SGLang 0.5.11" in step
    assert "older: 0.5.10.post1 (series); newer: 0.5.18 (series)" in step
    assert "compat sweep --releases 0.5.11" in step


def test_post_releases_order_between_their_neighbours() -> None:
    assert reach_of("0.4.9.post5", SERIES).newer == "0.4.9.post6 (plugin + series)"
    assert reach_of("0.4.9.post5", SERIES).older is None
    assert reach_of("0.4.10", SERIES).older == "0.4.9.post6 (plugin + series)"
    assert "older:" not in next_step("0.4.9.post5", SERIES)


def test_a_series_only_release_is_told_to_apply_it_and_drop_the_plugin() -> None:
    step = next_step("0.5.18", SERIES)
    assert "patch apply --pin 0.5.18" in step and "pip uninstall sglang-harden" in step
    assert next_step("0.5.18", ()) != step  # the series decides it, not the version string


def test_supported_newer_and_non_final_releases() -> None:
    assert next_step("0.5.19", SERIES) == ""
    newer = next_step("0.6.0", SERIES)
    assert "newer than every release" in newer and "pin SGLang 0.5.23" in newer
    # a folder of patches/ that is not a release (a fork's series) is no protected release, nor a bad release
    assert reach_of("0.5.11", [*SERIES, "my-fork"]).newer == "0.5.18 (series)"
    assert "Nothing here protects SGLang 0.5.11" in next_step("0.5.11", [*SERIES, "my-fork"])
    assert "not a final release" in next_step("0.5.24rc1", SERIES)
    with pytest.raises(ValueError):
        reach_of("0.5.24.dev3+g1234", SERIES)


def test_the_plugin_refusal_carries_the_next_step() -> None:
    with pytest.raises(HardenRefusal) as info:
        family_module_for("0.5.11", allow_unknown=False)
    assert "Refusing to start unguarded" in str(info.value)
    assert "newer: 0.5.18 (series)" in str(info.value)
    with pytest.raises(HardenRefusal, match="patch apply --pin 0.5.10.post1"):
        family_module_for("0.5.10.post1", allow_unknown=False)


def test_patch_list_for_a_release_without_a_series_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    code = patch.run(patch.argparse.Namespace(action="list", pin="0.5.11", tree=None, patches=None, json=False))
    err = capsys.readouterr()
    assert code == patch.EXIT_USAGE
    assert "no patch series for SGLang 0.5.11" in err.err + err.out
    assert "newer: 0.5.18 (series)" in err.err + err.out
