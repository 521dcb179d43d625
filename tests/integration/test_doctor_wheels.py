"""doctor on the real SGLang releases, row by row against ../shared/notes/upstream.md.

Trees come from, in order: the pin's venv (``$SGLANG_HARDEN_HOME/venvs/<pin>``), an unpacked wheel cached
under ``$SGLANG_HARDEN_HOME/wheel-src/<pin>``, or ``pip download --no-deps sglang==<pin>`` (PyPI) unpacked
there. No import of SGLang happens: doctor reads the code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sglang_harden.compat import SUPPORTED_PINS
from sglang_harden.tools import _protections as P
from sglang_harden.tools._source import SourceTree
from sglang_harden.tools._wheels import ReleaseUnavailable, release_tree

# status per protection, from upstream.md's table (and the "still open in 0.5.23" list for the last three)
EXPECTED: dict[str, dict[str, str]] = {
    "0.5.19": {
        "door_rejection": P.NO,
        "abort_retirement": P.NO,
        "coverage_check": P.NO,
        "kv_checksum": P.NO,
        "page_ownership": P.NO,
        "page_quarantine": P.NO,
        "deferred_release": P.OPT_IN,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.PARTIAL,
        "transfer_batch_bound": P.NO,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
        "zmq_auth": P.NO,
    },
    "0.5.20": {
        "door_rejection": P.NO,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.NO,
        "page_ownership": P.NO,
        "page_quarantine": P.NO,
        "deferred_release": P.OPT_IN,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.PARTIAL,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
        "zmq_auth": P.NO,
    },
    "0.5.21": {
        "door_rejection": P.YES,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.OPT_IN,
        "page_ownership": P.NO,
        "page_quarantine": P.NO,
        "deferred_release": P.YES,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.YES,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
        "zmq_auth": P.NO,
    },
    "0.5.23": {
        "door_rejection": P.YES,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.OPT_IN,
        "page_ownership": P.NO,
        "page_quarantine": P.NO,
        "deferred_release": P.YES,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.YES,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
        "zmq_auth": P.NO,
    },
}
DETAILS = {
    ("0.5.19", "abort_ack"): "clear() drops the ack target",
    ("0.5.20", "abort_ack"): "clear() drops the ack target",
    ("0.5.21", "deferred_release"): "mooncake, nixl",
    ("0.5.23", "deferred_release"): "mooncake, nixl, mori",
    ("0.5.23", "abort_ack"): "generation-tagged",
}


def sglang_tree(pin: str) -> Path:
    try:
        return release_tree(pin)
    except ReleaseUnavailable as exc:
        pytest.skip(f"sglang=={pin} not available here (no venv, no cache, download failed): {exc}")


@pytest.mark.parametrize("pin", sorted(EXPECTED))
def test_doctor_row_by_row(pin: str) -> None:
    tree = SourceTree(sglang_tree(pin))
    assert tree.version() == pin
    natives = P.inspect_tree(tree)
    got = {key: native.status for key, native in natives.items()}
    assert got == EXPECTED[pin]
    for (detail_pin, key), text in DETAILS.items():
        if detail_pin == pin:
            assert text in natives[key].detail, natives[key]


def test_patched_0519_door_is_recognised(tmp_path: Path) -> None:
    """A backport is judged by its code: add the prefill-door check to 0.5.19's own source."""
    src = SourceTree(sglang_tree("0.5.19")).root / "sglang"
    for rel in ("_version.py", "srt/managers/schedule_batch.py", "srt/disaggregation"):
        target = tmp_path / "sglang" / rel
        if (src / rel).is_dir():
            shutil.copytree(src / rel, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / rel, target)
    prefill = tmp_path / "sglang" / "srt" / "disaggregation" / "prefill.py"
    text = prefill.read_text()
    anchor = "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
    assert anchor in text
    prefill.write_text(text.replace(anchor, anchor + "        if is_aborted(req):\n            return\n", 1))
    door = P.detect_door_rejection(SourceTree(tmp_path))
    assert door.status == P.PARTIAL and door.detail.startswith("decode"), door


# The releases that have each optional (feature-probed) hook target, read from their code once by hand; the sweep
# must find exactly these, so a target renamed in a release (its hook then silently absent) fails here.
OPTIONAL_TARGETS = {
    "abort_notify: sglang.srt.disaggregation.prefill."
    "SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result": ("0.5.20", "0.5.21", "0.5.22", "0.5.23"),
    "lifecycle: sglang.srt.disaggregation.common.conn.CommonKVManager.poison_deferred_ack_room": ("0.5.22", "0.5.23"),
    "lifecycle: sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.sync_status_to_decode_endpoint":
        ("0.5.19",),
    "lifecycle: sglang.srt.mem_cache.radix_cache.RadixCache.cache_unfinished_req": ("0.5.19", "0.5.20", "0.5.21"),
    "lifecycle: sglang.srt.mem_cache.radix_cache.RadixCache.checkpoint": ("0.5.22", "0.5.23"),
    "lifecycle: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.cache_unfinished_req":
        ("0.5.19", "0.5.20", "0.5.21"),
    "lifecycle: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint": ("0.5.22", "0.5.23"),
    "page_ledger: sglang.srt.mem_cache.radix_cache.RadixCache.cache_unfinished_req": ("0.5.19", "0.5.20", "0.5.21"),
    "page_ledger: sglang.srt.mem_cache.radix_cache.RadixCache.checkpoint": ("0.5.22", "0.5.23"),
    "page_ledger: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.cache_unfinished_req":
        ("0.5.19", "0.5.20", "0.5.21"),
    "page_ledger: sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint": ("0.5.22", "0.5.23"),
    "zmq_auth: sglang.srt.disaggregation.pp_consensus_store.PPConsensusStore._init_zmq": ("0.5.22", "0.5.23"),
    "side_channels: sglang.srt.disaggregation.common.conn.CommonKVManager._make_worker_recv":
        ("0.5.21", "0.5.22", "0.5.23"),
    "zmq_auth: sglang.srt.disaggregation.common.conn.CommonKVManager._make_worker_recv": ("0.5.21", "0.5.22", "0.5.23"),
    "zmq_auth: sglang.srt.disaggregation.common.staging_handler.prefetch_staging_reqs":
        ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"),
}


