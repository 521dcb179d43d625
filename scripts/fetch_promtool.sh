#!/usr/bin/env bash
# Print the folder holding `promtool` (Prometheus' rule checker), fetching it first where it is missing:
# Debian's `prometheus` package is downloaded and unpacked into $SGLANG_HARDEN_HOME/tools/prometheus, not
# installed (no service is started, no user added, nothing outside that folder changes).
#   export PATH="$(bash scripts/fetch_promtool.sh):$PATH"
set -euo pipefail
if found="$(command -v promtool 2>/dev/null)"; then dirname "$found"; exit 0; fi
dest="${SGLANG_HARDEN_HOME:-$HOME/.cache/sglang-harden}/tools/prometheus"
if [ ! -x "$dest/usr/bin/promtool" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && { apt-get download -qq prometheus 2>/dev/null \
     || { [ "$(id -u)" = 0 ] && apt-get update -qq && apt-get download -qq prometheus; }; }) >&2
  mkdir -p "$dest"
  dpkg-deb -x "$work"/prometheus_*.deb "$dest"
fi
"$dest/usr/bin/promtool" --version >&2
echo "$dest/usr/bin"
