"""Suite-wide options and the end-of-session check that no process started by the suite is alive.

- ``--pins`` (default: env ``SGLANG_HARDEN_PINS``, else the CI pins of ``ci/pins.toml``) selects the SGLang
  pins that per-pin tests run for. A selected pin whose venv is missing FAILS its tests with the command that
  builds it; unselected pins are skipped.
- ``--profiles`` (default: env ``SGLANG_HARDEN_TEST_PROFILES``, else ``[ci].profiles`` of ``ci/pins.toml``)
  selects the testbed profiles of cases named ``<pin>/<backend>/<profile>``; the others are skipped, saying so.
- Under pytest-xdist (``-n``), every test of one SGLang pin in one module runs on the same worker (its
  module-scoped server pairs start once), and each worker checks only the processes it started.
- Every process group the testbed starts is recorded (in memory, and in a pid file that subprocesses started
  by tests append to through ``SGLANG_HARDEN_TESTBED_PIDFILE``); at session end any of them still alive is
  killed and the session fails.
- With ``SGLANG_HARDEN_MATRIX_RESULTS=DIR``, each test marked ``proves(path, *guards)`` appends its result per pin
  (for the paths of a user property ``("proves_paths", [path, ...])`` instead, where a test sets one)
  to ``DIR/<pin>.jsonl``, from which ``sglang-harden doctor --matrix`` builds the guard x pin x path matrix.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_harden.tools import matrix
from sglang_harden.tools.matrix import ENV as MATRIX_ENV

PIDFILE_ENV = "SGLANG_HARDEN_TESTBED_PIDFILE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pins",
        default=None,
        help="comma-separated SGLang pins for per-pin tests (default: $SGLANG_HARDEN_PINS or ci/pins.toml [ci].pins;"
        " 'all' = every pin in ci/pins.toml)",
    )
    parser.addoption(
        "--profiles",
        default=None,
        help="comma-separated testbed profiles for cases named <pin>/<backend>/<profile> (default:"
        " $SGLANG_HARDEN_TEST_PROFILES or ci/pins.toml [ci].profiles; 'all' = every profile)",
    )


def selected_pins(config: pytest.Config) -> list[str]:
    from sglang_harden.testbed.envs import all_pins, ci_pins

    raw = config.getoption("--pins") or os.environ.get("SGLANG_HARDEN_PINS") or ""
    if raw.strip() == "all":
        return all_pins()
    pins = [p.strip() for p in raw.split(",") if p.strip()]
    return pins or ci_pins()


def selected_profiles(config: pytest.Config) -> list[str]:
    from sglang_harden.testbed.envs import ci_profiles
    from sglang_harden.testbed.profiles import PROFILES

    raw = config.getoption("--profiles") or os.environ.get("SGLANG_HARDEN_TEST_PROFILES") or ""
    if raw.strip() == "all":
        return list(PROFILES)
    return [p.strip() for p in raw.split(",") if p.strip()] or ci_profiles()


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(PIDFILE_ENV) or hasattr(config, "workerinput"):
        fd, path = tempfile.mkstemp(prefix="sglang-harden-pids-", suffix=".txt")
        os.close(fd)
        os.environ[PIDFILE_ENV] = path
        config._sglang_harden_pidfile = path  # type: ignore[attr-defined]


def _item_pin(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "pin" in callspec.params:
        return str(callspec.params["pin"])
    pin = getattr(getattr(item, "module", None), "PIN", None)
    return pin if isinstance(pin, str) else None


# Worker-minutes one (module, pin) group of each e2e module took in CI (stop 27: two workers, two cores). Groups
# are handed out longest first, so that no long group starts last while the other worker runs out of work;
# xdist's own order (most tests first) started the late-write and soak groups last. Other tests come after the
# e2e groups, in their own order (short ones fill the end).
E2E_GROUP_MINUTES = {
    "test_guards_e2e": 6.8,
    "test_paged_profile_e2e": 6.0,
    "test_tools_e2e": 2.0,
    "test_guards_v049": 5.0,
    "test_digest_e2e": 5.0,
    "test_soak_e2e": 4.9,
    "test_patched_incident": 5.0,
    "test_digest_tp2_e2e": 4.4,
    "test_lifecycle_e2e": 4.3,
    "test_incident": 3.0,
    "test_capacity_e2e": 2.8,
    "test_mixed_pair_e2e": 3.0,
    "test_fail_closed_e2e": 2.0,
    "test_importhook_coexist_e2e": 1.5,
    "test_side_channels_e2e": 4.5,
}
UNLISTED_E2E_GROUP_MINUTES = 3.0


def _group_minutes(item: pytest.Item) -> float:
    if item.get_closest_marker("e2e") is None:
        return 0.0
    return E2E_GROUP_MINUTES.get(item.module.__name__.rpartition(".")[2], UNLISTED_E2E_GROUP_MINUTES)


def _longest_groups_first(items: list[pytest.Item], group_of: dict[int, str]) -> None:
    """Stable sort: by the group's expected minutes (descending), then where the group first appeared; the items
    of one group stay together in their order (module-scoped pairs start once)."""
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(group_of[id(item)], index)
    minutes = {group_of[id(item)]: _group_minutes(item) for item in items}
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (-minutes[group_of[id(item)]], first_seen[group_of[id(item)]], order[id(item)]))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist turns the groups into node-id suffixes
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One xdist group per (module, pin): a module's pairs for a pin are started by one worker only. Groups are
    ordered longest first (``E2E_GROUP_MINUTES``; run with ``--no-loadscope-reorder`` to keep that order)."""
    group_of: dict[int, str] = {}
    for item in items:
        pin = _item_pin(item)
        if pin is not None:
            # no '@' in the name: xdist takes what follows the node id's last '@' as the group, so a name
            # "module@pin" grouped every module's tests of one pin together (one worker ran all of a pin's e2e)
            group_of[id(item)] = f"{item.module.__name__}:{pin}"
            item.add_marker(pytest.mark.xdist_group(name=group_of[id(item)]))
        else:
            group_of[id(item)] = item.nodeid
    _longest_groups_first(items, group_of)


