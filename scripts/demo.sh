#!/usr/bin/env bash
# Set up the CI pins' environments (reused between runs) and run `sglang-harden demo` on the embedded tiny model.
#   scripts/demo.sh [demo args...]     e.g. scripts/demo.sh --pin 0.5.19 --json
# SGLANG_HARDEN_PINS chooses which pins' environments are built (default: ci/pins.toml [ci].pins).
set -euo pipefail
cd "$(dirname "$0")/.."
pins="${SGLANG_HARDEN_PINS:---ci}"
pins="${pins//,/ }"
[[ "$pins" == "all" ]] && pins="--all"
# shellcheck disable=SC2086
bash scripts/setup_envs.sh $pins
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m sglang_harden demo "$@"
