"""The PD handoff as a transition system: which events are enabled in a state, and what each one does.

Two nodes and a transfer engine. Prefill admits a request, waits for decode's page indices (bootstrap),
computes the KV into its own pages (forward) and sends it page by page. Decode reserves pages, hands their
indices to prefill, polls the transfer, commits, and reads the pages on its first decode step. The transfer
engine copies one page per ``land`` event, reading the *source page as it is at that moment*; a write can land
after either side gave up and can never be cancelled. Clients submit, abort and disconnect; nodes time out.

Safety properties are checked on every transition (``Violation``), quiesce properties when nothing is enabled,
and "stuck until timeout" when only timeouts are enabled.
"""

from __future__ import annotations

from sglang_harden.protocol.policies import VanillaPolicy
from sglang_harden.protocol.properties import PROPERTIES, Violation  # noqa: F401 - the model's public names
from sglang_harden.protocol.world import (
    CLIENT_ABORTED,
    D_DONE,
    D_ENDED,
    D_QUEUED,
    D_RUNNING,
    D_WAITING,
    ENDED_D,
    ENDED_P,
    P_DONE,
    P_ENDED,
    P_FORWARDED,
    P_NEW,
    P_QUEUED,
    P_READY,
    P_SENDING,
    PENDING_DECODE,
    PENDING_PREFILL,
    PREFILL_DISCONNECTED,
    T_FAILED,
    T_SENDING,
    T_SUCCESS,
    Columns,
    Globals,
    ModelConfig,
    World,
    lowest_free,
    mask_of,
)

Event = tuple[str, int]
TIMEOUTS = frozenset({"decode_timeout", "prefill_timeout"})
# Events nobody inside the system causes: the protocol may not rely on them to make progress.
EXTERNAL = TIMEOUTS | {"client_abort", "prefill_disconnect", "transfer_fail", "fault_misown", "lifetime_expires",
                      "ack_lost", "sender_gone"}
CLIENT_GONE = 499

CROSSED = 1000


def _content_tag(kv_owner: int, transfer_of: int, on_time: bool) -> int:
    """What a landed write leaves in a decode page. ``k + 1``: request k's KV, written by k's own transfer
    while k owned the page (a later owner reading it sees a stale page); ``-(t + 1)``: request t's transfer
    landed after t gave the page up; ``CROSSED + k + 1``: k's KV carried by another request's transfer
    (its prefill source page was reused); 0 stays "never written"."""
    if not on_time:
        return -(transfer_of + 1)
    if not kv_owner:
        return 0
    return kv_owner if kv_owner == transfer_of + 1 else CROSSED + kv_owner


