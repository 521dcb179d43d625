#!/usr/bin/env bash
# Set up the CI pins' environments (reused between runs) and run the whole test suite.
#   scripts/run_tests.sh [pytest args...]     e.g. scripts/run_tests.sh -m "not e2e"
# The suite runs under the system python3 (pytest, hypothesis, pytest-xdist, PyYAML); e2e tests start servers with
# the pin venvs' pythons. SGLANG_HARDEN_TEST_WORKERS (default 2) sets the pytest-xdist workers.
# SGLANG_HARDEN_PINS (or pytest's --pins) chooses the pins; default: ci/pins.toml [ci].pins.
set -euo pipefail
cd "$(dirname "$0")/.."
# pytest-xdist 3.8+: --no-loadscope-reorder (the suite orders its e2e groups longest first, tests/conftest.py)
python3 -c 'import pytest, hypothesis, xdist, yaml, sys; sys.exit(tuple(map(int, xdist.__version__.split(".")[:2])) < (3, 8))' \
  2>/dev/null || python3 -m pip install -q 'pytest>=8' 'hypothesis>=6' 'pytest-xdist>=3.8' pyyaml
pins="${SGLANG_HARDEN_PINS:---ci}"
pins="${pins//,/ }"
[[ "$pins" == "all" ]] && pins="--all"
# shellcheck disable=SC2086
bash scripts/setup_envs.sh $pins
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# promtool for the alert rules' tests (tests/unit/test_alert_rules.py; without it they skip, saying so)
if promtool_dir="$(bash scripts/fetch_promtool.sh)"; then export PATH="$promtool_dir:$PATH"; fi
# The KV digest/canary tests need torch, the in-process lifecycle tests need SGLang itself: run them with
# each CI pin's venv python (CPU torch, testbed shims), then the whole suite with the system python (where
# they skip, saying so).
# The pins and the torch tests run side by side (each pin mostly one busy thread: SGLang's bootstrap server and
# the fuzzing client).
phase() { echo "[run_tests] $(date -u +%H:%M:%S) $*"; }
in_process_tests=(tests/integration/test_lifecycle_inprocess.py tests/integration/test_mori_inprocess.py
  tests/integration/test_digest_inprocess.py tests/integration/test_gpu_semantics_inprocess.py
  tests/integration/test_control_auth_inprocess.py tests/integration/test_drain_acks_inprocess.py
  tests/unit/test_patched_side_channels.py tests/integration/test_zmq_channels_inprocess.py
  tests/integration/test_wire_fuzz_inprocess.py tests/integration/test_pp_consensus_inprocess.py
  tests/integration/test_model_shapes_inprocess.py)
patched_auth_tests=(tests/integration/test_patched_auth_inprocess.py)
torch_tests=(tests/unit/test_digest*.py tests/unit/test_checksum.py tests/unit/test_events_prometheus.py
  tests/unit/test_cudasim.py tests/unit/test_canary.py tests/unit/test_patched_canary.py
  tests/unit/test_patched_lifecycle.py tests/unit/test_patched_lifecycle_04x.py tests/unit/test_patched_drain_acks.py
  tests/unit/test_patched_digest.py tests/integration/test_digest_agreement.py tests/unit/test_kvtrace_owners.py
  tests/unit/test_alert_rules.py)
phase "in-process tests (each CI pin's venv) and torch tests, side by side"
logs="$(mktemp -d)"
pids=()
ci_pins="$(python3 -c 'from sglang_harden.testbed.envs import ci_pins; print(" ".join(ci_pins()))')"
newest="${ci_pins##* }"
for pin in $ci_pins; do
  # the patch series' bootstrap server: on the newest CI pin (the 0.5.19 series is authenticated end to end in
  # tests/e2e/test_patched_incident.py, and its pd_auth module is the same file on every 0.5.x series)
  patched=()
  [ "$pin" = "$newest" ] && patched=("${patched_auth_tests[@]}")
  python3 -m sglang_harden.cli testbed python --pin "$pin" -- -m pytest -ra -p no:cacheprovider \
    "${in_process_tests[@]}" "${patched[@]}" > "$logs/in-process tests, pin $pin.log" 2>&1 &
  pids+=("$!")
done
# the torch tests wait mostly on their own subprocesses and gloo timeouts (about a quarter of a core)
torch_py="$(python3 -c 'from sglang_harden.testbed.envs import ci_pins, venv_python; print(venv_python(ci_pins()[-1]))')"
"$torch_py" -m pytest -ra -p no:cacheprovider "${torch_tests[@]}" > "$logs/torch tests.log" 2>&1 &
pids+=("$!")
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
for log in "$logs"/*.log; do echo "== $(basename "$log" .log)"; cat "$log"; done
rm -rf "$logs"
[ "$failed" = 0 ] || { echo "in-process or torch tests failed" >&2; exit 1; }
# Two workers: the e2e tests spend most of their time waiting on servers (start-up, timeouts); each worker
# runs whole (module, pin) groups, so a module's pairs for one pin start once (tests/conftest.py).
# --no-loadscope-reorder: keep the order tests/conftest.py gives (longest e2e groups first; xdist's own order, most
# tests first, started the long late-write and soak groups last).
workers="${SGLANG_HARDEN_TEST_WORKERS:-2}"
# the files above already ran under a venv with their dependencies: here they would only skip on imports
ignore=()
for test in "${in_process_tests[@]}" "${patched_auth_tests[@]}" "${torch_tests[@]}"; do ignore+=("--ignore=$test"); done
suite=(-ra -n "$workers" --dist loadgroup --no-loadscope-reorder "${ignore[@]}")
if [ "$#" -gt 0 ]; then
  phase "the tests asked for, $workers workers"
  exec python3 -m pytest --durations=60 "${suite[@]}" "$@"
fi
# The whole suite: the tests that start no server under Python 3.10 (the oldest Python the plugin supports, which
# images of SGLang <= 0.5.19 run; scripts/py310_env.sh), the e2e tests under the system python3 (their servers run
# in the pin venvs either way).
phase "tests without servers, Python 3.10, $workers workers"
py310="$(bash scripts/py310_env.sh)"
failed=0
"$py310" -m pytest --durations=20 -m "not e2e" "${suite[@]}" || failed=1
phase "e2e tests, $workers workers"
python3 -m pytest --durations=60 -m e2e "${suite[@]}" || failed=1
exit "$failed"
