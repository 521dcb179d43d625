#!/usr/bin/env bash
# Fuzz the PD ZMQ side channels harder than CI does (CI: 1,000 cases per message type): every message type of
# every backend (Mooncake, NIXL, MORI) and role, through the hardened receive (auth frame + wire rules) into the
# pin's real listener thread, and the same messages into a vanilla listener (tests/integration/
# test_wire_fuzz_inprocess.py).
#   scripts/fuzz_side_channels.sh [--examples N] [--seed S] [PIN...]    e.g. scripts/fuzz_side_channels.sh --examples 20000 0.5.23
# Default: 10,000 cases per type on every CI pin; --seed makes a run repeatable (default: Hypothesis' random seed).
# Exit status: pytest's (0: no hardened listener raised, no invariant broke, every vanilla kill expected was seen).
set -euo pipefail
cd "$(dirname "$0")/.."
examples=10000
seed=()
pins=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --examples) examples="$2"; shift 2 ;;
    --examples=*) examples="${1#*=}"; shift ;;
    --seed) seed=(--hypothesis-seed="$2"); shift 2 ;;
    --seed=*) seed=(--hypothesis-seed="${1#*=}"); shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) pins+=("$1"); shift ;;
  esac
done
if [ "${#pins[@]}" -eq 0 ]; then
  read -r -a pins <<< "$(python3 -c 'from sglang_harden.testbed.envs import ci_pins; print(" ".join(ci_pins()))')"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES="$examples"
for pin in "${pins[@]}"; do
  echo "== side-channel fuzz: SGLang $pin, $examples cases per message type"
  python3 -m sglang_harden.cli testbed python --pin "$pin" -- -m pytest -q -s -p no:cacheprovider -p no:logging \
    "${seed[@]}" tests/integration/test_wire_fuzz_inprocess.py
done
