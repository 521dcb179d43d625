#!/usr/bin/env bash
# Build (or reuse) the Python 3.10 environment that scripts/run_tests.sh runs the tests without servers under
# (SGLang <= 0.5.19 images run 3.10); prints its python. ${SGLANG_HARDEN_HOME:-$HOME/.cache/sglang-harden}/venvs/py310-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
home="${SGLANG_HARDEN_HOME:-$HOME/.cache/sglang-harden}"
venv="$home/venvs/py310-tools"
# pytest-xdist 3.8+: --no-loadscope-reorder (the suite orders its e2e groups longest first, tests/conftest.py)
packages=('pytest>=8' 'hypothesis>=6' 'pytest-xdist>=3.8' numpy cryptography requests 'tomli>=1.1' pyyaml)
stamp="$venv/.sglang-harden-py310-recipe"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${packages[*]}" ]; then
  echo "$venv/bin/python"; exit 0
fi
interpreter=""
for candidate in "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.10*/bin/python3.10 /usr/bin/python3.10; do
  [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null \
    && interpreter="$candidate"
done
if [ -z "$interpreter" ]; then  # none on the machine: uv's own build of CPython 3.10
  uv python install -q 3.10 >&2
  interpreter="$(uv python find --python-preference only-managed 3.10)"
fi
rm -rf "$venv"
uv venv -q --python "$interpreter" "$venv" >&2
uv pip install -q --python "$venv/bin/python" "${packages[@]}" >&2
echo "${packages[*]}" > "$stamp"
echo "$venv/bin/python"
