from common_text import *  # noqa: F403
from commit_checks_text import *  # noqa: F403
from lifecycle_text import *  # noqa: F403
from side_channels_text import side_channels_patch

_BEFORE_THE_GUARDS = [
    ("admission-at-both-doors", H_ADMISSION, [
        (PREFILL,
         "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
         "        if not self.create_sender(req, num_kv_heads):\n"
         "            return\n"
         "        self.queue.append(req)\n",
         "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
         "        if is_aborted(req):\n"
         "            # sglang-harden backport: a request SGLang already rejected must not bootstrap.\n"
         "            self.retire_rejected(req)\n"
         "            return\n"
         "        if not self.create_sender(req, num_kv_heads):\n"
         "            return\n"
         "        self.queue.append(req)\n" + PREFILL_DOOR_METHOD),
        (DECODE,
         "        if self._check_if_req_exceed_kv_capacity(req):\n            return\n\n        if is_retracted:\n",
         DECODE_DOOR_CHECK +
         "        if self._check_if_req_exceed_kv_capacity(req):\n            return\n\n        if is_retracted:\n"),
        (DECODE,
         "    def _match_prefix_and_lock(self, req: Req) -> DecodePrefixMatch:\n",
         DECODE_DOOR_METHOD + "    def _match_prefix_and_lock(self, req: Req) -> DecodePrefixMatch:\n"),
    ]),
    ("retire-before-final-send", H_RETIRE, [
        (PREFILL,
         '        """\n        Send a prefilled chunk to the decode server\n        """\n',
         '        """\n        Send a prefilled chunk to the decode server\n        """\n'
         "        if last_chunk and is_aborted(req):\n"
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
    ("coverage-publish-and-check", H_COVERAGE, [
        (COVMOD, None, PD_COVERAGE),
        (PREFILL, "from sglang.srt.environ import envs\n",
         "from sglang.srt.disaggregation.common.pd_coverage import COVERAGE_SLOT, encode_coverage\n"
         "from sglang.srt.environ import envs\n"),
        (PREFILL,
         "        if last_chunk:\n            self.disagg_metadata_buffers.set_buf(req)\n",
         "        if last_chunk:\n            self.disagg_metadata_buffers.set_buf(req)\n" + COVERAGE_PUBLISH),
        (DECODE, "\nimport logging\n", "\nimport logging\nimport os\n"),
        (DECODE, "from sglang.srt.environ import envs\n",
         "from sglang.srt.disaggregation.common.pd_coverage import COVERAGE_SLOT, decode_coverage\n"
         "from sglang.srt.environ import envs\n"),
        (DECODE,
         "        self._commit_hicache_local_restore_to_req(decode_req)\n",
         COVERAGE_CHECK_CALL + "        self._commit_hicache_local_restore_to_req(decode_req)\n"),
        (DECODE,
         "    def _commit_transfer_to_req(self, decode_req: DecodeRequest):\n",
         COVERAGE_CHECK_METHOD + "    def _commit_transfer_to_req(self, decode_req: DecodeRequest):\n"),
    ]),
    ("notify-decode-of-prefill-rejections", H_NOTIFY, [
        (NEWMOD, None, PD_REJECTIONS),
        *TOKENIZER_NOTIFY_EDITS,
        (CONN, "from sglang.srt.disaggregation.utils import (\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.utils import (\n"),
        (CONN, '        url = f"{bootstrap_na.to_url()}/route"\n',
         '        url = f"{bootstrap_na.to_url()}/route"\n'
         "        self.bootstrap_base_url = bootstrap_na.to_url()  # sglang-harden: pd_rejections\n"),
        (CONN, "            self.waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()\n",
         "            self.waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()\n"
         "            # sglang-harden backport: learn promptly when prefill rejected a room we wait on.\n"
         "            self.rejection_watcher = pd_rejections.start_watcher(self)\n"),
        (CONN, '        self.app.router.add_get("/health", self._handle_health_check)\n',
         '        self.app.router.add_get("/health", self._handle_health_check)\n'
         "        pd_rejections.add_routes(self.app)  # sglang-harden backport\n"),
        (PREFILL, "from sglang.srt.disaggregation.common.conn import CommonKVManager\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.common.conn import CommonKVManager\n"),
        (PREFILL, "        req.finished_reason, req.to_finish = reason, None\n",
         "        req.finished_reason, req.to_finish = reason, None\n"
         "        pd_rejections.publish(self.kv_manager, req, sent_kv=False)\n"),
        (PREFILL, "            req.disagg_kv_sender.abort()\n\n    def send_kv_chunk(\n",
         "            req.disagg_kv_sender.abort()\n"
         "        pd_rejections.publish(self.disagg_prefill_bootstrap_queue.kv_manager, req)\n\n"
         "    def send_kv_chunk(\n"),
        (DECODE, "from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver\n",
         "from sglang.srt.disaggregation.common import pd_rejections\n"
         "from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver\n"),
        (DECODE,
         "                prepare_abort(\n"
         "                    decode_req.req,\n"
         "                    error_message,\n"
         "                    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n"
         "                )\n"
         "                if self.scheduler.metrics_reporter.enable_metrics:\n"
         "                    self.scheduler.metrics_collector.increment_bootstrap_failed_reqs()\n",
         DECODE_NOTIFY_ABORT +
         "                if self.scheduler.metrics_reporter.enable_metrics:\n"
         "                    self.scheduler.metrics_collector.increment_bootstrap_failed_reqs()\n"),
        (DECODE,
         "                prepare_abort(\n"
         "                    decode_req.req,\n"
         "                    error_message,\n"
         "                    status_code=HTTPStatus.INTERNAL_SERVER_ERROR,\n"
         "                )\n"
         "                self.scheduler.output_streamer.stream_output(\n",
         DECODE_NOTIFY_ABORT +
         "                self.scheduler.output_streamer.stream_output(\n"),
    ]),
    ("capacity-gate", H_CAPACITY, [
        (SCHED, ") = self.tp_worker.get_worker_info()\n",
         ") = self.tp_worker.get_worker_info()\n"
         "        self._check_kv_pool_holds_context()  # sglang-harden backport\n"),
        (SCHED, "    def init_model_worker(self):\n", CAPACITY_METHOD + "    def init_model_worker(self):\n"),
        (TOKENIZER, TOKENIZER_ANCHOR, TOKENIZER_CLAMP),
    ]),
    ("authenticate-control-plane", H_AUTH, auth_edits()),
]


def series(gated: bool) -> list:
    """The series with the commit gate (the GPU checks decide from copies that landed; the free path judged by why
    SGLang frees) or, for the older releases ported from it (0.5.18, 0.5.10.post1), with the checks at the commit."""
    return [
        *_BEFORE_THE_GUARDS,
        *([gate_patch()] if gated else []),
        page_tags_patch(" " * 12, gated),
        canary_patch(" " * 12, gated),
        lifecycle_patch(" " * 12, ACK_EDITS_0519 + CLEAR_EDITS_0519 + NIXL_EDITS, free_contexts=FREE_CONTEXTS_0519 if gated else ()),
        digest_patch() if gated else digest_patch(decode=UNGATED_DIGEST_CHECK),
    ]


PATCHES = [*series(gated=True), side_channels_patch(daemon_threads=False, polled_recv=False)]
UNGATED_PATCHES = series(gated=False)
