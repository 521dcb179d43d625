#!/usr/bin/env bash
# Render docs/diagrams/*.dot to SVG with Graphviz (apt install graphviz). Each SVG names the SHA-256 of its source,
# so tests/unit/test_diagrams.py fails when a source changed and its SVG was not rendered again.
set -euo pipefail
cd "$(dirname "$0")/../docs/diagrams"
command -v dot >/dev/null || { echo "render_diagrams: Graphviz' dot not found (apt install graphviz)" >&2; exit 1; }
for source in *.dot; do
  digest="$(sha256sum "$source" | cut -d' ' -f1)"
  dot -Tsvg "$source" | sed "0,/<svg/s//<!-- source: $source sha256:$digest -->\n<svg/" > "${source%.dot}.svg"
  echo "docs/diagrams/${source%.dot}.svg"
done