@pytest.fixture(scope="session")
def pins(pytestconfig: pytest.Config) -> list[str]:
    return selected_pins(pytestconfig)


def check_pin(config: pytest.Config, pin: str) -> None:
    """Skip when ``pin`` is not selected; fail (not skip) when it is selected but its venv is missing."""
    from sglang_harden.testbed.envs import EnvError, require_env

    if pin not in selected_pins(config):
        pytest.skip(f"SGLang {pin} not selected (--pins / SGLANG_HARDEN_PINS)")
    try:
        require_env(pin)
    except EnvError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def require_pin(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """``require_pin(pin)``: skip if not selected, fail with the build command if its venv is missing. Also takes
    a test case named ``<pin>/<backend>[/<profile>]`` (the pin is what comes before the first slash; a profile
    not selected skips the case)."""

    def require(case: str) -> None:
        from sglang_harden.testbed.profiles import PROFILES

        parts = case.split("/")
        if len(parts) >= 3 and parts[2] in PROFILES and parts[2] not in selected_profiles(pytestconfig):
            pytest.skip(f"testbed profile {parts[2]} not selected (--profiles / SGLANG_HARDEN_TEST_PROFILES)")
        check_pin(pytestconfig, parts[0])

    return require


def _recorded_groups() -> list[int]:
    from sglang_harden.testbed import procs

    groups = set(procs.started_groups())
    path = os.environ.get(PIDFILE_ENV)
    if path and Path(path).exists():
        for line in Path(path).read_text().splitlines():
            if line.split():
                groups.add(int(line.split()[0]))
    return sorted(groups)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    try:
        from sglang_harden.testbed import procs
    except ImportError:
        return
    alive = [g for g in _recorded_groups() if procs.group_alive(g)]
    owned = getattr(session.config, "_sglang_harden_pidfile", None)
    if owned:
        Path(owned).unlink(missing_ok=True)
    if not alive:
        return
    left = procs.kill_groups(alive, term_timeout=3.0, kill_timeout=5.0)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    msg = (
        f"sglang-harden: {len(alive)} process group(s) started by the suite were still alive at the end: "
        f"{alive} (killed now; still alive: {left})"
    )
    if reporter is not None:
        reporter.write_line(msg, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """With ``SGLANG_HARDEN_MATRIX_RESULTS`` set, a test marked ``proves`` adds its result to the matrix (a pass or
    a failure of the test itself, or a failure in its set-up; a skip says nothing)."""
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("proves")
    results = os.environ.get(MATRIX_ENV)
    if not results or marker is None or report.skipped:
        return
    if report.when != "call" and not report.failed:
        return
    case = _item_pin(item) or getattr(getattr(item, "callspec", None), "params", {}).get("case")
    if not isinstance(case, str):
        return
    # a test whose protected side depends on its case names the paths it ran (user property "proves_paths")
    paths = next((list(value) for key, value in item.user_properties if key == "proves_paths"), [marker.args[0]])
    try:  # a result that cannot be written must not end the session: the matrix then shows no result for it
        for path in dict.fromkeys(paths):
            matrix.record(Path(results), item.nodeid, case.split("/")[0], path, marker.args[1:], report.outcome)
    except (OSError, ValueError, IndexError) as exc:
        warnings.warn(f"matrix result of {item.nodeid} not recorded: {exc}", stacklevel=1)
