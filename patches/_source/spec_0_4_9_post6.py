"""0.4.9.post6: set_finish_with_abort writes finished_reason directly (no to_finish); no is_aborted();
``self.stream_output``; Mooncake has its own manager and bootstrap server; the metadata has no room, so
the coverage patch carries the room itself; decode commits inline in pop_transferred.

The page-tag, canary and digest patches run the 0.5.x series' modules unchanged; only their hooks differ:
- decode hands a request's pages to the backend in ``kv_receiver.init(page_indices, metadata_buffer_index)``
  (no send_metadata): the canary stamps before it, the ledger learns the pages after it;
- there is no ``_commit_transfer_to_req``: each check goes into pop_transferred's success branch after the
  coverage check, and a refused transfer is answered and released there as the coverage check does it;
- both allocators live in ``mem_cache/allocator.py`` and free inline in ``free`` (as on 0.5.10.post1);
- the control-plane authentication patch hooks the Mooncake manager's module (0.4.x has no common/conn.py): the
  ``requests`` it uses is the signing one, its bootstrap server checks the token on every route.
The page-lifecycle patch brings its own abort notice and drain acknowledgement (this release line has neither).
This release answers a request the scheduler failed with status 500 as HTTP 200 with no tokens (only 400 and 503
become HTTP errors): ``answer-failed-requests-with-500`` makes every refusal above an HTTP 500."""

from common_text import *  # noqa: F403
from commit_checks_text import *  # noqa: F403
from lifecycle_text import *  # noqa: F403
from side_channels_text import early_side_channels_patch


H_ADMISSION_049 = H_ADMISSION.replace(
    "(a FINISH_ABORT left in req.to_finish or req.finished_reason, e.g.",
    "(a FINISH_ABORT in req.finished_reason, e.g.",
).replace(
    "Why: in this release set_finish_with_abort only records the verdict in to_finish and swaps the prompt\n"
    "for a one-token stub; neither door reads it,",
    "Why: in this release set_finish_with_abort records the verdict in finished_reason and swaps the\n"
    "prompt for a one-token stub; neither door reads it,",
).replace("Retracted/rebootstrapping decode requests", "Retracted decode requests")

H_COVERAGE_049 = """\
sglang-harden backport: coverage check (prefill publishes what it sent; decode verifies before commit)

What: on the last chunk prefill writes into output_ids slots 13-15 of the request's metadata (spare in
this release; only slot 0 is used) the number of prompt tokens whose KV its transfer covers (tagged
0x5A in the top byte) and 62 bits of the request's bootstrap room. Decode, when a transfer reports
success in pop_transferred, aborts the request with 500 unless the room matches its own and the count
equals the prompt length it reserved pages for.

Why: nothing else checks that the KV decode is about to read was written for this request, and this
release's metadata does not even say which request it belongs to. A one-token stub, a short send or a
stale metadata row would otherwise be decoded over foreign pages.
Both sides must carry this patch. During a rolling upgrade set SGLANG_PD_COVERAGE_ALLOW_UNPUBLISHED=1 on
decode to accept transfers that carry no count (mismatching counts are always refused).
"""

H_NOTIFY_049 = H_NOTIFY.replace(
    "the bootstrap server (prefill's, which decode already queries for /route)",
    "Mooncake's bootstrap server (prefill's, which decode already queries for /route)",
).replace(
    "has its own wire format with no room for a status or message; the bootstrap server is common to all\n"
    "backends.",
    "has its own wire format with no room for a status or message. In this release only the Mooncake\n"
    "backend is covered (its manager and bootstrap server are its own).",
)

DOOR_049 = '''
    def retire_rejected(self, req: Req) -> None:
        """Answer a request rejected before admission with its original error (sglang-harden backport)."""
        self.scheduler.stream_output([req], req.return_logprob)
'''

