"""Patch text of the page lifecycle (0.5.x ack edits, the free path judged by why SGLang frees, and the
lifecycle's own abort notice and drain ack on releases without them: 0.4.x, 0.5.10.post1)."""
from common_text import *  # noqa: F403


H_LIFECYCLE = """\
sglang-harden backport: page lifecycle (no KV page is reused while a write into it can still land)

What: a new module mem_cache/pd_lifecycle.py (sglang-harden's own page ledger and lifecycle rules,
generated into it). Decode records the pages the prealloc queue hands to the transfer backend (after
send_metadata, any backend) as being written for room:<bootstrap_room>, and as written once the
transfer reported Success and is committed. The token and paged allocators' free paths keep back every
page still being written whose writers have not drained (quarantine) and ask prefill for its drain
acknowledgement (abort notice); the pages leave quarantine in pop_transferred once every prefill rank
acknowledged (note_abort_ack) or the prefill node is known gone (_handle_node_failure), never on a
timeout. Prefill holds the acknowledgement of a room whose KV write the transport gave up on (Mooncake's
failed engine call, a failed NIXL post; poison_deferred_ack_room where the release has it, which no
longer drops the acknowledgement target) until SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S (default 30; 0: never by itself)
passed since the failure. The idle pool check counts quarantined pages as held, not leaked. At the
quarantine cap (SGLANG_HARDEN_QUARANTINE_CAP_PAGES, default a quarter of the pool) decode refuses new
requests with 503 instead of letting them wait on held pages.<deferred> SGLANG_HARDEN_LIFECYCLE=enforce (default) | log | off, as on a plugin server.

Why: a write the transport gave up on can still land. Upstream frees the destination pages of a room
prefill failed at once, or after a timeout, and prefill acknowledges a drain as soon as its worker moved
on; the late write then lands in pages another request already reads.
Both sides must carry this patch: a decode with it holds the pages of a failed transfer until prefill
acknowledges, which an unpatched prefill may never do for a failed write.
"""

LIFECYCLE_IMPORT = "from sglang.srt.mem_cache import pd_lifecycle\n"
PD_LIFECYCLE = with_bundle("pd_lifecycle.py", ("NOT_HANDLED", "DONE", "LedgerOps", "ledger_library", "StrEnum"))
DEFERRED_FLAG = "            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()\n"
DEFERRED_FLAG_ON = ("            pd_lifecycle.deferred_release(  # sglang-harden backport: drain acks on\n"
                    "                envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()\n"
                    "            )\n")
NODE_FAILURE = ('    def _handle_node_failure(self, failed_bootstrap_addr: str):\n'
                '        """Handle failure of a prefill node."""\n')
MOONCAKE_FAILED_SEND = "                        if ret != 0:\n                            with self.session_lock:\n"
SUCCESS_COMMIT = "                self._commit_transfer_to_req(decode_req)\n                indices_to_remove.add(i)\n"
POOL_CHECK = ('        """Check: available + evictable + protected + session_held + uncached == total."""\n'
              "        total_accounted = available + evictable + protected + session_held + uncached\n")
POOL_CHECK_HELD = ('        """Check: available + evictable + protected + session_held + uncached == total."""\n'
                   '        if pool_name == "full":  # sglang-harden backport: quarantined pages are held, not leaked\n'
                   "            available += pd_lifecycle.held_tokens()\n"
                   "        total_accounted = available + evictable + protected + session_held + uncached\n")
POP_TRANSFERRED = "    def pop_transferred(self, rids_to_check: Optional[List[str]] = None) -> List[Req]:\n"
NOTE_ACK_0519 = ("    def note_abort_ack(self, bootstrap_room: int, prefill_rank: int) -> None:\n"
                 '        """Record a prefill rank\'s drain ack (decode receiver thread). Only counts\n'
                 '        while the room is held; grabs the set by reference to avoid racing clear."""\n')
SEND_ACK_0519 = ("    def _send_abort_ack(self, decode_ip: str, decode_port: int, room: int) -> None:\n"
                 '        """Best-effort ack that this rank\'s transfer for an aborted room drained."""\n')
