"""Patch text of the checks at decode's commit that read what prefill published: the KV digest and the
commit gate (0.5.19+)."""
from common_text import *  # noqa: F403
from lifecycle_text import POP_TRANSFERRED


H_DIGEST = """\
sglang-harden backport: per-transfer KV digest (decode commits only the bytes prefill sent)

What: new modules disaggregation/common/pd_digest.py (sglang-harden's own digest, wire format,
digest board and client, generated into it) and pd_digest_triton.py (its Triton kernel, used on CUDA
where the tree has Triton). On the last chunk, send_kv_chunk digests, per KV head,
the request's KV rows this prefill rank sends (decode's cached prefix to the end) and a background
thread posts the packed shard to the rank's own bootstrap server, which keeps a bounded board of
them (PUT /sglang_harden/digest from this host only; GET /sglang_harden/digests?room=R and the feed
GET /sglang_harden/digest_feed, authenticated by the control-plane patch's secret like every route).
Before _commit_transfer_to_req commits (after the coverage, page-tag and canary checks), decode
fetches the room's shards (waiting up to SGLANG_HARDEN_CHECKSUM_WAIT_MS, default 5000), digests the
rows at its own slots and compares per head; its TP ranks agree. A mismatch, or a publishing prefill
whose digest never arrives, aborts the request with 500. A prefill that publishes nothing (no route:
404, or its checksum off) is not compared. SGLANG_HARDEN_CHECKSUM=enforce (default) | log | off, as
on a plugin server; the routes and the digest are the plugin's, so patched and plugin nodes mix.

Why: the coverage check counts tokens, the page tags check which pages and the canary that each page
was written; none of them looks at the bytes. A transfer that delivers wrong bytes (a flipped bit, a
late write from another request landing first, source pages reused while they were read) would be
decoded as if it were this request's prompt.
Both sides must carry this patch for the check to run: a decode with it skips (logs) transfers from a
prefill without it.
"""

DIGEST_IMPORT = "from sglang.srt.disaggregation.common import pd_digest\n"
PD_DIGEST = with_bundle("pd_digest.py", ("StrEnum", "signing"))
PD_DIGEST_TRITON = with_bundle("pd_digest_triton.py", ())
COVERAGE_IMPORT_PREFILL = "from sglang.srt.disaggregation.common.pd_coverage import COVERAGE_SLOT, encode_coverage\n"
DIGEST_PUBLISH = ("            # sglang-harden backport: this rank's digest of the KV it sends (kv digest).\n"
                  "            pd_digest.publish_before_final_send(self, req, end_idx)\n")
DIGEST_CHECK_CALL = commit_refusal_block(
    "the received KV rows must digest to what prefill sent.", "digest_refusal",
    "pd_digest.refusal_at_commit(\n                decode_req.req, self.scheduler, decode_req.kv_receiver, self.gloo_group\n"
    "            )", "KV checksum")
REJECTION_ROUTES = "        pd_rejections.add_routes(self.app)  # sglang-harden backport\n"


def digest_patch(header: str = H_DIGEST, prefill: tuple[str, str] = (COVERAGE_IMPORT_PREFILL, COVERAGE_PUBLISH),
                 board: tuple[str, str] = (CONN, "from sglang.srt.disaggregation.utils import (\n"),
                 decode: tuple[str, str, str] | None = None) -> tuple[str, str, list]:
    """The KV digest patch (defaults: the 0.5.19+ series, whose commit gate runs the check). ``prefill``: the
    coverage patch's import and publish block there; ``board``: the bootstrap server's file and an import anchor in
    it; ``decode`` (series without the gate): an import anchor, the commit point and the check that goes before it."""
    coverage_import, coverage_publish = prefill
    board_file, board_import = board
    checks = []
    if decode is not None:
        decode_import, commit, check = decode
        checks = [(DECODE, decode_import, DIGEST_IMPORT + decode_import), (DECODE, commit, check + commit)]
    return ("kv-digest", header, [
        (DIGESTMOD, None, PD_DIGEST),
        (DIGEST_TRITON_MOD, None, PD_DIGEST_TRITON),
        (PREFILL, coverage_import, coverage_import + DIGEST_IMPORT),
        (PREFILL, coverage_publish, coverage_publish + DIGEST_PUBLISH),
        (board_file, board_import, DIGEST_IMPORT + board_import),
        (board_file, REJECTION_ROUTES, REJECTION_ROUTES +
         "        pd_digest.add_routes(self.app)  # sglang-harden backport: the KV digest board\n"),
        *checks,
    ])