COVERAGE_UTILS_049 = '''

# sglang-harden backport: output_ids slots 13-15 (spare) carry how many prompt tokens of KV prefill sent
# (tagged, so an unwritten 0 never reads as a count) and 62 bits of the bootstrap room they were sent for.
COVERAGE_SLOTS = (13, 14, 15)
_COVERAGE_TAG = 0x5A << 24
_COVERAGE_MASK = (1 << 24) - 1
_ROOM_MASK = (1 << 31) - 1


def encode_coverage(tokens: int, room: int) -> List[int]:
    if not 0 <= tokens <= _COVERAGE_MASK:
        raise ValueError(f"coverage {tokens} does not fit 24 bits")
    return [_COVERAGE_TAG | tokens, room & _ROOM_MASK, (room >> 31) & _ROOM_MASK]


def decode_coverage(row, room: int) -> Optional[int]:
    count, low, high = (int(row[slot].item()) for slot in COVERAGE_SLOTS)
    if low != room & _ROOM_MASK or high != (room >> 31) & _ROOM_MASK:
        return None
    return count & _COVERAGE_MASK if count & ~_COVERAGE_MASK == _COVERAGE_TAG else None
'''

COVERAGE_PUBLISH_049 = '''            # sglang-harden backport: publish how many prompt tokens this transfer covers, and for which room.
            row = self.disagg_metadata_buffers.output_ids[req.metadata_buffer_index]
            for slot, value in zip(
                COVERAGE_SLOTS, encode_coverage(end_idx, req.bootstrap_room or 0)
            ):
                row[slot] = value
'''

COVERAGE_CHECK_CALL_049 = '''                if not self._transfer_covers_prompt(decode_req, output_id):
                    indices_to_remove.add(i)
                    continue
'''

COVERAGE_CHECK_METHOD_049 = '''    def _transfer_covers_prompt(self, decode_req: DecodeRequest, output_id) -> bool:
        """sglang-harden backport: commit only if prefill sent KV for every token decode reserved."""
        req = decode_req.req
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:
            return True
        sent_tokens = decode_coverage(output_id, req.bootstrap_room or 0)
        reserved_tokens = len(req.origin_input_ids)
        if sent_tokens is None and os.environ.get("SGLANG_PD_COVERAGE_ALLOW_UNPUBLISHED") == "1":
            return True
        if sent_tokens != reserved_tokens:
            sent = "an unknown number of" if sent_tokens is None else sent_tokens
            message = (
                f"KV coverage mismatch for request {req.rid}: decode reserved "
                f"{reserved_tokens} tokens, prefill sent {sent} tokens; refusing to decode "
                "over pages this request's transfer did not write"
            )
            logger.error(message)
            prepare_abort(req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            self.scheduler.stream_output([req], req.return_logprob)
            self.tree_cache.cache_finished_req(req)
            if hasattr(decode_req.kv_receiver, "clear"):
                decode_req.kv_receiver.clear()
            return False
        return True

'''

DECODE_NOTIFY_ABORT_049 = DECODE_NOTIFY_ABORT

H_STATUS_049 = """\
sglang-harden backport: a request the scheduler failed with 500 is answered 500, not an empty 200

What: the tokenizer manager raises the scheduler's verdict as an HTTP error for a request that finished
with FINISH_ABORT and status 500 (it already does so for 400 and 503): the client gets 500 and the
scheduler's message instead of HTTP 200 with no tokens.

Why: in this release a request decode refuses - the coverage, page-tag, canary and digest checks of this
series, or a failed transfer - is answered HTTP 200 with an empty completion and the reason only in
meta_info.finish_reason. A client or router that trusts the status takes the refusal for an answer.
"""

