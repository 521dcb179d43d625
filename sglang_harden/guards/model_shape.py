"""Model-shape gate: a guard is armed only on the KV shapes it covers.

Invariant: a node starts with a guard armed (log or enforce) only if, for every KV shape its model and serving
flags give (the pool's attention kind, a draft model's KV, a second pool, per-request state, DP attention), the
guard either covers that shape (the pages or bytes it judges are all those the PD transfer writes, shown by a test)
or reads no KV page or byte at all. Otherwise the node refuses to start, naming the shape, each such guard with
its reason and the switch that turns it off (a guard in log mode is named in a counted warning instead: log mode
refuses nothing). A pool the node cannot read counts as covered by no page or byte guard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sglang_harden._pycompat import StrValueEnum
from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "model_shape"


class KVShape(StrValueEnum):
    MHA = "mha"  # one pool, K and V per layer (MHATokenToKVPool): what the e2e testbed serves
    MLA = "mla"  # one latent buffer per layer (MLATokenToKVPool)
    SPECULATIVE = "speculative"  # speculative decoding: EAGLE/MTP draft KV beside the target's, speculative steps
    SWA = "swa"  # sliding-window layers in a second pool with its own page indices (SWAKVPool)
    LINEAR_STATE = "linear_state"  # Mamba/linear-attention state slots per request (HybridLinearKVPool)
    DP_ATTENTION = "dp_attention"  # several attention-DP ranks per node, each its own scheduler and pool
    UNKNOWN_POOL = "unknown_pool"  # a pool class sglang-harden does not read


class Cover(StrValueEnum):
    E2E = "e2e"  # shown on real PD pairs (MHA: docs/matrix.md; other shapes: the evidence tests)
    IN_PROCESS = "in-process"  # shown on SGLang's real pool classes in one process
    INDEPENDENT = "independent"  # reads no KV page index or byte: the shape does not reach it
    REFUSED = "refused"  # the node refuses to start with the guard armed on this shape


@dataclass(frozen=True)
class Coverage:
    cover: Cover
    why: str  # how it covers the shape, or why it is refused
    evidence: tuple[str, ...] = ()  # test node ids that show it (MHA's E2E cells: the matrix's tests, not listed)

    @property
    def refused(self) -> bool:
        return self.cover is Cover.REFUSED


PAGE_AND_BYTE_GUARDS = ("lifecycle", "page_tags", "canary", "checksum")
_INDEPENDENT = {
    "admission": "decides on the request's status and prompt length at the doors",
    "retire": "retires aborted requests by their status, whatever their pages hold",
    "coverage": "compares token counts per bootstrap room (the metadata row), not pages",
    "abort_notify": "a notice names a bootstrap room, whatever pools its pages are in",
    "capacity": "reads SGLang's own context length and prompt limit, computed for whatever pool it built",
    "bootstrap_auth": "signs every bootstrap route, /register_dp_rank and /query_dp_ranks included",
    "zmq_auth": "signs every ZMQ side-channel frame, whatever pointers and indices it carries",
    "side_channels": "restarts the side-channel listeners, whatever the frames carry",
}
_MLA_TEST = "tests/integration/test_model_shapes_inprocess.py"
_REFUSALS: dict[KVShape, dict[str, str]] = {
    KVShape.SPECULATIVE: {
        "lifecycle": "decode allocates the pages of speculative steps outside the ledger's reservations",
        "page_tags": "decode allocates the pages of speculative steps outside the ledger's reservations",
        "canary": "stamps only the target model's pool: a transfer that wrote no draft page commits (shown in process)",
        "checksum": "digests only the target model's pool: the draft model's KV goes unchecked",
    },
    KVShape.SWA: dict.fromkeys(PAGE_AND_BYTE_GUARDS, "the sliding-window layers' pages are a second pool with "
                               "its own indices, which the ledger does not track and the canary and digest do "
                               "not read"),
    KVShape.LINEAR_STATE: dict.fromkeys(PAGE_AND_BYTE_GUARDS, "the per-request Mamba/linear-attention state slots "
                                        "are transferred besides the pages; no guard tracks or reads them"),
    KVShape.DP_ATTENTION: dict.fromkeys(PAGE_AND_BYTE_GUARDS, "not shown with several attention-DP ranks per "
                                        "node (no DP-attention PD decode runs on the CPU testbed)"),
    KVShape.UNKNOWN_POOL: dict.fromkeys(PAGE_AND_BYTE_GUARDS, "sglang-harden does not read this pool class's "
                                        "buffers or index spaces"),
}
# A real node refusing the shape (and, its control, the same pair serving it in log mode)
_REFUSAL_E2E: dict[KVShape, tuple[str, ...]] = {
    KVShape.SWA: tuple(f"tests/e2e/test_swa_shape_e2e.py::{name}" for name in (
        "test_log_mode_pair_serves_the_swa_shape_with_guards_over_part_of_its_kv",
        "test_enforcing_decode_node_refuses_to_start_on_the_swa_shape")),
}
_MLA_E2E = "tests/e2e/test_model_shapes_e2e.py"
_MLA_LATE_WRITE = ("tests/e2e/test_mla_late_write_e2e.py::test_vanilla_mla_late_write_corrupts_a_victim",
                   "tests/e2e/test_mla_late_write_e2e.py::test_hardened_mla_late_write_corrupts_no_victim")
_COVERED: dict[tuple[KVShape, str], Coverage] = {
    (KVShape.MLA, "lifecycle"): Coverage(Cover.E2E, "holds the latent pages a late write may still land on "
                                         "(the late-write case on the MLA pair)", _MLA_LATE_WRITE),
    (KVShape.MLA, "page_tags"): Coverage(Cover.E2E, "aborts a first decode over a latent page its request does not "
                                         "own (a page table pointed at a free page)", (
        f"{_MLA_E2E}::test_vanilla_mla_pair_reads_a_free_latent_page_its_page_table_points_at",
        f"{_MLA_E2E}::test_hardened_mla_page_tags_abort_a_latent_page_the_request_does_not_own")),
    (KVShape.MLA, "canary"): Coverage(Cover.E2E, "stamps the first and last latent layer buffer", (
        f"{_MLA_E2E}::test_vanilla_mla_pair_decodes_over_a_flipped_bit_and_an_unwritten_page",
        f"{_MLA_E2E}::test_hardened_mla_canary_aborts_an_unwritten_latent_page",
        f"{_MLA_TEST}::test_mla_canary_passes_a_fully_written_transfer",
        f"{_MLA_TEST}::test_mla_canary_catches_a_page_the_transfer_skipped")),
    (KVShape.MLA, "checksum"): Coverage(Cover.E2E, "digests the latent buffer as one replicated head", (
        f"{_MLA_E2E}::test_vanilla_mla_pair_decodes_over_a_flipped_bit_and_an_unwritten_page",
        f"{_MLA_E2E}::test_hardened_mla_digest_aborts_a_flipped_latent_bit",
        f"{_MLA_TEST}::test_mla_faithful_transfer_compares_equal",
        f"{_MLA_TEST}::test_mla_flipped_bit_aborts",
        f"{_MLA_TEST}::test_mla_row_never_written_aborts")),
}


def coverage(shape: KVShape, guard: str) -> Coverage:
    """How ``guard`` covers ``shape`` (every guard covers MHA: the matrix's end-to-end results)."""
    if shape is KVShape.MHA:
        return Coverage(Cover.E2E, "the e2e suite's shape (docs/matrix.md)")
    if guard in _INDEPENDENT:
        return Coverage(Cover.INDEPENDENT, _INDEPENDENT[guard])
    if (shape, guard) in _COVERED:
        return _COVERED[(shape, guard)]
    reason = _REFUSALS.get(shape, {}).get(guard)
    evidence = _REFUSAL_E2E.get(shape, ()) if guard in PAGE_AND_BYTE_GUARDS else ()
    return Coverage(Cover.REFUSED, reason or "no test shows it on this shape", evidence)


def switch_off(guard: str) -> str:
    return f"SGLANG_HARDEN_{guard.upper()}=off"


def decide_shapes(shapes: Iterable[KVShape], armed: Iterable[str], detail: str = "") -> Decision:
    """ALLOW when every armed guard covers (or is independent of) every shape; else REJECT naming each gap and
    the switches. ``detail`` says what the shapes were read from (the pool class, the flags)."""
    shapes, armed = sorted(set(shapes)), sorted(set(armed))
    covers = {(shape, guard): coverage(shape, guard) for shape in shapes for guard in armed}
    gaps = [(shape, guard, c) for (shape, guard), c in covers.items() if c.refused]
    table = {guard: {shape.value: covers[(shape, guard)].cover.value for shape in shapes} for guard in armed}
    if not gaps:
        return allow(GUARD, shapes=[s.value for s in shapes], guards=table)
    guards_off = sorted({guard for _, guard, _ in gaps})
    named = "; ".join(f"{guard} on {shape.value}: {c.why}" for shape, guard, c in gaps)
    switches = " ".join(switch_off(g) for g in guards_off)
    flags = " ".join(f"--harden-{g.replace('_', '-')} off" for g in guards_off)
    reason = (f"this model's KV shape ({', '.join(s.value for s in shapes)}{'; ' + detail if detail else ''}) is not "
              f"covered by armed guards: {named}. A guard that covers part of the KV is not armed here (log mode: "
              f"counted and started). Run without them: {switches} (or {flags}); docs/shapes.md")
    return Decision(GUARD, Verdict.REJECT, reason, fields={"shapes": [s.value for s in shapes], "guards": table,
                                                          "refused": guards_off})


def shape_table(guards: Iterable[str]) -> list[tuple[str, dict[KVShape, Coverage]]]:
    """Every guard's coverage of every shape, for the generated table (docs/shapes.md, README)."""
    return [(guard, {shape: coverage(shape, guard) for shape in KVShape}) for guard in guards]