UNGATED_DIGEST_CHECK = ("from sglang.srt.environ import envs\n", COMMIT_ANCHOR, DIGEST_CHECK_CALL)


# ---- the commit gate (0.5.19+): the checks that read GPU memory decide from copies that landed, never waiting

H_GATE = """\
sglang-harden backport: decode's commit gate (GPU checks never make the scheduler wait)

What: a new module disaggregation/pd_gate.py (sglang-harden's own commit gate, generated into
it). Where SGLang polls every receiver before the polls are all-reduced across decode's TP ranks
(_poll_with_failure_injection), a transfer that reports success first has the page-tag, canary and
KV-digest checks (the next patches' modules) start their device work: the page table row copied to
pinned memory, the canary markers looked up and the KV digested on a private stream, prefill's digest
fetched by a pool thread. It answers Transferring until every check decided from what landed on the
host (asked each scheduler pass, never waited on). A refusal fails the transfer with its reason on
that rank; the MIN all-reduce fails it on every rank, and SGLang aborts the request with 500 before
its first decode step. A transfer that reaches _commit_transfer_to_req without passing the gate (a
poll path it does not see) is judged there, waiting, and never committed unjudged.

Why: the checks read what decode's GPU holds. Reading it at the commit made the scheduler thread wait
for the stream while the next forward was in flight (a host synchronisation per request), and the
canary and digest waited for the whole device (torch.cuda.synchronize) or for prefill's digest.
"""

GATE_IMPORT = "from sglang.srt.disaggregation import pd_gate\n"
PD_GATE = with_bundle("pd_gate.py", ("StrEnum",))
POLLS_RETURN = "    return [int(poller.poll()) for poller in pollers]\n"
QUEUE_START = POP_TRANSFERRED + "        if not self.queue:\n            return []\n"
GATE_CHECK_CALL = (
    "        if not _is_fake_transfer(decode_req.req):\n"
    "            # sglang-harden backport: a transfer that did not pass the commit gate is judged now.\n"
    "            gate_refusal = pd_gate.refusal_at_commit(self, decode_req)\n"
    "            if gate_refusal is not None:\n"
    "                prepare_abort(\n"
    "                    decode_req.req,\n"
    "                    gate_refusal,\n"
    "                    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n"
    "                )\n"
    "                decode_req.kv_receiver.clear()\n"
    "                decode_req.kv_receiver = None\n"
    "                return\n\n")


def gate_patch() -> tuple[str, str, list]:
    """The commit-gate patch of the 0.5.19+ series (before the page-tag, canary and digest patches)."""
    return ("commit-gate", H_GATE, [
        (GATEMOD, None, PD_GATE),
        (UTILS, "from sglang.srt.environ import envs\n", GATE_IMPORT + "from sglang.srt.environ import envs\n"),
        (UTILS, POLLS_RETURN, "    polls = [int(poller.poll()) for poller in pollers]\n"
         "    return pd_gate.judge_polls(pollers, polls)  # sglang-harden backport: the commit gate\n"),
        (DECODE, "from sglang.srt.environ import envs\n", GATE_IMPORT + "from sglang.srt.environ import envs\n"),
        (DECODE, QUEUE_START, QUEUE_START + "        pd_gate.see_queue(self)  # sglang-harden backport: the commit gate\n"),
        (DECODE, COMMIT_ANCHOR, GATE_CHECK_CALL + COMMIT_ANCHOR),
    ])
