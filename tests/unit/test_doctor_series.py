"""Doctor recognises the protections every backport series adds, on every series (pristine: not there).

On each pin's pristine tree (the files its series touches) and the same tree patched: the page-tag, canary and digest
detectors say ``yes`` patched, with decode's commit point as evidence (``_commit_transfer_to_req``, or on 0.4.x
``pop_transferred``, where that release commits inline), and not ``yes`` from the series' check on the pristine tree;
the quarantine detector says ``yes`` patched (both allocators' free paths, to 0.5.12 in one module) and ``no``
pristine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from test_patch import PINS, make_tree

from sglang_harden.tools import patch as P
from sglang_harden.tools._detectors_bootstrap import detect_bootstrap_auth, detect_zmq_auth
from sglang_harden.tools._detectors_request import detect_kv_checksum, detect_page_ownership
from sglang_harden.tools._detectors_transfer import detect_kv_canary, detect_page_quarantine
from sglang_harden.tools._source import SourceTree

MODULES = {  # the series' module -> the detector that must recognise it
    "sglang/srt/mem_cache/pd_page_tags.py": detect_page_ownership,
    "sglang/srt/disaggregation/common/pd_canary.py": detect_kv_canary,
    "sglang/srt/disaggregation/common/pd_digest.py": detect_kv_checksum,
}
# where a series checks a transfer before decode uses it: at the commit, or (0.5.19+) at the commit gate, through which
# SGLang polls every receiver
COMMIT_POINTS = ("_commit_transfer_to_req", "pop_transferred", "_poll_with_failure_injection")


def _series_detectors(pin: str) -> list[Callable[[SourceTree], object]]:
    targets = {t for patch in P.load_series(pin, P.default_patches_dir()) for t in patch.targets}
    return [detect for module, detect in MODULES.items() if module in targets]


@pytest.mark.parametrize("pin", PINS)
def test_doctor_recognises_the_series_quarantine(pin: str, tmp_path: Path) -> None:
    patched = make_tree(pin, tmp_path / "patched")
    P.apply_series(patched, pin)
    found = detect_page_quarantine(SourceTree(patched))
    assert found.status == "yes" and any("pop_transferred" in e for e in found.evidence), (pin, found)
    assert detect_page_quarantine(SourceTree(make_tree(pin, tmp_path / "pristine"))).status == "no", pin


@pytest.mark.parametrize("pin", PINS)
def test_doctor_recognises_the_series_control_plane_authentication(pin: str, tmp_path: Path) -> None:
    """Every series protects the bootstrap server once a secret file is named (opt-in); 0.4.x's server is Mooncake's."""
    patched = make_tree(pin, tmp_path / "patched")
    P.apply_series(patched, pin)
    found = detect_bootstrap_auth(SourceTree(patched))
    assert found.status == "opt-in" and "backport" in found.detail, (pin, found)
    assert detect_bootstrap_auth(SourceTree(make_tree(pin, tmp_path / "pristine"))).status == "no", pin


@pytest.mark.parametrize("pin", PINS)
def test_doctor_recognises_the_series_side_channel_authentication(pin: str, tmp_path: Path) -> None:
    """Every series has the side-channel patch (0.4.x: in Mooncake's own manager and receiver): the rank ports
    authenticate once a secret file is named (opt-in); no pristine tree does."""
    patched = make_tree(pin, tmp_path / "patched")
    P.apply_series(patched, pin)
    found = detect_zmq_auth(SourceTree(patched))
    assert any("authenticate-side-channels" in p.name for p in P.load_series(pin, P.default_patches_dir())), pin
    assert found.status == "opt-in" and "backport" in found.detail, (pin, found)
    assert [e.split(": ")[-1] for e in found.evidence] == ["pd_side_channels.guard_rank_port(...)",
                                                           "pd_side_channels.sign_socket(...)"], (pin, found)
    assert detect_zmq_auth(SourceTree(make_tree(pin, tmp_path / "pristine"))).status in ("no", "unknown"), pin


def test_every_series_carries_the_three_modules() -> None:
    assert {"0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.23"} <= set(PINS)
    for pin in PINS:
        assert len(_series_detectors(pin)) == len(MODULES), pin


@pytest.mark.parametrize("pin", PINS)
def test_doctor_recognises_the_series_protections(pin: str, tmp_path: Path) -> None:
    patched = make_tree(pin, tmp_path / "patched")
    P.apply_series(patched, pin)
    pristine = SourceTree(make_tree(pin, tmp_path / "pristine"))
    for detect in _series_detectors(pin):
        found = detect(SourceTree(patched))
        assert found.status == "yes", (pin, detect.__name__, found)
        assert any(point in found.evidence[0] for point in COMMIT_POINTS), (pin, detect.__name__, found)
        before = detect(pristine)
        assert not (before.status == "yes" and "backport" in before.detail), (pin, detect.__name__, before)
        assert not any("pop_transferred line" in e or "_commit_transfer_to_req line" in e
                       for e in before.evidence), (pin, detect.__name__, before)


def test_a_digest_prefill_never_publishes_is_partial(tmp_path: Path) -> None:
    """0.5.19's prefill hashes request ids with hashlib (``.digest()``): that is no published KV digest."""
    tree = make_tree("0.5.19", tmp_path / "patched")
    P.apply_series(tree, "0.5.19")
    prefill = tree / "sglang/srt/disaggregation/prefill.py"
    text = prefill.read_text()
    assert ".digest()" in text and "pd_digest.publish_before_final_send(" in text
    prefill.write_text(text.replace("pd_digest.publish_before_final_send(", "print("))
    found = detect_kv_checksum(SourceTree(tree))
    assert found.status == "partial" and "prefill publishes none" in found.detail, found