@pytest.mark.parametrize("pin", sorted(SUPPORTED_PINS))
def test_compat_sweep_agrees_with_the_supported_pins(pin: str) -> None:
    """`compat sweep` reads each supported release and finds the adapter the plugin uses for it, every required hook
    of that adapter in place, and each optional target in exactly the releases known to have it."""
    from sglang_harden.compat.hooks import PAGE_LEDGER_OWNER
    from sglang_harden.tools import compat_sweep as sweep

    report = sweep.judge_release(pin, SourceTree(sglang_tree(pin)), SUPPORTED_PINS)
    assert report.adapter == SUPPORTED_PINS[pin], report
    family_owners = {h.owner for h in sweep.family_hooks(SUPPORTED_PINS[pin])[0]} - {PAGE_LEDGER_OWNER}
    assert {g for g, v in report.guards.items() if v.verdict == sweep.HOOKABLE} == family_owners, report
    if SUPPORTED_PINS[pin] == "sglang_v05":
        assert set(report.optional) == set(OPTIONAL_TARGETS)
        assert report.optional == {target: pin in releases for target, releases in OPTIONAL_TARGETS.items()}


@pytest.mark.parametrize("pin", sorted(SUPPORTED_PINS))
def test_the_support_matrix_is_generated_not_written(pin: str) -> None:
    """docs/support.md's row for each supported pin is what `compat sweep` says today (regenerate it with
    `sglang-harden compat sweep --markdown` after a change to the hook tables)."""
    from sglang_harden.tools import compat_sweep as sweep

    report = sweep.judge_release(pin, SourceTree(sglang_tree(pin)), SUPPORTED_PINS)
    matrix = (Path(__file__).resolve().parents[2] / "docs" / "support.md").read_text()
    assert sweep.markdown_row(report) in matrix.splitlines()


# The releases whose abort-notice handler (per backend) drops the ack target of a concluded room with a chunk in
# flight, read from their code by hand and confirmed in process (test_lifecycle_inprocess) and end to end.
DROPS_ACK_RELEASES = {"mooncake": ("0.5.19", "0.5.20"), "nixl": ("0.5.19", "0.5.20", "0.5.21"), "mori": ()}


@pytest.mark.parametrize("pin", sorted(EXPECTED))
def test_the_matrix_upstream_cells_match_the_code(pin: str) -> None:
    """The matrix says a patched tree needs no patch for a guard upstream has itself from a release on: the
    detectors read the same from each pin's code."""
    from sglang_harden.tools import matrix

    natives = P.inspect_tree(SourceTree(sglang_tree(pin)))
    for guard, (key, _first) in matrix.UPSTREAM.items():
        assert (natives[key].status == P.YES) == matrix.upstream_has(pin, guard), (pin, guard)


@pytest.mark.parametrize("pin", [*sorted(SUPPORTED_PINS), "0.4.10.post1"])
def test_the_plugin_chooses_its_adapter_by_the_release_code(pin: str) -> None:
    """The family an unknown release gets under the override is the one whose hooks resolve on its code: each
    supported pin's own, and the 0.4.9 one for 0.4.10.post1 (the nearest version string would say 0.5)."""
    from sglang_harden.tools.compat_sweep import choose_family

    fitting, family, missing = choose_family(SourceTree(sglang_tree(pin)))
    assert fitting == family == SUPPORTED_PINS.get(pin, "sglang_v049") and missing == []


@pytest.mark.parametrize("pin", sorted(p for p, adapter in SUPPORTED_PINS.items() if adapter == "sglang_v05"))
def test_dropped_ack_probe_matches_each_release(pin: str) -> None:
    """The guard's probe for the branch that answers a decode abort notice for a concluded room with an ack only when
    nothing of it is counted in flight (and otherwise with neither an ack nor a kept target) finds it in exactly the
    releases known to have it."""
    from sglang_harden.compat.backends import BACKEND_MODULES
    from sglang_harden.compat.backends.common import DROPPING_BRANCH

    tree = SourceTree(sglang_tree(pin))
    for backend, module in BACKEND_MODULES.items():
        drops = DROPPING_BRANCH in tree.text(module)
        assert drops == (pin in DROPS_ACK_RELEASES[backend]), (pin, backend, drops)


@pytest.mark.parametrize("pin", ["0.5.5", "0.5.18"])
def test_the_049_adapter_is_never_chosen_where_sglang_records_aborts_in_to_finish(pin: str) -> None:
    """Its hooks all resolve on 0.5.5-0.5.18, but it was written for releases that record a pending abort in
    ``finished_reason``: on 0.5.18 its coverage read 0 tokens for every transfer and its abort path called a moved
    method (measured with tests/e2e/test_guards_v049.py). The sweep must not offer it there, nor the override take
    it; the release gets the family with the fewest gaps and no fitting one."""
    from sglang_harden.tools.compat_sweep import V049_MISMATCH, choose_family, judge_family

    tree = SourceTree(sglang_tree(pin))
    verdicts, _ = judge_family(tree, "sglang_v049")
    assert verdicts and all(v.missing == [V049_MISMATCH] for v in verdicts.values()), verdicts
    fitting, _family, missing = choose_family(tree)
    assert fitting is None and missing
