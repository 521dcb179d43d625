"""0.5.10.post1: the 0.5.19 series ported to the 0.5.6-0.5.12 code (read off the 0.5.10.post1 wheel).

Every patch of the 0.5.19 series is kept (the page lifecycle as its own version, ``lifecycle_patch_0510``): 0.5.10.post1 has none of their protections (no
door checks, no retirement of aborted prefill results, no coverage check, no rejection notice, no capacity gate, no
control-plane authentication, no page tags, no canary, no KV digest). What differs from 0.5.19, and why each change:
- set_finish_with_abort writes ``to_finish`` as on 0.5.19, but ``disaggregation/utils.py is_aborted`` does not
  exist before 0.5.13: prefill.py gets a local one (same test: FINISH_ABORT in to_finish or finished_reason).
- ``PrefillBootstrapQueue.add`` builds its sender inline (no ``create_sender``); the door check goes first.
- Output goes through ``self.scheduler.stream_output`` (``output_streamer`` is 0.5.13+); metrics through
  ``self.scheduler.enable_metrics`` (no ``metrics_reporter``).
- ``DecodePreallocQueue.add(req, is_retracted)`` has no ``is_rebootstrap``: the decode door check drops that
  clause (it would be a NameError on the first request).
- Decode's commit ``_commit_transfer_to_req`` returns a bool here ("remove from the transfer queue"); a refused
  transfer must return True like upstream's own bootstrap-room mismatch does. A bare ``return`` (None) would keep a
  request whose receiver was just cleared in the queue, and the next poll would die on it. The checks go right
  before upstream's "Case 3: Success" commit (no ``_commit_hicache_local_restore_to_req`` yet), after the
  bootstrap-room check, and ``_is_fake_transfer`` takes the server args (as on 0.5.18).
- The metadata row's ``cached_tokens`` is (size, 16) int32 with slots 0-3 used: slot 15 is spare, as the coverage
  patch needs.
- The prealloc queue's ``send_metadata(page_indices, metadata_buffer_index, state_indices)`` takes no kwargs, and
  both KV allocators live in one file, ``mem_cache/allocator.py``; the paged allocator frees pages inline in
  ``free`` (no ``_release_page_ids``), so the page ledger is told there, outside a free group (a group's pages come
  back through ``free`` at ``free_group_end``).
- Decode has no prefix matching here (``_match_prefix_and_lock`` is 0.5.16+): its door method goes before
  ``_resolve_prefill_dp_rank``; the page-tag check sees no cached prefix.
- The bootstrap server, the KV manager's status table and ``addr_to_rooms_tracker`` (what the rejection notice and
  the authentication patch hook) are the same as on 0.5.19; ``common/conn.py`` imports only DisaggregationMode from
  disaggregation.utils.
- pd_auth's "authenticated" INFO line, logged when the module is imported, comes before this release configures
  logging in any process and was lost: each KV manager logs it again (see common_text.AUTH_STATUS_AGAIN).
"""
from common_text import *  # noqa: F403
from commit_checks_text import *  # noqa: F403
from lifecycle_text import *  # noqa: F403
from side_channels_text import MORI as MORI_CONN, early_side_channels_patch
import spec_0_5_19 as base

COMMIT_0510 = "        # Case 3: Success - commit the transfer\n"
SEND_METADATA_0510 = ("            decode_req.kv_receiver.send_metadata(\n"
                      "                page_indices, decode_req.metadata_buffer_index, state_indices\n"
                      "            )\n")
ALLOCATOR_0510 = ALLOC_TOKEN.rsplit("/", 1)[0] + ".py"  # mem_cache/allocator.py: one module before the 0.5.13 split

IS_ABORTED_0510 = '''

def is_aborted(req: Req) -> bool:
    """sglang-harden backport (disaggregation.utils.is_aborted from 0.5.13 on): SGLang recorded an abort on req."""
    return isinstance(req.to_finish, FINISH_ABORT) or isinstance(req.finished_reason, FINISH_ABORT)
'''

