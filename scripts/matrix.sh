#!/usr/bin/env bash
# Nightly-style: run the end-to-end tests of the pins whose matrix results are stale (not only the CI pins) and
# rebuild docs/matrix.md and README's matrix (the guard x pin x path matrix) from the results.
#   scripts/matrix.sh                       every pin of ci/pins.toml with a result that did not run today's code,
#                                           or none (builds missing pin venvs first)
#   SGLANG_HARDEN_PINS=all scripts/matrix.sh      every pin
#   SGLANG_HARDEN_PINS=0.5.22 scripts/matrix.sh   only these pins (the other pins' results are kept)
# Results: one JSON line per test of a module with a `proves` test and pin, stamped with the hash of the code it ran,
# in docs/e2e-results/<pin>.jsonl (or $SGLANG_HARDEN_MATRIX_RESULTS); the matrix is `sglang-harden doctor --matrix
# --results DIR`.
# Exit status: the tests' (the matrix is rebuilt either way, failures show as FAILED).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_HARDEN_FULL_RUN=1  # the e2e cases CI leaves out (ci/pins.toml [ci].full_run_only) run here
pins="${SGLANG_HARDEN_PINS:-stale}"
results="${SGLANG_HARDEN_MATRIX_RESULTS:-docs/e2e-results}"
if [ "$pins" = "all" ]; then
  pins="$(python3 -c 'from sglang_harden.testbed.envs import all_pins; print(",".join(all_pins()))')"
elif [ "$pins" = "stale" ]; then
  pins="$(python3 -c 'import sys; from pathlib import Path; from sglang_harden.testbed.envs import all_pins
from sglang_harden.tools import matrix; print(",".join(matrix.stale_pins(Path(sys.argv[1]), all_pins())))' "$results")"
  [ -n "$pins" ] || { echo "every pin's results ran today's code: nothing to run"; exit 0; }
fi
mkdir -p "$results"
for pin in ${pins//,/ }; do rm -f "$results/$pin.jsonl"; done
# shellcheck disable=SC2086
bash scripts/setup_envs.sh ${pins//,/ }
status=0
SGLANG_HARDEN_MATRIX_RESULTS="$results" python3 -m pytest -ra -p no:cacheprovider -m e2e tests/e2e \
  -n "${SGLANG_HARDEN_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --pins "$pins" || status=$?
python3 -c 'import sys; from pathlib import Path; from sglang_harden.tools import matrix
matrix.write_docs(Path(sys.argv[1]), Path.cwd())' "$results"
echo "docs/matrix.md and README's matrix rebuilt from $results"
exit "$status"
