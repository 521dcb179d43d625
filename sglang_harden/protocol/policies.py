"""The two rule sets the model runs: ``VanillaPolicy`` (upstream <= 0.5.19) and ``HardenedPolicy``.

Every hook is one decision point of the PD handoff. The vanilla rules say which upstream function they mirror;
the hardened rules call the decision functions in ``sglang_harden.guards`` — the code the plugin runs in the
scheduler — and fall back to the vanilla rule for a guard listed in ``disabled``.
"""

from __future__ import annotations

from collections.abc import Iterable

from sglang_harden.config import CapacityMode
from sglang_harden.guards import abort_notify, admission, capacity, coverage, lifecycle, page_tags, retire
from sglang_harden.guards.base import Verdict
from sglang_harden.protocol.world import (
    PENDING_DECODE,
    PENDING_PREFILL,
    T_FAILED,
    T_SENDING,
    ModelConfig,
    World,
    mask_of,
    rid_of,
    room_of,
)

Rejection = tuple[int, str]  # (HTTP status, message)

# Guards (and lifecycle sub-rules) the hardened policy can run without; see `HardenedPolicy`.
LIFECYCLE_RULES = ("lifecycle.quarantine", "lifecycle.source_hold", "lifecycle.window", "lifecycle.cap")
MODELLED_GUARDS = ("admission", "retire", "coverage", "abort_notify", "lifecycle", "page_tags", "capacity")
UNMODELLED_GUARDS = {
    "checksum": "digests catch bytes corrupted inside a transfer; the model's transfer engine copies pages "
    "exactly and has no corruption event",
    "canary": "finds reserved pages a transfer never wrote by their bytes; the model tracks written pages "
    "exactly, so coverage and page_tags already stand for it there",
    "bootstrap_auth": "authenticates who may register a bootstrap route; the model has no adversary on the "
    "bootstrap channel",
}
TOO_LONG_STATUS = 400
WRITE_LIFETIME_S = 30.0  # the sender's transfer_write_lifetime_s default; the model's expiry event passes it


class Freed:
    """What a release did with a request's pages, for the engine's property checks."""

    __slots__ = ("freed", "quarantined")

    def __init__(self, freed: Iterable[int] = (), quarantined: Iterable[int] = ()) -> None:
        self.freed = list(freed)
        self.quarantined = list(quarantined)


class VanillaPolicy:
    """Upstream SGLang <= 0.5.19, default settings."""

    name = "vanilla"
    holds_pages = False  # nothing is ever quarantined or held, so nothing needs settling

    def __init__(self, config: ModelConfig) -> None:
        self.config = config

    def context_len(self) -> int:
        """``TokenizerManager`` validates against the advertised context only (no capacity gate)."""
        return self.config.context_len

    def prefill_door(self, w: World, r: int) -> Rejection | None:
        """``PrefillBootstrapQueue.add``: admits every request, including the 1-token stub of a request that
        ``validate_input_length`` already rejected (``to_finish`` / ``finished_reason`` is not checked)."""
        return None

    def decode_door(self, w: World, r: int) -> Rejection | None:
        """``DecodePreallocQueue.add``: admits every request; the pool is the only limit."""
        return None

    def on_reserve(self, w: World, r: int) -> None:
        """``DecodePreallocQueue.pop_preallocated``: pages come from the allocator, nothing is recorded."""

    def on_handshake(self, w: World, r: int) -> None:
        """``KVReceiver.init``: decode's page indices go to prefill; nothing is recorded."""

    def final_send(self, w: World, r: int) -> Rejection | None:
        """``process_batch_result_disagg_prefill`` -> ``send_kv_chunk(last_chunk=True)`` for every request in
        the batch, pending rejection or abort notwithstanding."""
        return None

    def publish_coverage(self, w: World, r: int, sent: int) -> int:
        """``MetadataBuffers.set_buf``: no transferred-length field (PR #38704 never merged)."""
        return 0

    def first_window(self, ops: tuple) -> int:
        """Mooncake ``send_kvcache``: the whole transfer is one batch
        (``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` is 0 = unbounded)."""
        return len(ops)

    def on_send(self, w: World, r: int) -> None:
        """No source-page hold: prefill's pages are freed by whoever finishes the request first."""

    def commit(self, w: World, r: int) -> Rejection | None:
        """``DecodeTransferQueue.pop_transferred`` (``_commit_transfer_to_req`` from 0.5.6): KVPoll.Success
        commits the request with no check of how much KV arrived."""
        return None

    def first_step(self, w: World, r: int) -> Rejection | None:
        """The first decode step reads the page table as it is."""
        return None

    def release_decode(self, w: World, r: int, writer_drained: bool) -> Freed:
        """``release_kv_cache`` on abort, failure, completion and the waiting timeout (release on timeout):
        pages go straight back to the allocator, even if a write into them may still be in flight."""
        pages = w.dst[r]
        return Freed(freed=pages)

    def release_source(self, w: World, r: int) -> list[int]:
        """``process_disagg_prefill_inflight_queue`` (success and failure branches) and the abort path:
        source pages are freed at once, whether or not the transfer still reads them."""
        return list(w.src[r])

    def held_by_design(self, w: World) -> int:
        """Decode pages that may stay out of the free list at quiesce by design (none: nothing is held)."""
        return 0

    def prefill_success_error(self, w: World, r: int) -> int:
        """``process_disagg_prefill_inflight_queue`` success branch overwrites ``finished_reason`` with
        ``FINISH_LENGTH(0)`` (#33507): the stub's pending 400 is lost and prefill answers 200."""
        return 0

    def notify_decode(self, w: World, r: int, status: int) -> None:
        """No prefill -> decode abort message: decode waits for ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``."""

    def on_peer_abort(self, w: World, r: int) -> bool:
        """Never reached in vanilla (no notice is sent)."""
        return True

    def settle(self, w: World, r: int) -> list[int]:
        """Nothing is quarantined, so nothing settles."""
        return []


