#!/usr/bin/env bash
# Nightly-style: run the end-to-end tests of every supported pin (not only the CI pins) and rebuild docs/matrix.md
# and README's matrix (the guard x pin x path matrix) from what passed.
#   scripts/matrix.sh                       every pin of ci/pins.toml (builds missing pin venvs first)
#   SGLANG_HARDEN_PINS=0.5.22 scripts/matrix.sh   only these pins (the other pins' results are kept)
# Results: one JSON line per test marked `proves` and pin, in docs/e2e-results/<pin>.jsonl (or
# $SGLANG_HARDEN_MATRIX_RESULTS); the matrix is `sglang-harden doctor --matrix --results DIR`.
# Exit status: the tests' (the matrix is rebuilt either way, failures show as FAILED).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
pins="${SGLANG_HARDEN_PINS:-all}"
if [ "$pins" = "all" ]; then
  pins="$(python3 -c 'from sglang_harden.testbed.envs import all_pins; print(",".join(all_pins()))')"
fi
results="${SGLANG_HARDEN_MATRIX_RESULTS:-docs/e2e-results}"
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
