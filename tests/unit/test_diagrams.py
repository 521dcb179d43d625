"""The diagrams in docs/diagrams/ are rendered from their committed sources (``scripts/render_diagrams.sh`` writes
each source's SHA-256 into its SVG), and every guard the handoff diagram should place is on it."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from sglang_harden.config import GUARDS

DIAGRAMS = Path(__file__).resolve().parents[2] / "docs" / "diagrams"


def test_every_svg_is_rendered_from_its_current_source() -> None:
    sources = sorted(DIAGRAMS.glob("*.dot"))
    assert {path.stem for path in sources} == {"pd-handoff", "page-lifecycle"}
    for source in sources:
        svg = source.with_suffix(".svg")
        assert svg.exists(), f"{svg.name} missing: run scripts/render_diagrams.sh"
        stamped = re.search(r"<!-- source: (\S+) sha256:([0-9a-f]{64}) -->", svg.read_text())
        assert stamped and stamped.group(1) == source.name, f"{svg.name} has no source stamp"
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        assert stamped.group(2) == digest, f"{source.name} changed since {svg.name} was rendered (render_diagrams.sh)"


def test_the_handoff_diagram_places_every_guard() -> None:
    text = (DIAGRAMS / "pd-handoff.dot").read_text()
    placed = set(re.findall(r"<b>([a-z_]+)</b>", text))
    assert set(GUARDS) <= placed, sorted(set(GUARDS) - placed)