SEND_ACK_0519_RESEND = "lambda: self._send_abort_ack(decode_ip, decode_port, room)"
NOTE_ACK_0522 = ("    def note_abort_ack(\n        self, bootstrap_room: int, prefill_rank: int, generation: int\n"
                 '    ) -> None:\n        """Record an ACK only for the generation currently holding the room."""\n')
SEND_ACK_0522 = ("    def _send_abort_ack(self, room: int, target: AckTarget) -> None:\n"
                 '        """Best-effort ack that this rank\'s transfer for an aborted room drained."""\n')
SEND_ACK_0522_RESEND = "lambda: self._send_abort_ack(room, target)"
NOTICE_0519 = "    def _send_abort_notification(self):\n"  # also 0.5.18
NOTICE_0521 = "    def _send_abort_notification(self, *, force_arm: bool = False):\n"
POISON_0522 = ("    def poison_deferred_ack_room(self, room: int) -> None:\n"
               '        """Drop an ACK target when the backend cannot prove the room drained."""\n')


def notice_arms_acks(notice: str) -> tuple:
    """Decode's abort notice (``CommonKVReceiver._send_abort_notification``) arms its transfer's drain
    acknowledgements before it goes out."""
    return (CONN, notice, notice + "        pd_lifecycle.note_abort_notice(self)  # sglang-harden backport: acks may come\n")


def _ack_edits(note_ack: str, send_ack: str, resend: str, notice: str, generation: bool) -> list:
    args = "bootstrap_room, prefill_rank, generation" if generation else "bootstrap_room, prefill_rank"
    return [
        (CONN, note_ack, note_ack + f"        pd_lifecycle.note_ack({args})  # sglang-harden backport\n"),
        (CONN, send_ack, send_ack +
         f"        if pd_lifecycle.ack_deferred(room, {resend}):\n"
         "            return  # sglang-harden backport: a failed write of this room may still land\n"),
        notice_arms_acks(notice),
    ]


ACK_EDITS_0519 = _ack_edits(NOTE_ACK_0519, SEND_ACK_0519, SEND_ACK_0519_RESEND, NOTICE_0519, generation=False)
# 0.5.19 and 0.5.20: the sender's clear() drops the room's drain-ack target even while a chunk is still being written
# (0.5.21 fixed it upstream): the worker then finds no target when the write drains and decode never gets its ack
CLEAR_ACK_TARGET_0519 = "            self.kv_mgr._deferred_ack_targets.pop(self.bootstrap_room, None)\n"
CLEAR_EDITS_0519 = [
    (CONN, CLEAR_ACK_TARGET_0519,
     "            pd_lifecycle.settle_ack_target(self.kv_mgr, self.bootstrap_room)  # sglang-harden backport\n"),
]
ACK_EDITS_0521 = _ack_edits(NOTE_ACK_0519, SEND_ACK_0519, SEND_ACK_0519_RESEND, NOTICE_0521, generation=False)
ACK_EDITS_0522 = _ack_edits(NOTE_ACK_0522, SEND_ACK_0522, SEND_ACK_0522_RESEND, NOTICE_0521, generation=True) + [
    (CONN, POISON_0522, POISON_0522 +
     "        if pd_lifecycle.note_failed_write(room):\n"
     "            return  # sglang-harden backport: keep the ACK target; the ACK waits for the write's lifetime\n"),
]


NIXL_FAILED_POST = "                self.exceptions[room] = e\n"
# A failed NIXL post (the transfer worker's exception path) may leave handles writing; 0.5.22 acks the room once NIXL
# says every handle settled, 0.5.19-0.5.21 never (the chunk stays counted). 0.5.23 "poisons" such a room instead.
NIXL_EDITS = [
    (NIXL, "from sglang.srt.disaggregation.utils import (\n", LIFECYCLE_IMPORT + "from sglang.srt.disaggregation.utils import (\n"),
    (NIXL, NIXL_FAILED_POST, NIXL_FAILED_POST +
     "                pd_lifecycle.note_failed_write(room)  # sglang-harden backport: its writes may still land\n"),
]


