"""SGLang's internal names, spelled once: the modules sglang-harden hooks, reads or patches, and the choke points
that more than one part names (the plugin's hook tables, doctor's detectors, the backport series' target files).

Nothing here imports SGLang. A test (``tests/unit/test_internals.py``) fails when an SGLang module path is spelled
anywhere else in the package, or when a ``Class.method`` is spelled both in ``compat/`` and in ``tools/``: a rename
upstream is then one edit here, and the hook, the detector and the patch move together.
"""

from __future__ import annotations

SRT = "sglang.srt"

# modules
PD = f"{SRT}.disaggregation"
PREFILL = f"{PD}.prefill"
DECODE = f"{PD}.decode"
UTILS = f"{PD}.utils"
CONN = f"{PD}.common.conn"
MOONCAKE = f"{PD}.mooncake.conn"
NIXL = f"{PD}.nixl.conn"
MORI = f"{PD}.mori.conn"
STAGING_HANDLER = f"{PD}.common.staging_handler"  # the staging buffer's prefetch (0.5.19+)
SCHEDULER = f"{SRT}.managers.scheduler"
SCHEDULE_BATCH = f"{SRT}.managers.schedule_batch"
TOKENIZER = f"{SRT}.managers.tokenizer_manager"
INVARIANTS = f"{SRT}.managers.scheduler_components.invariant_checker"
RUNTIME_CHECKER = f"{SRT}.managers.scheduler_runtime_checker_mixin"  # the idle memory check before INVARIANTS
ALLOC_TOKEN = f"{SRT}.mem_cache.allocator.token"
ALLOC_PAGED = f"{SRT}.mem_cache.allocator.paged"
ALLOC_ONE_MODULE = f"{SRT}.mem_cache.allocator"  # both allocators, before the 0.5.13 split
ALLOC_BASE = f"{SRT}.mem_cache.allocator.base"
MEM_COMMON = f"{SRT}.mem_cache.common"
RADIX = f"{SRT}.mem_cache.radix_cache"
UNIFIED_RADIX = f"{SRT}.mem_cache.unified_radix_cache"  # the default tree cache of 0.5.19+
ENVIRON = f"{SRT}.environ"
SERVER_ARGS = f"{SRT}.server_args"
ARG_GROUPS = f"{SRT}.arg_groups"
KV_CANARY_MODULES = ("sglang.kernels.ops.kv_canary", f"{SRT}.kv_canary")  # upstream's own canary, where it has one


def backend_module(backend: str) -> str:
    """The connection module of a transfer backend package (``mooncake``, ``nixl``, ``mori``, ...)."""
    return f"{PD}.{backend}.conn"


def source_file(module: str) -> str:
    """``module``'s file inside a source tree (``sglang/srt/.../x.py``), as the backport series name it."""
    return module.replace(".", "/") + ".py"


# choke points: (module, qualified name)
PREFILL_DOOR = (PREFILL, "PrefillBootstrapQueue.add")
DECODE_DOOR = (DECODE, "DecodePreallocQueue.add")
COMMIT = (DECODE, "DecodeTransferQueue._commit_transfer_to_req")
TOKEN_FREE = (ALLOC_TOKEN, "TokenToKVPoolAllocator.free")
PAGED_RELEASE = (ALLOC_PAGED, "PagedTokenToKVPoolAllocator._release_page_ids")
POP_TRANSFERRED = (DECODE, "DecodeTransferQueue.pop_transferred")  # 0.4.x also commits in it (no COMMIT)
TOKEN_FREE_ONE_MODULE = (ALLOC_ONE_MODULE, "TokenToKVPoolAllocator.free")
PAGED_FREE_ONE_MODULE = (ALLOC_ONE_MODULE, "PagedTokenToKVPoolAllocator.free")  # frees inline (no _release_page_ids)
SETUP_ROUTES = (CONN, "CommonKVBootstrapServer._setup_routes")
# the bootstrap server class (module, name): the common one, or on 0.4.x (no common/conn.py) Mooncake's own
BOOTSTRAP_SERVERS = ((CONN, "CommonKVBootstrapServer"), (MOONCAKE, "MooncakeKVBootstrapServer"))
NOTE_ABORT_ACK = (CONN, "CommonKVManager.note_abort_ack")
SEND_ABORT_NOTICE = (CONN, "CommonKVReceiver._send_abort_notification")  # decode's abort notice to prefill
# where the rank port is bound (the ZMQ side channels), and decode's socket to a prefill rank port; 0.4.x's Mooncake
# has its own manager and receiver classes
RANK_PORT_BINDS = ((CONN, "CommonKVManager.__init__"), (MOONCAKE, "MooncakeKVManager._bind_server_socket"))
RECEIVER_CONNECTS = ((CONN, "CommonKVReceiver._connect"), (MOONCAKE, "MooncakeKVReceiver._connect"))
SIDE_CHANNELS_BACKPORT = f"{PD}.common.pd_side_channels"  # the backport series' module
PP_CONSENSUS = f"{PD}.pp_consensus_store"  # 0.5.22+: PP rank 0's status store, fed over ZMQ by the other PP ranks
SET_FINISH_WITH_ABORT = (SCHEDULE_BATCH, "Req.set_finish_with_abort")
# where SGLang polls every KV receiver before the polls are all-reduced across decode's TP ranks (0.5.19+)
POLL_RECEIVERS = (UTILS, "_poll_with_failure_injection")
# the backport series' modules whose checks run at decode's commit gate (the series' own modules, in SGLang's tree)
GATED_CHECK_MODULES = {"page_tags": f"{SRT}.mem_cache.pd_page_tags", "canary": f"{PD}.common.pd_canary",
                       "checksum": f"{PD}.common.pd_digest"}
# the backport series' modules that carry sglang-harden's kernels/device.py (the testbed's CUDA simulator tells them
# which tensors stand for device tensors)
PATCHED_DEVICE_MODULES = (*GATED_CHECK_MODULES.values(), f"{SRT}.mem_cache.pd_lifecycle")
