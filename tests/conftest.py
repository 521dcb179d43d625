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
- With ``SGLANG_HARDEN_STRICT_SKIPS=1`` (``.ci/run`` sets it), a skip caused by something the machine could have
  installed (a module, a tool, a download, a pin venv: :data:`INSTALL_CAUSED`) FAILS instead: CI installs what the
  suite needs, so such a skip means a test that never ran.
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_harden.tools import matrix
from sglang_harden.tools.matrix import ENV as MATRIX_ENV

PIDFILE_ENV = "SGLANG_HARDEN_TESTBED_PIDFILE"
STRICT_SKIPS_ENV = "SGLANG_HARDEN_STRICT_SKIPS"
INSTALL_CAUSED = re.compile(r"could not import|no module named|not installed|download failed|not available here|"
                            r"no pin venv|no source for|unavailable|no pip here", re.IGNORECASE)


def install_caused(reason: str) -> bool:
    """A skip reason that says something was not installed, downloaded or built (what CI must provide)."""
    return INSTALL_CAUSED.search(reason) is not None


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


# Worker-minutes one (module, pin) group of each e2e module took (2026-12-07, the larger CI pin's; two workers, two
# cores, tests/conftest.py's order). Groups are handed out longest first, so that no long group starts last while
# the other worker runs out of work; xdist's own order (most tests first) started the late-write and soak groups
# last. Other tests come after the e2e groups, in their own order (short ones fill the end).
E2E_GROUP_MINUTES = {
    "test_patched_incident": 8.7,
    "test_guards_e2e": 7.0,
    "test_digest_tp2_e2e": 5.6,
    "test_paged_profile_e2e": 4.4,
    "test_soak_e2e": 4.2,
    "test_side_channels_e2e": 4.2,
    "test_lifecycle_e2e": 4.0,
    "test_capacity_e2e": 4.0,
    "test_model_shapes_e2e": 3.4,
    "test_mla_late_write_e2e": 3.7,
    "test_swa_shape_e2e": 1.5,
    "test_mixed_pair_e2e": 2.7,
    "test_fail_closed_e2e": 2.3,
    "test_pool_limit_e2e": 2.2,
    "test_importhook_coexist_e2e": 2.0,
    "test_patched_lifecycle_e2e": 1.9,
    "test_gpu_semantics_e2e": 1.8,
    "test_tools_e2e": 0.9,
    "test_images_e2e": 2.5,
    "test_digest_e2e": 5.0,
    "test_incident": 3.0,
    "test_guards_v049": 5.0,
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
    ordered longest first (``E2E_GROUP_MINUTES``; run with ``--no-loadscope-reorder`` to keep that order).
    Every ``proves`` mark names its negative control (:func:`proof_without_control`)."""
    unproven = [problem for item in items if (problem := proof_without_control(item)) is not None]
    if unproven:
        raise pytest.UsageError("a proves test without a negative control:\n  " + "\n  ".join(unproven))
    _leave_to_the_full_run(items)
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


FULL_RUN_ENV = "SGLANG_HARDEN_FULL_RUN"


def _leave_to_the_full_run(items: list[pytest.Item]) -> None:
    """Skip the e2e cases of ``[ci].full_run_only`` (``<module file>::<case>``) unless ``$SGLANG_HARDEN_FULL_RUN``
    is 1 (``scripts/matrix.sh`` sets it): CI's time limit, each such case covered in CI by another."""
    from sglang_harden.testbed.envs import full_run_only

    if os.environ.get(FULL_RUN_ENV) == "1":
        return
    cases = set(full_run_only())
    for item in items:
        pin = _item_pin(item)
        if pin is not None and f"{Path(str(item.fspath)).name}::{pin}" in cases:
            item.add_marker(pytest.mark.skip(reason=f"left to the full run ({FULL_RUN_ENV}=1, scripts/matrix.sh): "
                                                    "ci/pins.toml [ci].full_run_only"))


def proof_without_control(item: pytest.Item) -> str | None:
    """A ``proves`` mark must say where the same scenario runs without the guard and shows the harm:
    ``control="self"`` (this test runs the vanilla or guard-off side too and asserts the harm happened there),
    ``control="<test name>"``, a test of the same module, or ``control="<module path>::<test name>"``, one of another
    module run on the same pins; the control must not be a proof itself (the matrix counts the proof only where
    the control passed on the same pin, and marks it FAILED where the control failed). The problem, or None."""
    marker = item.get_closest_marker("proves")
    if marker is None:
        return None
    control = marker.kwargs.get("control")
    if control == "self":
        return None
    if not isinstance(control, str) or not control:
        return f"{item.nodeid}: proves(...) has no control= ('self', or the control test's name)"
    module, _, name = control.rpartition("::")
    source = item.config.rootpath / module if module else Path(str(item.fspath))
    found = _test_marks(source).get(name) if source.is_file() and name.startswith("test_") else None
    if found is None:
        return f"{item.nodeid}: control={control!r} is not a test of {module or item.module.__name__}"
    if "proves" in found:
        return f"{item.nodeid}: control={control!r} is itself a proves test"
    return None


def _test_marks(source: Path) -> dict[str, set[str]]:
    """The test functions of a module and the names of their ``pytest.mark`` decorators."""
    import ast

    found: dict[str, set[str]] = {}
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
            found[node.name] = {d.attr for d in decorators if isinstance(d, ast.Attribute)}
    return found


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
    """With ``SGLANG_HARDEN_MATRIX_RESULTS`` set, every test of a module with a test marked ``proves`` adds its
    result to the matrix (a pass or a failure of the test itself, or a failure in its set-up; a skip says nothing),
    stamped with the hash of the code it ran; a test not marked ``proves`` there is a control of the module's
    proofs."""
    outcome = yield
    report = outcome.get_result()
    _fail_if_install_caused(report)
    results = os.environ.get(MATRIX_ENV)
    if not results or report.skipped or not _module_proves(item):
        return
    if report.when != "call" and not report.failed:
        return
    case = _item_pin(item) or getattr(getattr(item, "callspec", None), "params", {}).get("case")
    if not isinstance(case, str):
        return
    pin = case.split("/")[0]
    marker = item.get_closest_marker("proves")
    # a test whose protected side depends on its case names the paths it ran (user property "proves_paths")
    paths = [matrix.CONTROL] if marker is None else next(
        (list(value) for key, value in item.user_properties if key == "proves_paths"), [marker.args[0]])
    guards = () if marker is None else marker.args[1:]
    control = "" if marker is None else str(marker.kwargs.get("control", ""))
    try:  # a result that cannot be written must not end the session: the matrix then shows no result for it
        code = matrix.code_hash(pin, matrix.module_of(item.nodeid), item.config.rootpath)
        for path in dict.fromkeys(paths):
            matrix.record(Path(results), item.nodeid, pin, path, guards, report.outcome, code, control=control)
    except (OSError, ValueError, IndexError) as exc:
        warnings.warn(f"matrix result of {item.nodeid} not recorded: {exc}", stacklevel=1)


def _module_proves(item: pytest.Item) -> bool:
    """The item's module has a test marked ``proves`` (read from its source: a ``-k`` run may select none)."""
    cache: dict[str, bool] = item.config.__dict__.setdefault("_sglang_harden_proving_modules", {})
    module = str(item.fspath)
    if module not in cache:
        cache[module] = any("proves" in marks for marks in _test_marks(Path(module)).values())
    return cache[module]


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped at collection (``importorskip``) falls under the same rule as a skipped test."""
    outcome = yield
    _fail_if_install_caused(outcome.get_result())


def _fail_if_install_caused(report: pytest.TestReport | pytest.CollectReport) -> None:
    """With ``SGLANG_HARDEN_STRICT_SKIPS=1``, an install-caused skip becomes a failure that says so."""
    if not report.skipped or os.environ.get(STRICT_SKIPS_ENV) != "1" or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if install_caused(reason):
        report.outcome = "failed"
        report.longrepr = f"install-caused skip under {STRICT_SKIPS_ENV}=1 (CI must provide it): {reason}"