# text substitutions every edit of the 0.5.19 series needs on this release's code
RENAMES = (
    ("self.scheduler.output_streamer.stream_output", "self.scheduler.stream_output"),
    ("self.scheduler.metrics_reporter.enable_metrics", "self.scheduler.enable_metrics"),
    ("_is_fake_transfer(decode_req.req)", "_is_fake_transfer(decode_req.req, self.scheduler.server_args)"),
    ("            and not is_rebootstrap\n", ""),
    ("    def _match_prefix_and_lock(self, req: Req) -> DecodePrefixMatch:\n",
     "    def _resolve_prefill_dp_rank(self, req: Req) -> Optional[int]:\n"),
    ("    def _commit_transfer_to_req(self, decode_req: DecodeRequest):\n",
     "    def _commit_transfer_to_req(self, decode_req: DecodeRequest) -> bool:\n"),
    ("from sglang.srt.disaggregation.utils import (\n",
     "from sglang.srt.disaggregation.utils import DisaggregationMode\n"),
)


def _port(text):
    if text is None:
        return None
    for old, new in RENAMES:
        text = text.replace(old, new)
    return text


def _commit_edit(old: str, new: str) -> tuple[str, str]:
    """An edit that puts a check before 0.5.19's commit point: before 0.5.10's, refusing with ``return True``."""
    assert old == COMMIT_ANCHOR and new.endswith(COMMIT_ANCHOR), old
    check = new[: -len(COMMIT_ANCHOR)]
    for bare in ("            return\n\n", "                return\n\n"):
        check = check.replace(bare, bare.replace("return\n", "return True\n"))
    assert "return\n" not in check.replace("return True\n", ""), check
    return COMMIT_0510, check + COMMIT_0510


def _edit(rel: str, old, new) -> tuple | None:
    """One 0.5.19 edit as it applies here (None: not needed on this release)."""
    if rel == DECODE and old == COMMIT_ANCHOR:
        old, new = _commit_edit(old, new)
        return rel, old, _port(new)
    if rel == DECODE and old == page_tags_publish(" " * 12)[0]:
        # this release's send_metadata takes no kwargs: same text around the call, the 0.5.10 call itself
        before, after = new.split(old, 1)
        return rel, SEND_METADATA_0510, before + SEND_METADATA_0510 + after
    if rel == ALLOC_TOKEN and old == TOKEN_FREE:  # TOKEN_FREE occurs twice here: anchor inside the token allocator
        anchor = ("        if self.is_not_in_free_group:\n            if self.need_sort:\n"
                  "                self.release_pages = torch.cat((self.release_pages, free_index))\n")
        head = "        if self.is_not_in_free_group:\n"
        return (ALLOCATOR_0510, anchor,
                head + "            pd_page_tags.note_freed(self, free_index)  # sglang-harden backport\n"
                + anchor[len(head):])
    if rel == ALLOC_PAGED and old == PAGED_RELEASE:
        anchor = "            free_page_indices = torch.unique(free_index // self.page_size)\n"
        return (ALLOCATOR_0510, anchor,
                anchor + "            pd_page_tags.note_freed(self, free_page_indices)  # sglang-harden backport\n")
    if rel == ALLOC_TOKEN and old == "import torch\n":
        return None  # one file holds both allocators: one import (below)
    if rel == ALLOC_PAGED and old == "import torch\n":
        anchor = "from sglang.srt.utils import get_bool_env_var, get_num_new_pages, next_power_of_2\n"
        return ALLOCATOR_0510, anchor, PAGE_TAGS_IMPORT + anchor
    return rel, _port(old), _port(new)


def _admission_prefill(edit: tuple) -> tuple:
    rel, old, new = edit
    if rel != PREFILL or "def add(self, req: Req, num_kv_heads: int)" not in (old or ""):
        return edit
    door = ("        if is_aborted(req):\n"
            "            # sglang-harden backport: a request SGLang already rejected must not bootstrap.\n"
            "            self.retire_rejected(req)\n"
            "            return\n")
    assert door in new and PREFILL_DOOR_METHOD in new, "0.5.19's prefill door changed"
    add = "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
    return [
        (PREFILL, "\nlogger = logging.getLogger(__name__)\n",
         "\nlogger = logging.getLogger(__name__)\n" + IS_ABORTED_0510),
        (PREFILL, add + "        if self._check_if_req_exceed_kv_capacity(req):\n",
         add + door + "        if self._check_if_req_exceed_kv_capacity(req):\n"),
        (PREFILL, "        self._process_req(req)\n        self.queue.append(req)\n",
         "        self._process_req(req)\n        self.queue.append(req)\n" + _port(PREFILL_DOOR_METHOD)),
    ]


def _patch(name: str, header: str, edits: list) -> tuple:
    out = []
    for edit in edits:
        ported = _admission_prefill(edit)
        if isinstance(ported, list):
            out.extend(ported)
            continue
        new_edit = _edit(*edit)
        if new_edit is not None:
            out.append(new_edit)
    return name, _port_header(header), out


