#!/usr/bin/env bash
# Build (or reuse) one virtual environment per SGLang pin: scripts/setup_envs.sh [PIN...|--ci|--all] [--force]
# Venvs live in ${SGLANG_HARDEN_HOME:-$HOME/.cache/sglang-harden}/venvs/<pin>; see ci/pins.toml for the recipes.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v uv >/dev/null 2>&1 || python3 -m pip install -q uv
exec python3 -c "import sys; from sglang_harden.testbed.envs import main; sys.exit(main())" "$@"