class HardenedPolicy(VanillaPolicy):
    """The plugin's rules: each hook calls the guard's decision function unless that guard is disabled."""

    name = "hardened"
    holds_pages = True

    def __init__(self, config: ModelConfig, disabled: Iterable[str] = ()) -> None:
        super().__init__(config)
        self.disabled = frozenset(disabled)
        unknown = self.disabled - set(MODELLED_GUARDS) - set(LIFECYCLE_RULES) - set(UNMODELLED_GUARDS)
        if unknown:
            raise ValueError(f"unknown guard(s) {sorted(unknown)}; known: {MODELLED_GUARDS + LIFECYCLE_RULES}")
        self._context_len = self._gate_capacity()

    def on(self, guard: str) -> bool:
        if guard in self.disabled:
            return False
        if guard.startswith("lifecycle."):
            return "lifecycle" not in self.disabled
        return True

    # ---- start-up ------------------------------------------------------------------------------------------
    def _gate_capacity(self) -> int:
        """``guards.capacity``: refuse (ConfigRefused), clamp the context, or only log."""
        mode = CapacityMode(self.config.capacity_mode) if self.on("capacity") else CapacityMode.OFF
        context = self.config.context_len
        for limit in (self.config.prefill_limit, self.config.decode_limit):
            decision = capacity.decide_capacity(context, limit, 0, mode)
            if decision.verdict is Verdict.CLAMP:
                context = int(decision.fields["context_len"])  # type: ignore[arg-type]
            elif decision.verdict is Verdict.REJECT and not decision.fields.get("log_only"):
                raise ConfigRefused(decision.reason)
        return context

    def context_len(self) -> int:
        return self._context_len

    # ---- doors ---------------------------------------------------------------------------------------------
    def _door(self, w: World, r: int, role: str, length: int, bit: int, limit: int) -> Rejection | None:
        if not self.on("admission"):
            return None
        pending = None
        if w.pending[r] & bit:
            message = admission.too_long_message(self.config.requests[r].prompt_len, limit)
            pending = admission.PendingRejection(message, TOO_LONG_STATUS)
        view = admission.AdmissionView(rid_of(r), role, length, pending, limit)
        decision = admission.decide_admission(view)
        return None if decision.allows else (decision.status_code or 400, decision.reason)

    def prefill_door(self, w: World, r: int) -> Rejection | None:
        return self._door(w, r, "prefill", w.p_len[r], PENDING_PREFILL, self.config.prefill_limit)

    def decode_door(self, w: World, r: int) -> Rejection | None:
        rejection = self._door(w, r, "decode", w.d_len[r], PENDING_DECODE, self.config.decode_limit)
        if rejection is None and self.on("lifecycle.cap"):
            decision = self._decode_ledger(w).admission_open(self.config.quarantine_cap)
            if not decision.allows:
                return decision.status_code or 503, decision.reason
        return rejection

    # ---- decode pages --------------------------------------------------------------------------------------
    def _decode_ledger(self, w: World) -> lifecycle.PageLedger:
        return w.ledger("d_ledger", self.config.decode_pages)

    def on_reserve(self, w: World, r: int) -> None:
        w.gen[r] = self._decode_ledger(w).reserve(rid_of(r), w.dst[r])

    def on_handshake(self, w: World, r: int) -> None:
        self._decode_ledger(w).begin_write(rid_of(r), w.dst[r])

    def commit(self, w: World, r: int) -> Rejection | None:
        sent = coverage.decode_coverage(w.meta[r], room_of(r))
        pages = w.dst[r]
        self._decode_ledger(w).finish_write(rid_of(r), pages[: sent or 0])
        if not self.on("coverage"):
            return None
        decision = coverage.decide_commit(rid_of(r), len(pages), sent)
        return None if decision.allows else (decision.status_code or 500, decision.reason)

    def first_step(self, w: World, r: int) -> Rejection | None:
        if not self.on("page_tags"):
            return None
        decision = page_tags.check_page_table(self._decode_ledger(w), rid_of(r), w.gen[r], w.dst[r])
        return None if decision.allows else (decision.status_code or 500, decision.reason)

    def release_decode(self, w: World, r: int, writer_drained: bool) -> Freed:
        """Release by the ledger: a page the ledger says is not r's is ignored, not freed."""
        drained = writer_drained or not self.on("lifecycle.quarantine")
        pages = list(w.dst[r])
        if w.faulted and w.faulted[0] == r:
            pages.append(w.faulted[2])  # the ledger still knows r owns the page the bug displaced
        outcome = self._decode_ledger(w).release(rid_of(r), pages, writer_drained=drained)
        if outcome.to_quarantine:
            w.quar[r] = 1
        return Freed(outcome.to_free, outcome.to_quarantine)

    # ---- prefill pages and the transfer --------------------------------------------------------------------
    def final_send(self, w: World, r: int) -> Rejection | None:
        if not self.on("retire"):
            return None
        pending = None
        if w.pending[r] & PENDING_PREFILL:
            pending = admission.PendingRejection("request was rejected before its final KV send", 400)
        decision = retire.decide_final_send(retire.RetireView(rid_of(r), pending, bool(w.p_abort[r])))
        return None if decision.allows else (decision.status_code or 500, decision.reason)

    def publish_coverage(self, w: World, r: int, sent: int) -> int:
        return coverage.encode_coverage(sent, room_of(r))

    def first_window(self, ops: tuple) -> int:
        if not self.on("lifecycle.window") or not ops:
            return len(ops)
        return len(lifecycle.split_into_windows(ops, self.config.transfer_window)[0])

    def on_send(self, w: World, r: int) -> None:
        if self.on("lifecycle.source_hold"):
            w.held[r] = 1

    def release_source(self, w: World, r: int) -> list[int]:
        """Held source pages go back only once production's rule says the room's writes are over."""
        if not w.held[r]:
            return list(w.src[r])
        if not self.source_settled(w, r):
            return []
        w.held[r] = 0
        return list(w.src[r])

    def source_settled(self, w: World, r: int) -> bool:
        """``lifecycle.source_settled`` on what prefill knows of r's transfer: chunks still queued while it
        sends, whether its status is final, and a write the transport gave up on (young, or past its lifetime)."""
        failed_write = w.status[r] == T_FAILED and bool(w.ops[r])
        age = (lifecycle.FAILED_WRITE_EXPIRED if w.expired[r] else 0.0) if failed_write else None
        chunks = len(w.ops[r]) if w.status[r] == T_SENDING else 0
        evidence = lifecycle.SourceEvidence(chunks, w.status[r] != T_SENDING, age)
        return lifecycle.source_settled(evidence, WRITE_LIFETIME_S)

    def writer_drained(self, w: World, r: int, ack_sent: bool) -> bool:
        """``lifecycle.writer_drained`` on what decode knows: prefill's one drain ack (sent once the room
        settled, unless lost on the way) and whether the sender is known gone."""
        acks = int(ack_sent and not w.ack_lost[r])
        return lifecycle.writer_drained(lifecycle.DrainEvidence(1, acks, sender_gone=bool(w.gone[r])))

    def held_by_design(self, w: World) -> int:
        """Quarantined pages whose drain ack was lost while the sender lives: held until it is known gone
        (never reused on a bare timeout; the quarantine cap bounds them)."""
        ledger, mask = self._decode_ledger(w), 0
        for r in range(self.config.n):
            if w.ack_lost[r] and not w.gone[r]:
                mask |= mask_of(ledger.quarantined_pages(rid_of(r)))
        return mask

    def prefill_success_error(self, w: World, r: int) -> int:
        keeps_pending = self.on("retire") and w.pending[r] & PENDING_PREFILL
        return TOO_LONG_STATUS if keeps_pending else 0

    # ---- abort notification and drain ----------------------------------------------------------------------
    def notify_decode(self, w: World, r: int, status: int) -> None:
        if self.on("abort_notify"):
            w.notice[r] = status

    def on_peer_abort(self, w: World, r: int) -> bool:
        """Returns whether the writer counts as drained (pages released) or not (pages quarantined)."""
        decision = abort_notify.decide_on_peer_abort(rid_of(r), bool(w.handshook[r]), writer_drained=False)
        return decision.fields["pages"] == abort_notify.PAGES_RELEASE

    def settle(self, w: World, r: int) -> list[int]:
        """The writer of ``r`` drained: decode's quarantined pages leave quarantine."""
        if not w.quar[r]:
            return []
        w.quar[r] = 0
        return self._decode_ledger(w).confirm_drained(rid_of(r))


class ConfigRefused(RuntimeError):
    """The capacity gate refused to start a node of this configuration."""


def make_policy(name: str, config: ModelConfig, disabled: Iterable[str] = ()) -> VanillaPolicy:
    if name == "vanilla":
        if tuple(disabled):
            raise ValueError("--disable applies to the hardened policy only")
        return VanillaPolicy(config)
    if name == "hardened":
        return HardenedPolicy(config, disabled)
    raise ValueError(f"unknown policy {name!r} (vanilla|hardened)")


__all__ = ["ConfigRefused", "Freed", "HardenedPolicy", "VanillaPolicy", "make_policy", "mask_of"]