def _port_header(header: str) -> str:
    return (header
            .replace("Retracted/rebootstrapping decode requests", "Retracted decode requests")
            .replace("this release; slots 0-6 are used)", "this release; slots 0-3 are used)"))


def _with_auth_status(patch: tuple) -> tuple:
    name, header, edits = patch
    if name != "authenticate-control-plane":
        return patch
    return name, header, [*edits, (CONN, AUTH_STATUS_ANCHOR, AUTH_STATUS_AGAIN)]




def lifecycle_patch_0510() -> tuple[str, str, list]:
    """0.5.10.post1 has no abort notice from decode and no drain acknowledgement (both came later): the lifecycle
    brings its own, as on 0.4.x (``pd_lifecycle``'s ``SGH_ABORT`` / ``SGH_ABORT_ACK``). Its decode hooks are the
    0.5.19 ones on 0.5.10's code; the staging path's deferred chunks are counted per pass."""
    publish = prealloc_call(" " * 12, "these pages are being written until the transfer commits.",
                            "pd_lifecycle.note_published", "self.token_to_kv_pool_allocator")
    commit = "                should_remove = self._commit_transfer_to_req(decode_req)\n"
    memory_check = ("        _, _, available_size, evictable_size = self._get_token_info()\n"
                    "        protected_size = self.tree_cache.protected_size()\n"
                    "        session_held = self._session_held_tokens()\n")
    status = "                msg = self.server_socket.recv_multipart()\n"
    envs_import = "from sglang.srt.environ import envs\n"
    return ("page-lifecycle", H_LIFECYCLE_OWN_NOTICE.replace("<handed>", "send_metadata"), [
        (LIFECYCLEMOD, None, PD_LIFECYCLE),
        (DECODE, envs_import, LIFECYCLE_IMPORT + envs_import),
        (DECODE, SEND_METADATA_0510, SEND_METADATA_0510 + publish),
        *quarantine_door_edits("self.scheduler.stream_output"),
        (DECODE, POP_TRANSFERRED, POP_TRANSFERRED + RELEASE_DRAINED),
        (DECODE, commit, "                # sglang-harden backport: Success on every rank, no write left\n"
         "                pd_lifecycle.note_committed(decode_req.req)\n" + commit),
        *quarantine_free_edits(ALLOCATOR_0510),
        (RUNTIME_CHECKER, envs_import, envs_import + LIFECYCLE_IMPORT),
        (RUNTIME_CHECKER, memory_check, held_as_available(memory_check)),
        *own_notice_mooncake_edits(
            import_anchor="from sglang.srt.disaggregation.utils import (\n",
            worker_end="                if staging_deferred:\n                    continue\n",
            status_recv=(status, status + "                if pd_lifecycle.ack_frames_received(msg):\n"
                         "                    continue  # sglang-harden backport: a prefill rank's drain acknowledgement\n"),
            receiver_init=("        self.session_id = mgr.get_session_id()\n        self.init_time = None\n"
                           "        super().__init__(mgr, bootstrap_addr, bootstrap_room)\n"),
            receiver_method_before="    def _register_kv_args(self):\n"),
    ])


# The page lifecycle of the 0.5.19 series rests on drain acknowledgements this release does not have: its own
# version (lifecycle_patch_0510) takes that patch's place.
PATCHES = [lifecycle_patch_0510() if name == "page-lifecycle" else _with_auth_status(_patch(name, header, list(edits)))
           for name, header, edits in base.UNGATED_PATCHES]
PATCHES.append(early_side_channels_patch(
    (CONN, "from sglang.srt.disaggregation.common import pd_auth, pd_rejections\n",
     "from sglang.srt.disaggregation.common import pd_auth, pd_rejections, pd_side_channels\n"),
    bind=("        self.rank_port, self.server_socket = get_zmq_socket_on_host(\n"
          "            context, zmq.PULL, host=self.local_ip\n        )\n"),
    manager_rel=CONN,
    listeners=[(MOONCAKE, "bootstrap_thread", ")"), (MOONCAKE, "decode_thread", ")"), (NIXL, "bootstrap_thread", ")"),
               (MORI_CONN, "bootstrap_worker", ", daemon=True)"), (MORI_CONN, "decode_worker", ", daemon=True)")],
    staging=True))
