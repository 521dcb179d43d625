#!/usr/bin/env bash
# Fuzz the authenticated PD control plane harder than CI does (CI: 1,000 cases per route), on SGLang's real
# bootstrap server in one process (tests/integration/test_control_auth_inprocess.py), and the patch series'
# bootstrap server (tests/integration/test_patched_auth_inprocess.py: a fifth of the count per route, unsigned).
#   scripts/fuzz_control_plane.sh [EXAMPLES_PER_ROUTE] [PIN...]    e.g. scripts/fuzz_control_plane.sh 20000 0.5.23
# Default: 10,000 cases per route on every CI pin. Exit status: pytest's (0: every case got the answer it must).
set -euo pipefail
cd "$(dirname "$0")/.."
examples="${1:-10000}"
shift || true
pins=("$@")
if [ "${#pins[@]}" -eq 0 ]; then
  read -r -a pins <<< "$(python3 -c 'from sglang_harden.testbed.envs import ci_pins; print(" ".join(ci_pins()))')"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_HARDEN_FUZZ_EXAMPLES="$examples"
for pin in "${pins[@]}"; do
  echo "== control-plane fuzz: SGLang $pin, $examples cases per route"
  python3 -m sglang_harden.cli testbed python --pin "$pin" -- -m pytest -q -p no:cacheprovider \
    tests/integration/test_control_auth_inprocess.py tests/integration/test_patched_auth_inprocess.py -k fuzz
done