TOKENIZER_400_049 = (
    "                    if (\n"
    "                        finish_reason.get(\"type\") == \"abort\"\n"
    "                        and finish_reason.get(\"status_code\") == HTTPStatus.BAD_REQUEST\n"
    "                    ):\n"
    "                        raise ValueError(finish_reason[\"message\"])\n"
)
TOKENIZER_500_049 = TOKENIZER_400_049 + (
    "\n"
    "                    if (\n"
    "                        finish_reason.get(\"type\") == \"abort\"\n"
    "                        and finish_reason.get(\"status_code\")\n"
    "                        == HTTPStatus.INTERNAL_SERVER_ERROR\n"
    "                    ):\n"
    "                        # sglang-harden backport: a failed request is an error, not an empty 200.\n"
    "                        raise fastapi.HTTPException(\n"
    "                            status_code=finish_reason[\"status_code\"],\n"
    "                            detail=finish_reason[\"message\"],\n"
    "                        )\n"
)

KV_INIT_049 = "            decode_req.kv_receiver.init(page_indices, decode_req.metadata_buffer_index)\n"
COMMIT_049 = "                decode_req.req.output_ids.append(output_id[0].item())\n"
ALLOCATOR_049 = ALLOC_TOKEN.rsplit("/", 1)[0] + ".py"  # mem_cache/allocator.py: both allocators
DECODE_IMPORT_049 = "from sglang.srt.mem_cache.allocator import BaseTokenToKVPoolAllocator\n"


def refusal_block_049(comment: str, variable: str, call: str, label: str) -> str:
    """A check in pop_transferred's success branch: a real transfer it refuses is answered 500 and released."""
    return (f"                # sglang-harden backport: {comment}\n"
            f"                {variable} = (\n"
            f"                    None\n"
            f"                    if decode_req.req.bootstrap_host == FAKE_BOOTSTRAP_HOST\n"
            f"                    else {call}\n"
            f"                )\n"
            f"                if {variable} is not None:\n"
            + refusal_abort_500(" " * 20, variable, label) +
            f"                    self.scheduler.stream_output(\n"
            f"                        [decode_req.req], decode_req.req.return_logprob\n"
            f"                    )\n"
            f"                    self.tree_cache.cache_finished_req(decode_req.req)\n"
            f"                    if hasattr(decode_req.kv_receiver, \"clear\"):\n"
            f"                        decode_req.kv_receiver.clear()\n"
            f"                    indices_to_remove.add(i)\n"
            f"                    continue\n")


H_PAGE_TAGS_049 = (H_PAGE_TAGS
                   .replace("(after send_metadata, any\nbackend: ", "(after kv_receiver.init:\n")
                   .replace("before _commit_transfer_to_req commits a transfer (after the coverage check)",
                            "before pop_transferred commits a transfer (after the coverage check)")
                   .replace(" (its cached prefix: written),", " (decode matches\nno prefix in this release),"))
H_CANARY_049 = (H_CANARY
                .replace("transfer backend (send_metadata, any backend)", "transfer backend (kv_receiver.init)")
                .replace("Before _commit_transfer_to_req commits", "Before pop_transferred commits"))
H_DIGEST_049 = H_DIGEST.replace("Before _commit_transfer_to_req commits", "Before pop_transferred commits")


H_AUTH_049 = (H_AUTH
              .replace("(every route except /health: /route,\n  /register_dp_rank, /query_dp_ranks, /pd_rejections, reads included)",
                       "(every route except /health: /route,\n  /pd_rejections and the digest board, reads included)")
              .replace("every request common/conn.py and pd_rejections send", "every request mooncake/conn.py, pd_rejections and pd_digest send"))
assert H_AUTH_049.count("mooncake/conn.py") == 1 and "/query_dp_ranks" not in H_AUTH_049


