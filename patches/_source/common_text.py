"""Shared patch text (headers and code blocks) of the series: the guards at the doors, coverage, rejections, capacity,
control-plane authentication, page tags and the canary; the lifecycle's is in ``lifecycle_text``, the digest's and
the commit gate's in ``commit_checks_text``, the side channels' in ``side_channels_text``."""
import importlib.util
from pathlib import Path
from types import ModuleType

from series_text import series_stamp, server_info_edits

EMBED_MARK = "# ---- embedded in the backport series from here on\n"
REPO = Path(__file__).resolve().parents[2]


def _embedded(rel: str) -> str:
    """The part of an sglang-harden module below its embed mark (stdlib-only code the patches share with it)."""
    text = (REPO / rel).read_text()
    return text.split(EMBED_MARK, 1)[1].strip() + "\n"


def with_embeds(name: str, embeds: tuple[str, ...]) -> str:
    """``patches/_source/<name>`` with the plugin's own shared code put in at its ``# <embed FILE>`` lines."""
    text = (Path(__file__).resolve().parent / name).read_text()
    for rel in embeds:
        mark = f"# <embed {rel}>\n"
        assert text.count(mark) == 1, f"{name} lost its embed mark for {rel}"
        text = text.replace(mark, f"# (from sglang-harden's {Path(rel).name}: the plugin runs the same code)\n"
                            + _embedded(rel))
    assert "# <embed " not in text, f"{name} has an embed mark nobody fills"
    return text


PD_REJECTIONS = with_embeds("pd_rejections.py", ("sglang_harden/channels/abort_wire.py",))
PD_COVERAGE = with_embeds("pd_coverage.py", ("sglang_harden/channels/coverage_wire.py",))
def with_bundle(name: str, provided: tuple[str, ...]) -> str:
    """``patches/_source/<name>`` with the backport prelude (``_prelude.py``: mode switch, StrEnum) at its
    ``# <prelude>`` line and sglang-harden's own modules bundled in at its ``# <bundle FILE ...>`` line
    (``bundle.py``); ``provided``: names the text above the mark defines for them."""
    from bundle import bundle

    here = Path(__file__).resolve().parent
    text = (here / name).read_text().replace("# <prelude>\n", (here / "_prelude.py").read_text())
    marks = [line for line in text.splitlines() if line.startswith("# <bundle ")]
    assert len(marks) == 1, f"{name} needs exactly one bundle mark"
    paths = tuple(marks[0][len("# <bundle "):-1].split())
    return text.replace(marks[0] + "\n", bundle(paths, provided))


PD_AUTH = with_bundle("pd_auth.py", ("StrEnum",)).replace("# <series stamp>\n", series_stamp())