CAPACITY_DOOR = "        if self._check_if_req_exceed_kv_capacity(req):\n            return\n\n        if is_retracted:\n"
CAPACITY_METHOD_ANCHOR = "    def _check_if_req_exceed_kv_capacity(self, req: Req) -> bool:\n"
QUARANTINE_DOOR = ("        if not is_retracted and not is_rebootstrap and self._quarantine_full(req):\n"
                   "            return  # sglang-harden backport: at the quarantine cap\n")
QUARANTINE_DOOR_METHOD = '''    def _quarantine_full(self, req: Req) -> bool:
        """sglang-harden backport: at the quarantine cap refuse a new request (503) rather than
        let it wait on pages a late write may still land in."""
        reason = pd_lifecycle.quarantine_refusal()
        if reason is None:
            return False
        prepare_abort(req, reason, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
        return True

'''


DEFERRED_SENTENCE = " Deferred\ndecode KV release (prefill's drain acknowledgements) is turned on\non both roles."


def lifecycle_patch(indent: str, ack_edits: list, deferred_release: bool = True,
                    free_contexts: tuple = ()) -> tuple[str, str, list]:
    """The page-lifecycle patch of the 0.5.x series (``indent``: of the prealloc queue's send_metadata call;
    ``ack_edits``: the release's drain-acknowledgement functions, ACK_EDITS_0519, _0521 or _0522;
    ``deferred_release``: the release has SGLang's deferred decode KV release switch, which the patch turns on;
    ``free_contexts``: the decorators that say why SGLang frees, FREE_CONTEXTS_05xx, where the series has them)."""
    call = page_tags_publish(indent)[0]
    publish = prealloc_call(indent, "these pages are being written until the transfer commits.",
                            "pd_lifecycle.note_published", "self.token_to_kv_pool_allocator")
    header = H_LIFECYCLE.replace("<deferred>", DEFERRED_SENTENCE if deferred_release else "")
    edits = [
        (LIFECYCLEMOD, None, PD_LIFECYCLE),
        (DECODE, "from sglang.srt.environ import envs\n", LIFECYCLE_IMPORT + "from sglang.srt.environ import envs\n"),
        (DECODE, call, call + publish),
        (DECODE, DEFERRED_FLAG, DEFERRED_FLAG_ON),
        (DECODE, CAPACITY_DOOR, QUARANTINE_DOOR + CAPACITY_DOOR),
        (DECODE, CAPACITY_METHOD_ANCHOR, QUARANTINE_DOOR_METHOD + CAPACITY_METHOD_ANCHOR),
        (DECODE, POP_TRANSFERRED, POP_TRANSFERRED +
         "        pd_lifecycle.release_drained()  # sglang-harden backport: quarantined pages whose writers drained\n"),
        (DECODE, SUCCESS_COMMIT,
         "                pd_lifecycle.note_committed(decode_req.req)  # sglang-harden backport: written, no write left\n"
         + SUCCESS_COMMIT),
        (ALLOC_TOKEN, TOKEN_FREE, TOKEN_FREE +
         "        free_index = pd_lifecycle.pages_to_free(self, free_index)  # sglang-harden backport: quarantine\n"),
        (ALLOC_PAGED, PAGED_RELEASE, PAGED_RELEASE +
         "        page_ids = pd_lifecycle.page_ids_to_free(self, page_ids)  # sglang-harden backport: quarantine\n"),
        (ALLOC_TOKEN, PAGE_TAGS_IMPORT, PAGE_TAGS_IMPORT + LIFECYCLE_IMPORT),
        (ALLOC_PAGED, PAGE_TAGS_IMPORT, PAGE_TAGS_IMPORT + LIFECYCLE_IMPORT),
        (INVARIANTS, "from sglang.srt.environ import envs\n", "from sglang.srt.environ import envs\n" + LIFECYCLE_IMPORT),
        (INVARIANTS, POOL_CHECK, POOL_CHECK_HELD),
        (CONN, "from sglang.srt.disaggregation.utils import (\n",
         LIFECYCLE_IMPORT + "from sglang.srt.disaggregation.utils import (\n"),
        (CONN, DEFERRED_FLAG, DEFERRED_FLAG_ON),
        (CONN, NODE_FAILURE, NODE_FAILURE +
         "        pd_lifecycle.note_sender_gone(failed_bootstrap_addr)  # sglang-harden backport\n"),
        *ack_edits,
        (MOONCAKE, "from sglang.srt.disaggregation.utils import (\n",
         LIFECYCLE_IMPORT + "from sglang.srt.disaggregation.utils import (\n"),
        (MOONCAKE, MOONCAKE_FAILED_SEND, MOONCAKE_FAILED_SEND.replace(
            "if ret != 0:\n", "if ret != 0:\n                            pd_lifecycle.note_failed_write(kv_chunk.room)"
            "  # sglang-harden backport\n")),
        *free_contexts,
    ]
    return "page-lifecycle", header, [e for e in edits if deferred_release or e[1] != DEFERRED_FLAG]