def auth_patch_049() -> tuple[str, str, list]:
    """The 0.5.x authentication patch on 0.4.x's Mooncake manager and bootstrap server (their own module)."""
    rejections = "from sglang.srt.disaggregation.common import pd_rejections\n"
    logger_line = "\nlogger = logging.getLogger(__name__)\n"
    return ("authenticate-control-plane", H_AUTH_049, [
        (AUTHMOD, None, PD_AUTH),
        (MOONCAKE, rejections, "from sglang.srt.disaggregation.common import pd_auth, pd_rejections\n"),
        (MOONCAKE, logger_line, logger_line +
         "# sglang-harden backport: every request this module sends to a bootstrap server is signed.\n"
         "requests = pd_auth.signing(requests)\n"),
        (MOONCAKE, REJECTION_ROUTES,
         REJECTION_ROUTES + "        # sglang-harden backport: a token for this server on every route but /health (0.4.x binds\n"
         "        # every address: no host of its own)\n"
         "        pd_auth.protect(self.app, None, self.port)\n"),
        *[edit for edit in auth_edits() if edit[0] == NEWMOD],
        (MOONCAKE, AUTH_STATUS_ANCHOR, AUTH_STATUS_AGAIN),
        *SERVER_INFO_EDITS,
    ])


def page_tags_patch_049() -> tuple[str, str, list]:
    publish = prealloc_call(" " * 12, "the ledger learns whose pages the transfer writes.",
                            "pd_page_tags.note_published", "self.token_to_kv_pool_allocator")
    check = refusal_block_049(
        "decode only over pages this request's own transfer wrote.", "page_tag_refusal",
        "pd_page_tags.refusal_at_commit(\n                        decode_req.req,\n"
        "                        self.scheduler.req_to_token_pool.req_to_token,\n                    )",
        "page ownership")
    token_free = ("        if self.is_not_in_free_group:\n"
                  "            self.release_pages = torch.cat((self.release_pages, free_index))\n")
    paged_free = "            free_page_indices = torch.unique(free_index // self.page_size)\n"
    utils_import = "from sglang.srt.utils import get_bool_env_var, next_power_of_2\n"
    return ("page-ownership-tags", H_PAGE_TAGS_049, [
        (PAGETAGMOD, None, PD_PAGE_TAGS),
        (DECODE, DECODE_IMPORT_049, PAGE_TAGS_IMPORT + DECODE_IMPORT_049),
        (DECODE, KV_INIT_049, KV_INIT_049 + publish),
        (DECODE, COMMIT_049, check + COMMIT_049),
        (ALLOCATOR_049, token_free, "        if self.is_not_in_free_group:\n"
         "            pd_page_tags.note_freed(self, free_index)  # sglang-harden backport\n"
         + token_free.split("\n", 1)[1]),
        (ALLOCATOR_049, paged_free,
         paged_free + "            pd_page_tags.note_freed(self, free_page_indices)  # sglang-harden backport\n"),
        (ALLOCATOR_049, utils_import, PAGE_TAGS_IMPORT + utils_import),
    ])


def canary_patch_049() -> tuple[str, str, list]:
    stamp = prealloc_call(" " * 12, "stamp the pages before their indices leave (kv canary).",
                          "pd_canary.stamp_before_send", "self.token_to_kv_pool_allocator.get_kvcache()")
    check = refusal_block_049(
        "a reserved page still holding its canary was never written.", "canary_refusal",
        "pd_canary.refusal_at_commit(decode_req.req, self.gloo_group)", "canary")
    return ("kv-canary", H_CANARY_049, [
        (CANARYMOD, None, PD_CANARY),
        (DECODE, DECODE_IMPORT_049, CANARY_IMPORT + DECODE_IMPORT_049),
        (DECODE, KV_INIT_049, stamp + KV_INIT_049),
        (DECODE, COMMIT_049, check + COMMIT_049),
    ])