def _internals() -> ModuleType:
    """sglang-harden's one description of SGLang's names (``compat/internals.py``), loaded by path: the series
    name the same files the plugin hooks, without importing the plugin."""
    spec = importlib.util.spec_from_file_location("_sglang_internals", REPO / "sglang_harden/compat/internals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_SG = _internals()
PREFILL = _SG.source_file(_SG.PREFILL)
DECODE = _SG.source_file(_SG.DECODE)
UTILS = _SG.source_file(_SG.UTILS)
CONN = _SG.source_file(_SG.CONN)
NEWMOD = _SG.source_file(f"{_SG.PD}.common.pd_rejections")
AUTHMOD = _SG.source_file(f"{_SG.PD}.common.pd_auth")
COVMOD = _SG.source_file(f"{_SG.PD}.common.pd_coverage")
SCHED = _SG.source_file(_SG.SCHEDULER)
TOKENIZER = _SG.source_file(_SG.TOKENIZER)
MOONCAKE = _SG.source_file(_SG.MOONCAKE)
NIXL = _SG.source_file(_SG.NIXL)
PAGETAGMOD = _SG.source_file(f"{_SG.SRT}.mem_cache.pd_page_tags")
CANARYMOD = _SG.source_file(f"{_SG.PD}.common.pd_canary")
LIFECYCLEMOD = _SG.source_file(f"{_SG.SRT}.mem_cache.pd_lifecycle")
INVARIANTS = _SG.source_file(_SG.INVARIANTS)
RUNTIME_CHECKER = _SG.source_file(_SG.RUNTIME_CHECKER)
DIGESTMOD = _SG.source_file(f"{_SG.PD}.common.pd_digest")
DIGEST_TRITON_MOD = _SG.source_file(f"{_SG.PD}.common.pd_digest_triton")
GATEMOD = _SG.source_file(f"{_SG.PD}.pd_gate")  # not in common/: disaggregation/utils.py imports it
MEM_COMMON = _SG.source_file(_SG.MEM_COMMON)
RADIX = _SG.source_file(_SG.RADIX)
UNIFIED_RADIX = _SG.source_file(_SG.UNIFIED_RADIX)
ALLOC_BASE = _SG.source_file(_SG.ALLOC_BASE)
ALLOC_TOKEN = _SG.source_file(_SG.ALLOC_TOKEN)
ALLOC_PAGED = _SG.source_file(_SG.ALLOC_PAGED)

H_ADMISSION = """\
sglang-harden backport: admission at both PD doors

What: PrefillBootstrapQueue.add and DecodePreallocQueue.add answer a request that SGLang already
rejected (a FINISH_ABORT left in req.to_finish or req.finished_reason, e.g. "Input length ... exceeds
the maximum allowed length") with that original error and status (400 for too long), before any
bootstrap, sender/receiver, metadata buffer or KV allocation.

Why: in this release set_finish_with_abort only records the verdict in to_finish and swaps the prompt
for a one-token stub; neither door reads it, so the stub bootstraps, prefill sends KV for one token and
reports the transfer complete, and decode (which reserved pages for the whole prompt) decodes over
pages that still hold another request's KV. Retracted/rebootstrapping decode requests carry their own
KV and pass through unchanged.
"""

H_RETIRE = """\
sglang-harden backport: retire an aborted prefill result before the final KV send

What: send_kv_chunk(last_chunk=True) for a request that is already aborted (to_finish or
finished_reason is FINISH_ABORT) fails the request's KV sender instead of writing its metadata and
sending its last chunk; the inflight queue then sees the sender failed and releases the request
through SGLang's normal failure path.

Why: the final send is what tells decode "transfer complete". For an aborted request that is a lie:
decode would commit pages that were never (fully) written for it.
"""

H_COVERAGE = """\
sglang-harden backport: coverage check (prefill publishes what it sent; decode verifies before commit)

What: on the last chunk prefill writes into cached_tokens slot 15 of the request's metadata (spare in
this release; slots 0-6 are used) the number of prompt tokens whose KV its transfer covers (end of the
last sent range, decode's cached prefix included), marked and tagged with the request's bootstrap room
(new module common/pd_coverage.py, sglang-harden's own encoding) so that an unwritten slot (0) or a value
left by another room reads as "not published". Decode, in _commit_transfer_to_req after the existing bootstrap-room
check (which already binds the metadata row to this request), aborts the request with 500 unless that
count equals the prompt length it reserved pages for.

Why: nothing else checks that the KV decode is about to read was written for this request. A one-token
stub, --allow-auto-truncate, or any short send would otherwise be decoded over stale pages.
Both sides must carry this patch: a decode with it refuses transfers from a prefill without it.
During a rolling upgrade set SGLANG_PD_COVERAGE_ALLOW_UNPUBLISHED=1 on decode to accept transfers
that carry no count (mismatching counts are always refused).
"""

H_NOTIFY = """\
sglang-harden backport: tell decode promptly when prefill rejects a request

What: a new module sglang/srt/disaggregation/common/pd_rejections.py, used in four places:
- the bootstrap server (prefill's, which decode already queries for /route) gains PUT/GET
  /pd_rejections, a bounded, expiring board of rejected bootstrap rooms with status and message;
- prefill posts a room there when it retires a rejected or aborted request at its door or before
  the final send (background thread; the scheduler never waits on HTTP), and when its tokenizer
  refuses the prompt before any scheduler sees it (the tokenizer manager serves the board itself);
- decode's KV manager polls that route (default every 0.25 s, SGLANG_PD_REJECTION_POLL_INTERVAL,
  0 = off) for the rooms it still waits on and marks a hit Failed in its own status table, so the
  request leaves through SGLang's ordinary transfer-failure path and its pages are released;
- decode's failure paths answer with prefill's own status and message (e.g. 400 "Input length ...
  exceeds the maximum allowed length") instead of a generic 500.

Why: a request rejected at prefill never gets a KV sender, so no transfer backend ever tells decode.
Decode holds the reserved pages and waits SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s), then 500s;
through a router the client never sees prefill's 400. The transfer backends' own failure messages
were not used because the rejected room may have no transfer state at prefill yet and each backend
has its own wire format with no room for a status or message; the bootstrap server is common to all
backends. Like /route, the new route is unauthenticated unless the series' control-plane authentication
patch is applied too (0.5.x series): then both need a token.
"""

# prefill's tokenizer posts the prompts it refuses itself (they never reach a scheduler door)
TOKENIZER_NOTIFY_EDITS = [
    (TOKENIZER, "from sglang.srt.disaggregation.utils import DisaggregationMode\n",
     "from sglang.srt.disaggregation.common import pd_rejections\n"
     "from sglang.srt.disaggregation.utils import DisaggregationMode\n"),
    (TOKENIZER, "    async def _tokenize_one_request(\n",
     "    @pd_rejections.front_door_refusals_async  # sglang-harden backport\n"
     "    async def _tokenize_one_request(\n"),
    (TOKENIZER, "    def _validate_one_request(\n",
     "    @pd_rejections.front_door_refusals  # sglang-harden backport\n"
     "    def _validate_one_request(\n"),
]

H_CAPACITY = """\
sglang-harden backport: capacity gate (refuse to start when the KV pool cannot hold the context)

What: at scheduler start-up, after the pool is sized, if the pool holds fewer tokens than the
configured context length the scheduler refuses to start with both numbers and the flags that fix
it. SGLANG_HARDEN_CAPACITY=clamp starts with the context lowered to what the pool holds, in the
scheduler and in the tokenizer manager (which advertises it and checks prompts against it);
log starts anyway with a warning (off: silently). The same settings as the sglang-harden plugin's.

Why: SGLang then advertises a context it cannot serve; its real limit (max_req_input_len) is derived
from the pool. In PD serving the two sides differ, so a prompt passes one side and is stubbed on the
other - the precondition of the KV leak the other patches close.
"""

H_AUTH = """\
sglang-harden backport: authenticate the PD control plane (bootstrap server and its clients)

What: a new module sglang/srt/disaggregation/common/pd_auth.py. With a shared secret file named by
SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE on every prefill and decode process:
- the bootstrap server answers 401 to any request (every route except /health: /route,
  /register_dp_rank, /query_dp_ranks, /pd_rejections, reads included) without a valid token in
  X-SGLang-Harden-Auth: an HMAC-SHA256 over method, Host (the host:port the client addressed), path and
  query, body hash, timestamp and nonce, for a Host that names this server (SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES
  lists other names); stale tokens (SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S, default 60) and replayed nonces
  are refused, all before the body is read;
- every request common/conn.py and pd_rejections send to a bootstrap server is signed, and an answer the
  server did not sign for that request is not used (it reaches the caller as a failed exchange);
- the file may hold a second accepted secret (rotation without downtime) and is re-read on change;
- SGLANG_HARDEN_BOOTSTRAP_AUTH=log logs refusals and serves; off disables; enforce without a secret
  file, or an unusable file, refuses to start. No secret file: one WARNING, nothing checked.
The wire format (sgh2) and the code are the sglang-harden plugin's: patched and plugin nodes of a
deployment interoperate. SGLANG_HARDEN_BOOTSTRAP_AUTH_ACCEPT_SGH1=1 also accepts the older sgh1 tokens
(no Host binding) while a fleet rolls out.
The module also carries the series' settings check (SGLANG_HARDEN_MODE; a name no sglang-harden reads
refuses to start), the sglang-harden release that generated the series, logged at start, exported as
sglang_harden_build_info on /metrics and added to the scheduler's /server_info state (sglang_harden).

Why: anyone who reaches the bootstrap port can otherwise register as a rank for a room (and receive or
redirect another tenant's KV), or post and read rejection notices. No SGLang release authenticates it.
"""

PREFILL_DOOR_METHOD = '''
    def retire_rejected(self, req: Req) -> None:
        """Answer a request rejected before admission with its original error (sglang-harden backport)."""
        reason = req.to_finish if isinstance(req.to_finish, FINISH_ABORT) else req.finished_reason
        prepare_abort(req, reason.message, status_code=reason.status_code)
        req.finished_reason, req.to_finish = reason, None
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)
'''

DECODE_DOOR_METHOD = '''    def _retire_rejected(self, req: Req) -> None:
        """Answer a request rejected before admission with its original error (sglang-harden backport)."""
        reason = req.to_finish if isinstance(req.to_finish, FINISH_ABORT) else req.finished_reason
        prepare_abort(req, reason.message, status_code=reason.status_code)
        req.finished_reason, req.to_finish = reason, None
        self.scheduler.output_streamer.stream_output([req], req.return_logprob)

'''

DECODE_DOOR_CHECK = '''        if (
            not is_retracted
            and not is_rebootstrap
            and (
                isinstance(req.to_finish, FINISH_ABORT)
                or isinstance(req.finished_reason, FINISH_ABORT)
            )
        ):
            # sglang-harden backport: a request SGLang already rejected gets no receiver and no KV.
            self._retire_rejected(req)
            return
'''

COVERAGE_PUBLISH = '''            # sglang-harden backport: publish how many prompt tokens this transfer covers.
            self.disagg_metadata_buffers.cached_tokens[req.metadata_buffer_index][
                COVERAGE_SLOT
            ] = encode_coverage(end_idx, req.bootstrap_room or 0)
'''

COVERAGE_CHECK_CALL = '''        if not _is_fake_transfer(decode_req.req) and not self._transfer_covers_prompt(
            decode_req, cached_tokens
        ):
            return

'''

COVERAGE_CHECK_METHOD = '''    def _transfer_covers_prompt(self, decode_req: DecodeRequest, cached_tokens) -> bool:
        """sglang-harden backport: commit only if prefill sent KV for every token decode reserved."""
        sent_tokens = decode_coverage(
            int(cached_tokens[COVERAGE_SLOT].item()), decode_req.req.bootstrap_room or 0
        )
        reserved_tokens = len(decode_req.req.origin_input_ids)
        if sent_tokens is None and os.environ.get("SGLANG_PD_COVERAGE_ALLOW_UNPUBLISHED") == "1":
            return True
        if sent_tokens != reserved_tokens:
            sent = "an unknown number of" if sent_tokens is None else sent_tokens
            message = (
                f"KV coverage mismatch for request {decode_req.req.rid}: decode reserved "
                f"{reserved_tokens} tokens, prefill sent {sent} tokens; refusing to decode "
                "over pages this request's transfer did not write"
            )
            logger.error(message)
            prepare_abort(
                decode_req.req, message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR
            )
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None
            return False
        return True

'''

TOKENIZER_ANCHOR = '''    """TokenizerManager is a process that tokenizes the text."""
'''

TOKENIZER_CLAMP = TOKENIZER_ANCHOR + '''
    # sglang-harden backport: SGLANG_HARDEN_CAPACITY=clamp. The scheduler lowered its context to what its KV
    # pool holds; when this process learns the pool-bound input limit it lowers the context it advertises and
    # checks prompts against to the same value.
    @property
    def max_req_input_len(self):
        return self.__dict__.get("_harden_max_req_input_len")

    @max_req_input_len.setter
    def max_req_input_len(self, value):
        self.__dict__["_harden_max_req_input_len"] = value
        if value is None or os.environ.get("SGLANG_HARDEN_CAPACITY", "").strip().lower() != "clamp":
            return
        fitting = int(value) + 6  # the margin SGLang subtracts from the pool (as in the scheduler's capacity gate)
        if fitting < self.model_config.context_len:
            logger.warning(
                f"KV pool holds less than the context: advertised context {self.context_len} -> {fitting} "
                f"(SGLANG_HARDEN_CAPACITY=clamp)"
            )
            self.model_config.context_len = fitting
            self.context_len = fitting
'''

CAPACITY_METHOD = '''    def _check_kv_pool_holds_context(self) -> None:
        """sglang-harden backport: refuse to start when the KV pool cannot hold the context length."""
        margin = 6  # SGLang's max_req_input_len = min(context - 1, pool - 1) - 5
        context_len = self.model_config.context_len
        if self.max_total_num_tokens >= context_len:
            return
        mode = (os.environ.get("SGLANG_HARDEN_CAPACITY", "").strip().lower()
                or os.environ.get("SGLANG_HARDEN_MODE", "").strip().lower() or "enforce")
        message = (
            f"KV pool too small for the configured context: the pool holds "
            f"{self.max_total_num_tokens} tokens, context_len={context_len}, so prompts over "
            f"max_req_input_len={self.max_req_input_len} tokens are rejected although the server "
            f"advertises {context_len}. Raise --max-total-tokens or --mem-fraction-static, or lower "
            f"--context-length to {self.max_total_num_tokens}; SGLANG_HARDEN_CAPACITY=clamp lowers the "
            f"context to what fits, SGLANG_HARDEN_CAPACITY=log starts anyway."
        )
        if mode == "off":
            return
        if mode == "log":
            logger.warning(message)
            return
        if mode == "clamp" and self.max_req_input_len > 0:
            fitting = self.max_req_input_len + margin
            logger.warning(f"{message} Clamping context_len {context_len} -> {fitting} (SGLANG_HARDEN_CAPACITY=clamp).")
            self.model_config.context_len = fitting
            return
        raise RuntimeError(message)

'''

DECODE_NOTIFY_ABORT = '''                # sglang-harden backport: a room prefill rejected fails with prefill's own verdict.
                error_message, status_code = pd_rejections.decode_abort(
                    decode_req.kv_receiver,
                    decode_req.req.bootstrap_room,
                    error_message,
                    HTTPStatus.INTERNAL_SERVER_ERROR,
                )
                prepare_abort(decode_req.req, error_message, status_code=status_code)
'''


SERVER_INFO_EDITS = server_info_edits(SCHED)


def auth_edits() -> list:
    """The authentication patch (0.5.x): the new module, the signing client, the checking server."""
    return [
        (AUTHMOD, None, PD_AUTH),
        (CONN, "from sglang.srt.disaggregation.common import pd_rejections\n",
         "from sglang.srt.disaggregation.common import pd_auth, pd_rejections\n"),
        (CONN, "\nlogger = logging.getLogger(__name__)\n",
         "\nlogger = logging.getLogger(__name__)\n"
         "# sglang-harden backport: every request this module sends to a bootstrap server is signed.\n"
         "requests = pd_auth.signing(requests)\n"),
        (CONN, "        pd_rejections.add_routes(self.app)  # sglang-harden backport\n",
         "        pd_rejections.add_routes(self.app)  # sglang-harden backport\n"
         "        # sglang-harden backport: a token for this server on every route but /health\n"
         "        pd_auth.protect(self.app, self.host, self.port)\n"),
        (NEWMOD, "from typing import Any, Dict, List, Optional, Tuple\n",
         "from typing import Any, Dict, List, Optional, Tuple\n\n"
         "from sglang.srt.disaggregation.common import pd_auth\n"),
        *REJECTION_CLIENT_EDITS,
        *SERVER_INFO_EDITS,
    ]


# pd_rejections' clients sign for the bootstrap server they address and use an answer only when it was signed for
# their request (pd_auth.trusted_body raises an OSError, which both callers already treat as a failed exchange).
REJECTION_CLIENT_EDITS = [
    (NEWMOD,
     '    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": '
     '"application/json"})\n',
     '    signed = {"Content-Type": "application/json", **pd_auth.headers("PUT", pd_auth.url_authority(url), ROUTE, body)}\n'
     '    request = urllib.request.Request(url, data=body, method="PUT", headers=signed)\n'),
    (NEWMOD, "            return response.status == 200\n",
     "            pd_auth.trusted_body(request, response, 1 << 20)\n"
     "            return response.status == 200\n"),
    (NEWMOD,
     '        url = f"http://{addr}" + rooms_target(rooms)\n',
     "        target = rooms_target(rooms)\n"
     '        url = urllib.request.Request(f"http://{addr}{target}", headers=pd_auth.headers("GET", addr, target, b""))\n'),
    (NEWMOD, "                found, malformed = parse_board_answer(json.loads(response.read(1 << 20)))\n",
     "                answer = pd_auth.trusted_body(url, response, 1 << 20)\n"
     "                found, malformed = parse_board_answer(json.loads(answer))\n"),
]


# pd_auth logs "authenticated" when it is imported. Releases up to 0.5.10 import it (through their conn module and the
# tokenizer manager) before any of their processes configures logging, so that INFO line was lost on a real pair
# (measured on 0.5.10.post1: the logs had the refusals but never said the control plane was authenticated). Every
# KV manager says it again once logging is up.
AUTH_STATUS_ANCHOR = "        self.request_status: Dict[int, KVPoll] = {}\n"
AUTH_STATUS_AGAIN = AUTH_STATUS_ANCHOR + """\
        # sglang-harden backport: pd_auth was imported before this process configured logging; say it here.
        if pd_auth.AUTH is not None:
            logger.info(
                "pd_auth: PD control plane authenticated (%s mode, %d secret(s))",
                pd_auth.AUTH.mode,
                len(pd_auth.AUTH.accepted()),
            )
"""


H_PAGE_TAGS = """\
sglang-harden backport: page ownership tags (decode reads only pages its own transfer wrote)

What: decode keeps a ledger of its KV pages - owner, reservation, state - in a new module
mem_cache/pd_page_tags.py (sglang-harden's own page ledger and page-tag check, generated into it).
The prealloc queue records the pages it hands to the transfer backend (after send_metadata, any
backend: owner room:<bootstrap_room>, being written); the token and paged allocators' free paths mark
pages free again; before _commit_transfer_to_req commits a transfer (after the coverage check), the
transfer's pages become written and every prompt page of the request's page table must be owned by
that very reservation and written (its cached prefix: written), else the request is aborted with 500.
SGLANG_HARDEN_PAGE_TAGS=enforce (default) | log | off, as on a plugin server.

Why: the incident's victims decoded over pages another request's KV was still in. The coverage check
counts tokens; this checks which pages: a page table that points at a page the request does not own
(a free page, another request's, a reservation that was never written) is refused instead of decoded.
"""

PAGE_TAGS_IMPORT = "from sglang.srt.mem_cache import pd_page_tags\n"


def prealloc_call(indent: str, comment: str, function: str, first_arg: str) -> str:
    """A backport's call next to the prealloc queue's ``send_metadata``: ``function(first_arg, receiver, pages)``."""
    return (f"{indent}# sglang-harden backport: {comment}\n{indent}{function}(\n"
            f"{indent}    {first_arg}, decode_req.kv_receiver, page_indices\n{indent})\n")


def page_tags_publish(indent: str) -> tuple[str, str]:
    """(anchor, replacement) after the prealloc queue's ``send_metadata`` call, indented as the pin has it."""
    call = (f"{indent}decode_req.kv_receiver.send_metadata(\n{indent}    page_indices,\n"
            f"{indent}    decode_req.metadata_buffer_index,\n{indent}    state_indices,\n"
            f"{indent}    **metadata_kwargs,\n{indent})\n")
    return call, call + prealloc_call(indent, "the ledger learns whose pages the transfer writes.",
                                      "pd_page_tags.note_published", "self.token_to_kv_pool_allocator")


def refusal_abort_500(indent: str, variable: str, label: str) -> str:
    """``prepare_abort`` of ``decode_req.req`` with 500, the guard's refusal ``variable`` as the message."""
    return (f"{indent}prepare_abort(\n{indent}    decode_req.req,\n"
            f"{indent}    \"sglang-harden {label} check failed: \" + {variable},\n"
            f"{indent}    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n{indent})\n")


def commit_refusal_block(comment: str, variable: str, call: str, label: str) -> str:
    """Decode's commit refuses a real transfer the guard refuses: abort with 500, drop the receiver, return."""
    return (f"        if not _is_fake_transfer(decode_req.req):\n"
            f"            # sglang-harden backport: {comment}\n"
            f"            {variable} = {call}\n"
            f"            if {variable} is not None:\n"
            + refusal_abort_500(" " * 16, variable, label) +
            f"                decode_req.kv_receiver.clear()\n"
            f"                decode_req.kv_receiver = None\n"
            f"                return\n\n")


PAGE_TAGS_CHECK_CALL = commit_refusal_block(
    "decode only over pages this request's own transfer wrote.", "page_tag_refusal",
    "pd_page_tags.refusal_at_commit(\n                decode_req.req, self.scheduler.req_to_token_pool.req_to_token\n"
    "            )", "page ownership")

COMMIT_ANCHOR = "        self._commit_hicache_local_restore_to_req(decode_req)\n"
TOKEN_FREE = ("    def free(self, free_index: torch.Tensor):\n        if free_index.numel() == 0:\n"
              "            return\n")
PAGED_RELEASE = "    def _release_page_ids(self, *page_ids: torch.Tensor):\n"
PD_PAGE_TAGS = with_bundle("pd_page_tags.py", ("NOT_HANDLED", "DONE", "LedgerOps", "ledger_library", "StrEnum"))


def page_tags_patch(indent: str, gated: bool = True) -> tuple[str, str, list]:
    """The page-tag patch of the 0.5.x series (``indent``: of the prealloc queue's send_metadata call; ``gated``:
    the series has the commit gate, which runs the check; else it runs at the commit)."""
    anchor, replacement = page_tags_publish(indent)
    check = [] if gated else [(DECODE, COMMIT_ANCHOR, PAGE_TAGS_CHECK_CALL + COMMIT_ANCHOR)]
    return ("page-ownership-tags", H_PAGE_TAGS, [
        (PAGETAGMOD, None, PD_PAGE_TAGS),
        (DECODE, "from sglang.srt.environ import envs\n", PAGE_TAGS_IMPORT + "from sglang.srt.environ import envs\n"),
        (DECODE, anchor, replacement),
        *check,
        (ALLOC_TOKEN, TOKEN_FREE, TOKEN_FREE + "        pd_page_tags.note_freed(self, free_index)  # sglang-harden backport\n"),
        (ALLOC_PAGED, PAGED_RELEASE, PAGED_RELEASE + "        pd_page_tags.note_freed(self, *page_ids)  # sglang-harden backport\n"),
        (ALLOC_TOKEN, "import torch\n", "import torch\n\n" + PAGE_TAGS_IMPORT),
        (ALLOC_PAGED, "import torch\n", "import torch\n\n" + PAGE_TAGS_IMPORT),
    ])


H_CANARY = """\
sglang-harden backport: KV canary (decode commits only pages its transfer wrote)

What: a new module disaggregation/common/pd_canary.py (sglang-harden's own canary: markers, check and
decision, generated into it). Right before the prealloc queue hands a request's destination pages to
the transfer backend (send_metadata, any backend), decode writes a fresh 64-bit marker into the first
token row of each page, in the first layer's K and the last layer's V buffer. A transfer writes whole
pages, so it erases every marker of a page it wrote. Before _commit_transfer_to_req commits (after the
coverage and page-tag checks), a page whose slot still holds its marker was never written: the request
is aborted with 500. Decode's TP ranks each check their shard and agree (any refusal aborts on all).
SGLANG_HARDEN_CANARY=enforce (default) | log | off, as on a plugin server.

Why: a transfer that reports success without writing every reserved page (a backend bug, a truncated
send, a skipped page) leaves the previous owner's KV in the request's pages - the incident's stale page.
The coverage check trusts prefill's count and the page tags trust the backend's success; the canary
looks at the memory itself.
"""

CANARY_IMPORT = "from sglang.srt.disaggregation.common import pd_canary\n"

CANARY_CHECK_CALL = commit_refusal_block(
    "a reserved page still holding its canary was never written.", "canary_refusal",
    "pd_canary.refusal_at_commit(decode_req.req, self.gloo_group)", "canary")
PD_CANARY = with_bundle("pd_canary.py", ("StrEnum",))


def canary_patch(indent: str, gated: bool = True) -> tuple[str, str, list]:
    """The canary patch of the 0.5.x series (``indent``: of the prealloc queue's send_metadata call; ``gated``: the
    series has the commit gate, which runs the check; else it runs at the commit)."""
    call = page_tags_publish(indent)[0]
    stamp = prealloc_call(indent, "stamp the pages before their indices leave (kv canary).",
                          "pd_canary.stamp_before_send", "self.token_to_kv_pool_allocator.get_kvcache()")
    check = [] if gated else [(DECODE, COMMIT_ANCHOR, CANARY_CHECK_CALL + COMMIT_ANCHOR)]
    return ("kv-canary", H_CANARY, [
        (CANARYMOD, None, PD_CANARY),
        (DECODE, "from sglang.srt.environ import envs\n", CANARY_IMPORT + "from sglang.srt.environ import envs\n"),
        (DECODE, call, stamp + call),
        *check,
    ])