# ---- the page lifecycle's free path judged by why SGLang frees (0.5.19+): decorators on where it frees from

FREE_CONTEXT_IMPORT = "\nimport torch\n"


def _decorated(rel: str, definition: str, decorator: str, indent: str = "    ") -> tuple[str, str, str]:
    return (rel, definition, f"{indent}@pd_lifecycle.{decorator}  # sglang-harden backport: why these frees\n"
            + definition)


def free_context_edits(release_def: str, tree_caching: str, unified_caching: str, unified_evict_for_alloc: str,
                       paged_group_end_body: str) -> list:
    """The lifecycle patch's decorators on the functions SGLang frees KV pages from (0.5.19+): ``release_def``,
    the ``def release_kv_cache(...)`` line; ``tree_caching`` / ``unified_caching``, the radix and unified caches'
    caching of an unfinished request (``cache_unfinished_req`` to 0.5.21, ``checkpoint`` from 0.5.22);
    ``unified_evict_for_alloc``, the unified cache's ``evict_for_alloc`` line; ``paged_group_end_body``, the first
    body line of the paged allocator's ``free_group_end`` (after ``super().free_group_end()``)."""
    evict = "    def evict(self, params: EvictParams) -> EvictResult:\n"
    base_begin = "    def free_group_begin(self):\n"
    base_end = "    def free_group_end(self):\n        pending, self.free_group = self.free_group, None\n"
    paged_end = "    def free_group_end(self):\n        super().free_group_end()\n" + paged_group_end_body
    imported = FREE_CONTEXT_IMPORT + "\n" + LIFECYCLE_IMPORT
    return [
        (MEM_COMMON, FREE_CONTEXT_IMPORT, imported),
        _decorated(MEM_COMMON, release_def, "releases_request", indent=""),
        (RADIX, "\nimport heapq\n", "\nimport heapq\n\n" + LIFECYCLE_IMPORT),
        _decorated(RADIX, evict, "evicts"),
        _decorated(RADIX, tree_caching, "caches_request"),
        (UNIFIED_RADIX, FREE_CONTEXT_IMPORT, imported),
        _decorated(UNIFIED_RADIX, evict, "evicts"),
        _decorated(UNIFIED_RADIX, unified_evict_for_alloc, "evicts"),
        _decorated(UNIFIED_RADIX, unified_caching, "caches_request"),
        (ALLOC_BASE, FREE_CONTEXT_IMPORT, imported),
        _decorated(ALLOC_BASE, base_begin, "begins_free_group"),
        _decorated(ALLOC_BASE, base_end, "ends_free_group"),
        _decorated(ALLOC_PAGED, paged_end, "ends_free_group"),
    ]


FREE_CONTEXTS_0519 = free_context_edits(
    "def release_kv_cache(req: Req, tree_cache: BasePrefixCache, is_insert: bool = True):\n",
    "    def cache_unfinished_req(self, req: Req, chunked=False):\n",
    "    def cache_unfinished_req(self, req: Req, chunked: bool = False, **kwargs) -> None:\n",
    "    def evict_for_alloc(self, params: EvictParams) -> EvictResult:\n",
    "        if self.free_page_reps_group:\n")