def lifecycle_patch_049() -> tuple[str, str, list]:
    publish = prealloc_call(" " * 12, "these pages are being written until the transfer commits.",
                            "pd_lifecycle.note_published", "self.token_to_kv_pool_allocator")
    get_buf = "                ) = self.metadata_buffers.get_buf(idx)\n\n"
    pop = "    def pop_transferred(self) -> List[Req]:\n"
    memory_check = ("            _, _, available_size, evictable_size = self._get_token_info()\n"
                    "            protected_size = self.tree_cache.protected_size()\n")
    status = ("                (bootstrap_room, status, prefill_rank) = (\n"
              "                    self.server_socket.recv_multipart()\n                )\n")
    status_new = ("                frames = self.server_socket.recv_multipart()\n"
                  "                if pd_lifecycle.ack_frames_received(frames):\n"
                  "                    continue  # sglang-harden backport: a prefill rank's drain acknowledgement\n"
                  "                (bootstrap_room, status, prefill_rank) = frames\n")
    receiver_init = ("        self.bootstrap_room = bootstrap_room\n        self.bootstrap_addr = bootstrap_addr\n"
                     "        self.kv_mgr = mgr\n")
    return ("page-lifecycle", H_LIFECYCLE_OWN_NOTICE.replace("<handed>", "kv_receiver.init"), [
        (LIFECYCLEMOD, None, PD_LIFECYCLE),
        (DECODE, DECODE_IMPORT_049, LIFECYCLE_IMPORT + DECODE_IMPORT_049),
        (DECODE, KV_INIT_049, KV_INIT_049 + publish),
        *quarantine_door_edits("self.scheduler.stream_output"),
        (DECODE, pop, pop + RELEASE_DRAINED),
        (DECODE, get_buf, get_buf + "                # sglang-harden backport: Success on every rank, no write left\n"
         "                pd_lifecycle.note_committed(decode_req.req)\n"),
        *quarantine_free_edits(ALLOCATOR_049),
        (SCHED, "from sglang.srt.managers.schedule_batch import (\n",
         LIFECYCLE_IMPORT + "from sglang.srt.managers.schedule_batch import (\n"),
        (SCHED, memory_check, held_as_available(memory_check)),
        *own_notice_mooncake_edits(
            import_anchor="from sglang.srt.disaggregation.common.utils import (\n",
            worker_end=("                if (\n                    kv_chunk.room not in self.request_status\n"
                        "                    or self.check_status(kv_chunk.room) == KVPoll.Success\n"),
            status_recv=(status, status_new), receiver_init=receiver_init,
            receiver_method_before="    def _get_bootstrap_info_from_server(self, engine_rank, target_dp_group):\n"),
    ])


def digest_patch_049() -> tuple[str, str, list]:
    check = refusal_block_049(
        "the received KV rows must digest to what prefill sent.", "digest_refusal",
        "pd_digest.refusal_at_commit(\n                        decode_req.req,\n"
        "                        self.scheduler,\n                        decode_req.kv_receiver,\n"
        "                        self.gloo_group,\n                    )", "KV checksum")
    coverage_import = "from sglang.srt.disaggregation.utils import COVERAGE_SLOTS, encode_coverage\n"
    return digest_patch(H_DIGEST_049, (coverage_import, COVERAGE_PUBLISH_049),
                        (MOONCAKE, "from sglang.srt.disaggregation.common.utils import (\n"),
                        (DECODE_IMPORT_049, COMMIT_049, check))