class Model:
    """Enabled events and transitions for one configuration under one policy."""

    def __init__(self, config: ModelConfig, policy: VanillaPolicy) -> None:
        self.config = config
        self.policy = policy
        self.context_len = policy.context_len()
        self._violations: list[Violation] = []
        self._note = ""

    def initial(self) -> tuple:
        return World.initial(self.config).freeze()

    # ---- enabled events ------------------------------------------------------------------------------------
    def enabled(self, state: tuple) -> list[Event]:
        rows, globals_ = state
        c, g = Columns._make(rows), Globals._make(globals_)
        events: list[Event] = []
        for r in range(self.config.n):
            events.extend((kind, r) for kind in self._enabled_for(c, g, r))
        return events

    def _enabled_for(self, c: Columns, g: Globals, r: int) -> list[str]:
        kinds: list[str] = []
        p, d, status = c.p_phase[r], c.d_phase[r], c.status[r]
        if p == P_NEW:
            if r == 0 or c.p_phase[r - 1] != P_NEW:
                kinds.append("submit")
            return kinds
        if d == D_QUEUED and bin(g.d_free).count("1") >= c.d_len[r]:
            kinds.append("decode_prealloc")
        if p == P_READY and bin(g.p_free).count("1") >= c.p_len[r]:
            kinds.append("prefill_forward")
        if p == P_FORWARDED:
            kinds.append("prefill_send")
        if c.ops[r] and c.issued[r]:
            kinds.append("land")
        if status == T_SENDING:
            if not c.ops[r]:
                kinds.append("transfer_done")
            kinds.append("transfer_fail")
        if d == D_WAITING and status in (T_SUCCESS, T_FAILED):
            kinds.append("decode_poll")
        if d == D_RUNNING:
            kinds.append("decode_step")
            if "misowned_page" in self.config.faults and not g.faulted:
                kinds.append("fault_misown")
        if c.p_abort[r] and p in (P_QUEUED, P_READY, P_SENDING):
            kinds.append("prefill_abort")
        if c.notice[r]:
            kinds.append("deliver_notice")
        if self.config.write_lifetime and status == T_FAILED and c.ops[r] and not c.expired[r]:
            kinds.append("lifetime_expires")
        if self.config.lost_acks:
            self._lost_ack_events(c, r, kinds)
        if self.config.client_events:
            self._client_events(c, r, kinds)
        if self.config.timeouts:
            if d in (D_QUEUED, D_WAITING):
                kinds.append("decode_timeout")
            if p == P_QUEUED:
                kinds.append("prefill_timeout")
        if self.config.events_off:
            kinds = [k for k in kinds if k not in self.config.events_off]
        return kinds

    def _lost_ack_events(self, c: Columns, r: int, kinds: list[str]) -> None:
        """The ack can be lost while decode quarantines r's pages; the sender can be found gone once its writes
        are over (a process that died with writes in flight is not modelled)."""
        if c.quar[r] and not c.ack_lost[r]:
            kinds.append("ack_lost")
        if c.ack_lost[r] and not c.gone[r] and c.p_phase[r] in ENDED_P and not c.ops[r]:
            kinds.append("sender_gone")

    def _client_events(self, c: Columns, r: int, kinds: list[str]) -> None:
        live = c.p_phase[r] not in ENDED_P or c.d_phase[r] not in ENDED_D
        if live and not c.client[r] & CLIENT_ABORTED:
            kinds.append("client_abort")
        if c.p_phase[r] in (P_QUEUED, P_READY, P_FORWARDED, P_SENDING) and not c.client[r]:
            kinds.append("prefill_disconnect")

    # ---- transitions ---------------------------------------------------------------------------------------
    def step(self, state: tuple, event: Event) -> tuple[tuple, list[Violation], str]:
        """Apply ``event``; return the next state, the violations it caused and a note for the trace."""
        w = World.thaw(state)
        self._violations, self._note = [], ""
        kind, r = event
        getattr(self, "_" + kind)(w, r)
        if self.policy.holds_pages:
            self._settle_drained(w)
        return w.freeze(), self._violations, self._note

    def _flag(self, prop: str, detail: str) -> None:
        self._violations.append(Violation(prop, detail))

    def _say(self, text: str) -> None:
        self._note = f"{self._note}; {text}" if self._note else text

    def _submit(self, w: World, r: int) -> None:
        spec = self.config.requests[r]
        length = spec.prompt_len
        self._say(f"prompt {length}")
        if length > self.context_len:
            w.p_phase[r], w.d_phase[r] = P_ENDED, D_ENDED
            w.record_error(r, 400)
            self._say(f"tokenizer rejects: longer than context {self.context_len}")
            return
        w.p_len[r] = self._validate(w, r, length, self.config.prefill_limit, spec.auto_truncate, PENDING_PREFILL)
        w.d_len[r] = self._validate(w, r, length, self.config.decode_limit, spec.auto_truncate, PENDING_DECODE)
        self._admit_prefill(w, r)
        self._admit_decode(w, r)

    def _validate(self, w: World, r: int, length: int, limit: int, truncate: bool, bit: int) -> int:
        """``validate_input_length``: too long -> truncated (auto-truncate) or a 1-token stub with a pending
        rejection (``set_finish_with_abort``)."""
        if length <= limit:
            return length
        side = "prefill" if bit == PENDING_PREFILL else "decode"
        if truncate:
            self._say(f"{side} truncates to {limit}")
            return limit
        w.pending[r] |= bit
        self._say(f"{side} stubs it (pending 400: {length} > {limit})")
        return 1

    def _admit_prefill(self, w: World, r: int) -> None:
        rejection = self.policy.prefill_door(w, r)
        if rejection is None:
            w.p_phase[r] = P_QUEUED
            return
        w.p_phase[r] = P_ENDED
        w.record_error(r, rejection[0])
        self._say(f"prefill rejects {rejection[0]}")
        self.policy.notify_decode(w, r, rejection[0])

    def _admit_decode(self, w: World, r: int) -> None:
        rejection = self.policy.decode_door(w, r)
        if rejection is None:
            w.d_phase[r] = D_QUEUED
            return
        w.d_phase[r] = D_ENDED
        w.record_error(r, rejection[0])
        self._say(f"decode rejects {rejection[0]}")
        self._tell_prefill(w, r)

    def _decode_prealloc(self, w: World, r: int) -> None:
        pages = lowest_free(w.d_free, w.d_len[r])
        if w.pending[r] & PENDING_DECODE:
            self._flag("rejected_allocated", f"decode reserved pages for r{r}, which it had rejected")
        w.d_free &= ~mask_of(pages)
        w.dst[r] = pages
        w.d_phase[r] = D_WAITING
        self.policy.on_reserve(w, r)
        self._say(f"decode reserves {list(pages)}")
        if w.p_phase[r] == P_QUEUED:
            w.p_phase[r] = P_READY
            w.handshook[r] = 1
            self.policy.on_handshake(w, r)
            self._say("prefill gets the page indices")
            if w.pending[r] & PENDING_PREFILL:
                self._flag("rejected_allocated", f"prefill bootstrapped r{r}, which it had rejected")

    def _prefill_forward(self, w: World, r: int) -> None:
        pages = lowest_free(w.p_free, w.p_len[r])
        w.p_free &= ~mask_of(pages)
        for page in pages:
            w.p_content[page] = r + 1
        w.src[r] = pages
        w.p_phase[r] = P_FORWARDED
        self._say(f"prefill computes KV into its pages {list(pages)}")

    def _prefill_send(self, w: World, r: int) -> None:
        rejection = self.policy.final_send(w, r)
        if rejection is not None:
            w.status[r] = T_FAILED
            self._say(f"final send refused, sender failed ({rejection[1]})")
            self._end_prefill(w, r, rejection[0])
            self._release_source(w, r)
            return
        count = min(len(w.src[r]), len(w.dst[r]))
        ops = tuple(zip(w.src[r][:count], w.dst[r][:count], strict=True))
        w.ops[r], w.issued[r] = ops, self.policy.first_window(ops)
        w.status[r] = T_SENDING
        w.meta[r] = self.policy.publish_coverage(w, r, count)
        w.p_phase[r] = P_SENDING
        self.policy.on_send(w, r)
        self._say(f"send_kv_chunk(last) of {count} page(s) into decode pages {[d for _, d in ops]}")

    def _land(self, w: World, r: int) -> None:
        (src, dst), rest = w.ops[r][0], w.ops[r][1:]
        writer = w.p_content[src]
        on_time = w.d_phase[r] == D_WAITING and dst in w.dst[r]
        w.d_content[dst] = _content_tag(writer, r, on_time)
        w.ops[r], w.issued[r] = rest, w.issued[r] - 1
        if not w.issued[r] and rest:
            w.issued[r] = self.policy.first_window(rest)
        whose = f"r{writer - 1}'s KV" if writer else "unwritten rows"
        late = "" if on_time else f" (LATE: r{r} no longer owns it)"
        self._say(f"write lands: prefill page {src} ({whose}) -> decode page {dst}{late}")
        if not rest and w.status[r] == T_SENDING:
            self._transfer_done(w, r)

    def _transfer_done(self, w: World, r: int) -> None:
        w.status[r] = T_SUCCESS
        self._say("transfer reports success")
        if w.p_phase[r] == P_SENDING:
            status = self.policy.prefill_success_error(w, r)
            w.p_phase[r] = P_DONE if not status else P_ENDED
            if status:
                w.record_error(r, status)
        self._release_source(w, r)

    def _transfer_fail(self, w: World, r: int) -> None:
        w.status[r] = T_FAILED
        w.ops[r] = w.ops[r][: w.issued[r]]
        self._say(f"transfer fails with {len(w.ops[r])} write(s) still in flight")
        if w.p_phase[r] == P_SENDING:
            self._end_prefill(w, r, 500)
            self._release_source(w, r)

    def _decode_poll(self, w: World, r: int) -> None:
        if w.status[r] == T_FAILED:
            self._say("decode sees the failure")
            self._end_decode(w, r, 500, writer_drained=False)
            return
        rejection = self.policy.commit(w, r)
        if rejection is not None:
            self._say(f"commit refused: {rejection[1]}")
            self._end_decode(w, r, rejection[0], writer_drained=True)
            return
        w.d_phase[r] = D_RUNNING
        self._say("decode commits the transfer")

    def _decode_step(self, w: World, r: int) -> None:
        rejection = self.policy.first_step(w, r)
        if rejection is not None:
            self._say(f"first step refused: {rejection[1]}")
            self._end_decode(w, r, rejection[0], writer_drained=True)
            return
        self._check_reads(w, r)
        w.completed[r] = 1
        self._say(f"decode reads pages {list(w.dst[r])} and completes (HTTP 200)")
        if w.pending[r]:
            self._flag("rejected_completed", f"r{r} had a pending 400 but its client got a completion")
        w.d_phase[r] = D_DONE
        self._release_decode(w, r, writer_drained=True)

    def _check_reads(self, w: World, r: int) -> None:
        for page in w.dst[r]:
            tag = w.d_content[page]
            if tag == r + 1:
                continue
            if tag > CROSSED:
                detail = f"r{r} read decode page {page}: r{tag - CROSSED - 1}'s KV, copied from a prefill page "
                self._flag("source_reuse_read", detail + "that was reused while the transfer still read it")
            elif tag < 0:
                detail = f"r{r} read decode page {page}, where r{-tag - 1}'s transfer landed a late write"
                self._flag("late_write_read", detail)
            elif tag:
                detail = f"r{r} read decode page {page}, which still holds r{tag - 1}'s KV (previous owner)"
                self._flag("stale_read", detail)
            else:
                self._flag("unwritten_read", f"r{r} read decode page {page}, never written by its transfer")
            return

    def _fault_misown(self, w: World, r: int) -> None:
        """Test hook: a page-table bug puts another page of the pool in place of one of r's pages."""
        others = [p for p in range(self.config.decode_pages) if p not in w.dst[r]]
        if not others or not w.dst[r]:
            return
        injected, displaced = others[0], w.dst[r][0]
        w.faulted = (r, injected, displaced)
        w.dst[r] = (injected,) + w.dst[r][1:]
        self._say(f"FAULT: r{r}'s page table points at decode page {injected} instead of {displaced}")

    def _decode_timeout(self, w: World, r: int) -> None:
        self._say("decode waiting timeout")
        self._end_decode(w, r, 500, writer_drained=False)

    def _prefill_timeout(self, w: World, r: int) -> None:
        self._say("prefill bootstrap timeout")
        self._end_prefill(w, r, 500)

    def _prefill_abort(self, w: World, r: int) -> None:
        self._say("prefill handles the abort")
        sending = w.p_phase[r] == P_SENDING
        self._end_prefill(w, r, CLIENT_GONE)
        if sending:
            self._release_source(w, r)

    def _client_abort(self, w: World, r: int) -> None:
        w.client[r] |= CLIENT_ABORTED
        self._say("client aborts (both nodes told)")
        if w.p_phase[r] not in ENDED_P:
            w.p_abort[r] = 1
        if w.d_phase[r] in (D_QUEUED, D_WAITING, D_RUNNING):
            self._end_decode(w, r, CLIENT_GONE, writer_drained=w.d_phase[r] == D_RUNNING)

    def _prefill_disconnect(self, w: World, r: int) -> None:
        w.client[r] |= PREFILL_DISCONNECTED
        w.p_abort[r] = 1
        self._say("client connection to prefill drops")

    def _deliver_notice(self, w: World, r: int) -> None:
        status, w.notice[r] = w.notice[r], 0
        if w.d_phase[r] not in (D_QUEUED, D_WAITING, D_RUNNING):
            self._say("abort notice arrives; decode already done with it")
            return
        drained = w.d_phase[r] == D_RUNNING or self.policy.on_peer_abort(w, r)
        self._say(f"decode gets prefill's abort notice ({status})")
        self._end_decode(w, r, status, writer_drained=drained)

    # ---- shared endings ------------------------------------------------------------------------------------
    def _end_prefill(self, w: World, r: int, status: int) -> None:
        w.p_phase[r] = P_ENDED
        w.record_error(r, status)
        if w.d_phase[r] not in ENDED_D:
            self.policy.notify_decode(w, r, status)

    def _tell_prefill(self, w: World, r: int) -> None:
        """Decode -> prefill abort message (upstream from 0.5.13, both policies)."""
        if w.p_phase[r] not in ENDED_P and w.p_phase[r] != P_NEW:
            w.p_abort[r] = 1

    def _end_decode(self, w: World, r: int, status: int, writer_drained: bool) -> None:
        if w.d_phase[r] != D_DONE:
            w.d_phase[r] = D_ENDED
            w.record_error(r, status)
            self._tell_prefill(w, r)
        self._release_decode(w, r, writer_drained)

    def _release_decode(self, w: World, r: int, writer_drained: bool) -> None:
        pages = w.dst[r]
        if not pages:
            return
        owned = list(pages)
        if w.faulted and w.faulted[0] == r:
            _, injected, displaced = w.faulted
            owned = [displaced if p == injected else p for p in owned]
        freed = self.policy.release_decode(w, r, writer_drained)
        self._free_decode(w, freed.freed)
        w.d_quar |= mask_of(freed.quarantined)
        kept = [p for p in owned if p not in freed.freed and p not in freed.quarantined]
        if kept:
            self._flag("aborted_pages_held", f"r{r} ended but pages {kept} are neither free nor quarantined")
        if freed.quarantined:
            self._say(f"pages {freed.quarantined} quarantined")
        if freed.freed:
            self._say(f"decode frees {freed.freed}")
        w.dst[r] = ()

    def _free_decode(self, w: World, pages: list[int] | tuple[int, ...]) -> None:
        for page in pages:
            if w.d_free >> page & 1:
                self._flag("double_free", f"decode page {page} freed twice")
            w.d_free |= 1 << page
            w.d_quar &= ~(1 << page)

    def _release_source(self, w: World, r: int) -> None:
        if not w.src[r]:
            return
        self._free_prefill(w, self.policy.release_source(w, r))
        if not w.held[r]:
            w.src[r] = ()

    def _free_prefill(self, w: World, pages: list[int]) -> None:
        for page in pages:
            if w.p_free >> page & 1:
                self._flag("double_free", f"prefill page {page} freed twice")
            w.p_free |= 1 << page
        if pages:
            self._say(f"prefill frees {pages}")

    def _settle_drained(self, w: World) -> None:
        """Once prefill's request ended: when production's rule says r's writes are over, prefill lets its held
        source pages go and sends its drain ack; decode leaves quarantine when its rule says the writer
        drained (the ack arrived, or the sender is known gone)."""
        quar, held = w.peek("quar"), w.peek("held")
        if not (any(quar) or any(held)):
            return
        for r in range(self.config.n):
            if not (quar[r] or held[r]) or w.p_phase[r] not in ENDED_P:
                continue
            settled = self.policy.source_settled(w, r)
            if quar[r] and self.policy.writer_drained(w, r, ack_sent=settled):
                decode_pages = self.policy.settle(w, r)
                self._free_decode(w, decode_pages)
                if decode_pages:
                    self._say(f"r{r}'s writer drained: decode pages {decode_pages} leave quarantine")
            if held[r] and settled:
                self._release_source(w, r)

    # ---- the transport's and the network's own events --------------------------------------------------
    def _lifetime_expires(self, w: World, r: int) -> None:
        w.expired[r] = 1
        self._say(f"r{r}'s failed write outlives the write lifetime (still in flight)")

    def _ack_lost(self, w: World, r: int) -> None:
        w.ack_lost[r] = 1
        self._say(f"prefill's drain ack for r{r} is lost")

    def _sender_gone(self, w: World, r: int) -> None:
        w.gone[r] = 1
        self._say(f"decode learns r{r}'s sender is gone")

    # ---- state properties ----------------------------------------------------------------------------------
    def check_state(self, state: tuple, events: list[Event]) -> Violation | None:
        """Quiesce properties (nothing enabled) and stuck-until-timeout (only a timeout or a client could
        move the system, and a timeout is pending)."""
        if not events:
            return self._quiesce(World.thaw(state))
        if any(kind not in EXTERNAL for kind, _ in events):
            return None
        waiting = sorted({f"r{r} ({kind})" for kind, r in events if kind in TIMEOUTS})
        if waiting:
            return Violation("stuck_until_timeout", "only a timeout can end " + ", ".join(waiting))
        return None

    def _quiesce(self, w: World) -> Violation | None:
        full_d, full_p = (1 << self.config.decode_pages) - 1, (1 << self.config.prefill_pages) - 1
        d_free = w.d_free | self.policy.held_by_design(w)
        if d_free != full_d or w.p_free != full_p:
            lost_d = [p for p in range(self.config.decode_pages) if not d_free >> p & 1]
            lost_p = [p for p in range(self.config.prefill_pages) if not w.p_free >> p & 1]
            return Violation("leak_at_quiesce", f"not free at quiesce: decode {lost_d}, prefill {lost_p}")
        for r in range(self.config.n):
            if w.pending[r] and not w.error[r]:
                return Violation("rejected_completed", f"r{r} was rejected but its client got no error")
        return None