FREE_CONTEXTS_0520 = free_context_edits(
    "def release_kv_cache(req: Req, tree_cache: BasePrefixCache, is_insert: bool = True):\n",
    "    def cache_unfinished_req(self, req: Req, chunked=False):\n",
    "    def cache_unfinished_req(self, req: Req, chunked: bool = False, **kwargs) -> None:\n",
    "    def evict_for_alloc(self, params: EvictParams) -> EvictResult:\n",
    "        if self.free_page_ids_group:\n")
FREE_CONTEXTS_0522 = free_context_edits(
    "def release_kv_cache(req: Req, tree_cache: BasePrefixCache, *, checkpoint: bool):\n",
    "    def checkpoint(self, req: Req, *, up_to: int):\n",
    "    def checkpoint(self, req: Req, *, up_to: int, **kwargs) -> None:\n",
    "    def evict_for_alloc(self, params: EvictParams) -> EvictResult:\n",
    "        if self.free_page_ids_group:\n")
FREE_CONTEXTS_0523 = free_context_edits(
    "def release_kv_cache(req: Req, tree_cache: BasePrefixCache, *, checkpoint: bool):\n",
    "    def checkpoint(self, req: Req, *, up_to: int):\n",
    "    def checkpoint(self, req: Req, *, up_to: int, **kwargs) -> None:\n",
    "    def evict_for_alloc(\n",
    "        if self.free_page_ids_group:\n")


# ---- the page lifecycle on releases with no abort notice from decode (0.4.x, 0.5.10.post1): its own messages

H_LIFECYCLE_OWN_NOTICE = """\
sglang-harden backport: page lifecycle (no KV page is reused while a write into it can still land)

What: a new module mem_cache/pd_lifecycle.py (sglang-harden's own page ledger and lifecycle rules,
generated into it). Decode records the pages it hands to the transfer backend (after <handed>)
as being written for room:<bootstrap_room>, and as written once the transfer reported Success on every
rank. The token and paged allocators' free paths keep back every page still being written (an aborted
or failed transfer: quarantine) and decode sends an abort notice to every prefill rank of the room
(SGH_ABORT on the rank's bootstrap socket; this release has no abort notice of its own). Prefill drops
the room's KV chunks from then on (its transfer worker counts a chunk in flight before it looks) and
answers SGH_ABORT_ACK on decode's socket once none is in flight; after a failed engine call it holds
that answer until SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S (default 30; 0: never by itself) passed.
Quarantined pages leave in pop_transferred once every prefill rank acknowledged or the prefill node is
known gone (_handle_node_failure), never on a timeout. The idle memory check counts them as held, not
leaked. At the quarantine cap (SGLANG_HARDEN_QUARANTINE_CAP_PAGES, default a quarter of the pool)
decode refuses new requests with 503. SGLANG_HARDEN_LIFECYCLE=enforce (default) | log | off, as on a
plugin server.

Why: decode frees an aborted request's pages at once, prefill keeps writing the room (its transfer
worker never looks at an abort), and a write the engine gave up on can still land: the pages are then
another request's and the late bytes land in its KV.
Both sides must carry this patch: a decode with it holds the pages of an aborted transfer until prefill
acknowledges, which an unpatched prefill never does (the pages then come back when it is gone).
"""

RELEASE_DRAINED = ("        pd_lifecycle.release_drained()  # sglang-harden backport: quarantined pages whose "
                   "writers drained\n")


def quarantine_door_edits(stream_output: str) -> list:
    """Decode's door refuses a new request at the quarantine cap (releases without ``is_rebootstrap``)."""
    door = ("        if not is_retracted and self._quarantine_full(req):\n"
            "            return  # sglang-harden backport: at the quarantine cap\n")
    method = QUARANTINE_DOOR_METHOD.replace("self.scheduler.output_streamer.stream_output", stream_output)
    return [(DECODE, CAPACITY_DOOR, door + CAPACITY_DOOR),
            (DECODE, CAPACITY_METHOD_ANCHOR, method + CAPACITY_METHOD_ANCHOR)]