PATCHES = [
    ("admission-at-both-doors", H_ADMISSION_049, [
        (PREFILL, "from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch\n",
         "from sglang.srt.managers.schedule_batch import (\n    FINISH_ABORT,\n    FINISH_LENGTH,\n"
         "    Req,\n    ScheduleBatch,\n)\n"),
        (PREFILL,
         "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
         "        if self._check_if_req_exceed_kv_capacity(req):\n",
         "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
         "        if isinstance(req.finished_reason, FINISH_ABORT):\n"
         "            # sglang-harden backport: a request SGLang already rejected must not bootstrap.\n"
         "            self.retire_rejected(req)\n"
         "            return\n"
         "        if self._check_if_req_exceed_kv_capacity(req):\n"),
        (PREFILL, "    def extend(self, reqs: List[Req], num_kv_heads: int) -> None:\n",
         DOOR_049.lstrip("\n") + "\n    def extend(self, reqs: List[Req], num_kv_heads: int) -> None:\n"),
        (DECODE,
         '        """Add a request to the pending queue."""\n'
         "        if self._check_if_req_exceed_kv_capacity(req):\n",
         '        """Add a request to the pending queue."""\n'
         "        if not is_retracted and isinstance(req.finished_reason, FINISH_ABORT):\n"
         "            # sglang-harden backport: a request SGLang already rejected gets no receiver and no KV.\n"
         "            self.scheduler.stream_output([req], req.return_logprob)\n"
         "            return\n"
         "        if self._check_if_req_exceed_kv_capacity(req):\n"),
    ]),
    ("retire-before-final-send", H_RETIRE.replace(
        "(to_finish or\nfinished_reason is FINISH_ABORT)", "(finished_reason is\nFINISH_ABORT)"), [
        (PREFILL,
         '        """\n        Send a prefilled chunk to the decode server\n        """\n',
         '        """\n        Send a prefilled chunk to the decode server\n        """\n'
         "        if last_chunk and isinstance(req.finished_reason, FINISH_ABORT):\n"
         "            # sglang-harden backport: never report an aborted request's KV as complete.\n"
         "            self.retire_before_final_send(req)\n"
         "            return\n"),
        (PREFILL,
         "    def send_kv_chunk(\n",
         "    def retire_before_final_send(self: Scheduler, req: Req) -> None:\n"
         '        """Fail the sender of an aborted request instead of sending its last chunk (sglang-harden)."""\n'
         "        if req.disagg_kv_sender is not None:\n"
         "            req.disagg_kv_sender.abort()\n\n"
         "    def send_kv_chunk(\n"),
    ]),
    ("coverage-publish-and-check", H_COVERAGE_049, [
        (UTILS, "\n\nclass MetadataBuffers:\n", COVERAGE_UTILS_049 + "\n\nclass MetadataBuffers:\n"),
        (PREFILL, "from sglang.srt.managers.schedule_batch import (\n",
         "from sglang.srt.disaggregation.utils import COVERAGE_SLOTS, encode_coverage\n"
         "from sglang.srt.managers.schedule_batch import (\n"),
        (PREFILL,
         "        if last_chunk:\n            self.disagg_metadata_buffers.set_buf(req)\n",
         "        if last_chunk:\n            self.disagg_metadata_buffers.set_buf(req)\n" + COVERAGE_PUBLISH_049),
        (DECODE, "\nimport logging\n", "\nimport logging\nimport os\n"),
        (DECODE, "from sglang.srt.managers.schedule_batch import FINISH_ABORT, ScheduleBatch\n",
         "from sglang.srt.disaggregation.utils import decode_coverage\n"
         "from sglang.srt.managers.schedule_batch import FINISH_ABORT, ScheduleBatch\n"),
        (DECODE,
         "                ) = self.metadata_buffers.get_buf(idx)\n\n"
         "                decode_req.req.output_ids.append(output_id[0].item())\n",
         "                ) = self.metadata_buffers.get_buf(idx)\n\n" + COVERAGE_CHECK_CALL_049 +
         "                decode_req.req.output_ids.append(output_id[0].item())\n"),
        (DECODE, "    def pop_transferred(self) -> List[Req]:\n",
         COVERAGE_CHECK_METHOD_049 + "    def pop_transferred(self) -> List[Req]:\n"),
    ]),
    ("answer-failed-requests-with-500", H_STATUS_049, [(TOKENIZER, TOKENIZER_400_049, TOKENIZER_500_049)]),
    ("notify-decode-of-prefill-rejections", H_NOTIFY_049, [
        (NEWMOD, None, PD_REJECTIONS),
        (TOKENIZER, "from sglang.srt.disaggregation.utils import (\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.utils import (\n"),
        *TOKENIZER_NOTIFY_EDITS[1:],
        (MOONCAKE, "from sglang.srt.disaggregation.common.utils import (\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.common.utils import (\n"),
        (MOONCAKE, '        url = f"http://{bootstrap_server_url}/route"\n        payload = {\n            "role": "Prefill",\n',
         '        url = f"http://{bootstrap_server_url}/route"\n'
         '        self.bootstrap_base_url = f"http://{bootstrap_server_url}"  # sglang-harden: pd_rejections\n'
         '        payload = {\n            "role": "Prefill",\n'),
        (MOONCAKE,
         '            self.waiting_timeout = get_int_env_var(\n'
         '                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300\n            )\n',
         '            self.waiting_timeout = get_int_env_var(\n'
         '                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300\n            )\n'
         "            # sglang-harden backport: learn promptly when prefill rejected a room we wait on.\n"
         "            self.rejection_watcher = pd_rejections.start_watcher(self)\n"),
        (MOONCAKE,
         '        self.app.router.add_route("*", "/route", self._handle_route)\n'
         '        self.app.router.add_get("/health", self._handle_health_check)\n',
         '        self.app.router.add_route("*", "/route", self._handle_route)\n'
         '        self.app.router.add_get("/health", self._handle_health_check)\n'
         "        pd_rejections.add_routes(self.app)  # sglang-harden backport\n"),
        (PREFILL, "from sglang.srt.disaggregation.utils import (\n    FAKE_BOOTSTRAP_HOST,\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.utils import (\n    FAKE_BOOTSTRAP_HOST,\n"),
        (PREFILL, "        self.scheduler.stream_output([req], req.return_logprob)\n\n    def extend(",
         "        self.scheduler.stream_output([req], req.return_logprob)\n"
         "        pd_rejections.publish(self.kv_manager, req, sent_kv=False)\n\n    def extend("),
        (PREFILL, "            req.disagg_kv_sender.abort()\n\n    def send_kv_chunk(\n",
         "            req.disagg_kv_sender.abort()\n"
         "        pd_rejections.publish(self.disagg_prefill_bootstrap_queue.kv_manager, req)\n\n"
         "    def send_kv_chunk(\n"),
        (DECODE, "from sglang.srt.disaggregation.utils import (\n    FAKE_BOOTSTRAP_HOST,\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.utils import (\n    FAKE_BOOTSTRAP_HOST,\n"),
        (DECODE,
         "                logger.error(error_message)\n"
         "                prepare_abort(\n"
         "                    decode_req.req,\n"
         "                    error_message,\n"
         "                    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n"
         "                )\n"
         "            else:\n",
         "                logger.error(error_message)\n" + DECODE_NOTIFY_ABORT_049 + "            else:\n"),
        (DECODE,
         "                logger.error(error_message)\n"
         "                prepare_abort(\n"
         "                    decode_req.req,\n"
         "                    error_message,\n"
         "                    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n"
         "                )\n"
         "                self.scheduler.stream_output(\n",
         "                logger.error(error_message)\n" + DECODE_NOTIFY_ABORT_049 +
         "                self.scheduler.stream_output(\n"),
    ]),
    ("capacity-gate", H_CAPACITY, [
        (SCHED, ") = self.tp_worker.get_worker_info()\n",
         ") = self.tp_worker.get_worker_info()\n"
         "        self._check_kv_pool_holds_context()  # sglang-harden backport\n"),
        (SCHED, "    def init_tokenizer(self):\n", CAPACITY_METHOD + "    def init_tokenizer(self):\n"),
        (TOKENIZER, TOKENIZER_ANCHOR, TOKENIZER_CLAMP),
    ]),
    auth_patch_049(),
    page_tags_patch_049(),
    canary_patch_049(),
    lifecycle_patch_049(),
    digest_patch_049(),
    early_side_channels_patch(
        (MOONCAKE, "from sglang.srt.disaggregation.common import pd_auth, pd_rejections\n",
         "from sglang.srt.disaggregation.common import pd_auth, pd_rejections, pd_side_channels\n"),
        bind="        self.server_socket.bind(format_tcp_address(self.local_ip, self.rank_port))\n",
        manager_rel=MOONCAKE,
        listeners=[(MOONCAKE, "bootstrap_thread", ")"), (MOONCAKE, "decode_thread", ")")],
        staging=False),
]