def quarantine_free_edits(allocator: str) -> list:
    """Both allocators of one module (to 0.5.12, after the page-tag patch's lines) keep quarantined pages back."""
    token_free = ("        if self.is_not_in_free_group:\n"
                  "            pd_page_tags.note_freed(self, free_index)  # sglang-harden backport\n")
    paged_free = "            free_page_indices = torch.unique(free_index // self.page_size)\n"
    return [
        (allocator, token_free, "        if self.is_not_in_free_group:\n"
         "            free_index = pd_lifecycle.pages_to_free(self, free_index)  # sglang-harden backport\n"
         + token_free.split("\n", 1)[1]),
        (allocator, paged_free, paged_free + "            (free_page_indices,) = pd_lifecycle.page_ids_to_free(\n"
         "                self, (free_page_indices,)\n            )  # sglang-harden backport: quarantine\n"),
        (allocator, PAGE_TAGS_IMPORT, PAGE_TAGS_IMPORT + LIFECYCLE_IMPORT),
    ]


def held_as_available(check: str) -> str:
    """An idle memory check whose first line reads ``available_size``: quarantined pages count as held, not leaked."""
    first, rest = check.split("\n", 1)
    indent = first[: len(first) - len(first.lstrip())]
    return (first + "\n" + indent +
            "available_size += pd_lifecycle.held_tokens()  # sglang-harden backport: held, not leaked\n" + rest)


def own_notice_mooncake_edits(import_anchor: str, worker_end: str, status_recv: tuple[str, str],
                              receiver_init: str, receiver_method_before: str) -> list:
    """The Mooncake side of the lifecycle's own abort notice and drain acknowledgement (``pd_lifecycle``'s
    ``SGH_ABORT`` / ``SGH_ABORT_ACK``): prefill's transfer worker counts a chunk before it looks whether decode aborted
    the room, its bootstrap thread takes the notice, decode's thread the acknowledgement, and the receiver sends the
    notice."""
    worker_get = "                kv_chunk: TransferKVChunk = queue.get()\n"
    notice = "                waiting_req_bytes = self.server_socket.recv_multipart()\n"
    node_failure = "    def _handle_node_failure(self, failed_bootstrap_addr):\n"
    return [
        (MOONCAKE, import_anchor, LIFECYCLE_IMPORT + import_anchor),
        (MOONCAKE, worker_get, worker_get +
         "                if pd_lifecycle.chunk_starts(self, kv_chunk.room):\n"
         "                    # sglang-harden backport: decode aborted the room; drop its chunk\n"
         "                    pd_lifecycle.chunk_done(self, kv_chunk.room)\n"
         "                    continue\n"),
        (MOONCAKE, worker_end, "                pd_lifecycle.chunk_done(self, kv_chunk.room)  # sglang-harden backport\n"
         + worker_end),
        (MOONCAKE, MOONCAKE_FAILED_SEND, MOONCAKE_FAILED_SEND.replace(
            "if ret != 0:\n", "if ret != 0:\n                            pd_lifecycle.note_failed_write(kv_chunk.room)"
            "  # sglang-harden backport\n")),
        (MOONCAKE, notice, notice + "                if pd_lifecycle.abort_notice_received(self, waiting_req_bytes):\n"
         "                    continue  # sglang-harden backport: decode aborted a room\n"),
        (MOONCAKE, *status_recv),
        (MOONCAKE, receiver_init, receiver_init + "        self.abort_notified = False  # sglang-harden backport\n"),
        (MOONCAKE, receiver_method_before,
         "    def _send_abort_notification(self):\n"
         '        """sglang-harden backport: every prefill rank of the room stops writing it and acknowledges."""\n'
         "        pd_lifecycle.send_abort_notice_frames(self)\n\n" + receiver_method_before),
        (MOONCAKE, node_failure, node_failure +
         "        pd_lifecycle.note_sender_gone(failed_bootstrap_addr)  # sglang-harden backport\n"),
    ]
