"""The model-shape gate and the KV guards on SGLang's real pool classes (CPU), in one process: run under a pin venv.

No speculative-decoding PD pair runs on the CPU testbed (docs/shapes.md says why), so what covers it is shown here on
the pools SGLang itself builds; the MLA pair's e2e cases (tests/e2e/test_model_shapes_e2e.py) are joined here by
the finer cases on ``MLATokenToKVPool`` (the canary and the digest read its
latent buffers: a faithful copy passes, a skipped page, an unwritten row and a flipped bit are caught), ``SWAKVPool``
and a target pool beside a draft model's (speculative decoding). The schedulers are stand-ins holding what
``compat.model_shape`` and ``compat.kv_digest`` read from a scheduler, because a real scheduler needs a model.

The gate's proof: with speculative decoding the canary stamps only the target pool, so a transfer that never wrote
the draft model's pages commits over the previous tenant's draft KV (the harm, shown with the canary armed); the
gate refuses to start that node with the canary armed, and starts it once the refused guards are off.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import kv_canary, kv_digest, model_shape  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal  # noqa: E402
from sglang_harden.compat.sglang_v05 import ROLES_BY_OWNER as ROLES  # noqa: E402
from sglang_harden.config import GUARDS, load_config  # noqa: E402
from sglang_harden.guards import checksum  # noqa: E402
from sglang_harden.guards.base import Verdict  # noqa: E402
from sglang_harden.guards.model_shape import PAGE_AND_BYTE_GUARDS, KVShape  # noqa: E402

SIZE, LAYERS, LORA, ROPE = 64, 3, 32, 16
N_TOKENS = 20
PREFILL_SLOTS = list(range(3, 3 + N_TOKENS))
DECODE_SLOTS = list(range(40, 40 + N_TOKENS))[::-1]


def _mla_pool() -> Any:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(SIZE, 1, torch.bfloat16, LORA, ROPE, LAYERS, "cpu", False)


def _mha_pool(layers: int = LAYERS) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(SIZE, 1, torch.bfloat16, 2, 16, layers, "cpu", False)


def _buffers(pool: Any) -> list[Any]:
    return list(pool.kv_buffer) if not hasattr(pool, "k_buffer") else [*pool.k_buffer, *pool.v_buffer]


def _fill(pool: Any, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    for layer in _buffers(pool):
        layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
    return pool


def _copy_rows(src: Any, dst: Any, pairs: list[tuple[int, int]]) -> None:
    for s, d in zip(_buffers(src), _buffers(dst), strict=True):
        for a, b in pairs:
            d[b] = s[a]


def _scheduler(pool: Any, slots: list[int] = (), spec: str = "NONE", attn_dp_size: int = 1) -> Any:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    req_to_token = torch.zeros((2, SIZE), dtype=torch.int32)
    req_to_token[1, : len(slots)] = torch.tensor(list(slots), dtype=torch.int32)
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 1),
        spec_algorithm=SpeculativeAlgorithm.from_string(spec),
        ps=SimpleNamespace(attn_tp_rank=0, attn_tp_size=1, attn_dp_size=attn_dp_size),
    )


@pytest.fixture(autouse=True)
def _runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_shape, "parallel_context", lambda: None)  # no SGLang runtime in this process
    monkeypatch.setattr(RUNTIME, "armed", tuple(GUARDS))
    monkeypatch.setattr(RUNTIME, "model_shape", {})
    monkeypatch.setattr(RUNTIME, "decode_kv_pool", None)


# ------------------------------------------------------------------------------ shapes read from SGLang's pools


def test_real_pools_are_read_as_their_shapes() -> None:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    swa = SWAKVPool(size=SIZE, size_swa=SIZE // 2, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16,
                    swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1], device="cpu",
                    token_to_kv_pool_class=MHATokenToKVPool)

    class PageMajorVariant(MHATokenToKVPool):  # a subclass may add buffers or change the layout
        pass

    variant = PageMajorVariant(SIZE, 1, torch.bfloat16, 2, 16, LAYERS, "cpu", False)
    assert model_shape.read_shapes(_scheduler(_mha_pool()))[0] == [KVShape.MHA]
    assert model_shape.read_shapes(_scheduler(_mla_pool()))[0] == [KVShape.MLA]
    assert model_shape.read_shapes(_scheduler(swa))[0] == [KVShape.SWA]
    shapes, details = model_shape.read_shapes(_scheduler(variant))
    assert shapes == [KVShape.UNKNOWN_POOL] and details == ["pool PageMajorVariant"]


def test_speculative_decoding_and_attention_dp_are_read() -> None:
    shapes, details = model_shape.read_shapes(_scheduler(_mla_pool(), spec="EAGLE", attn_dp_size=4))
    assert shapes == [KVShape.MLA, KVShape.SPECULATIVE, KVShape.DP_ATTENTION]
    assert details[1:] == ["speculative algorithm EAGLE", "attention-DP width 4"]


def test_unreadable_attention_dp_counts_as_attention_dp() -> None:
    scheduler = _scheduler(_mha_pool())
    del scheduler.ps
    shapes, details = model_shape.read_shapes(scheduler)
    assert KVShape.DP_ATTENTION in shapes and "attention-DP width unreadable" in details


# ------------------------------------------------------------------------------------------ MLA: the digest


def _digest(pool: Any, slots: list[int], end: int = N_TOKENS) -> Any:
    shard, reason = kv_digest.digest_rows(_scheduler(pool, slots), 1, 0, end)
    assert shard is not None, reason
    return shard


def _mla_pair(skip: int | None = None) -> tuple[Any, Any]:
    prefill, decode = _fill(_mla_pool(), 5), _fill(_mla_pool(), 9)  # decode's pages hold an earlier tenant's KV
    pairs = [p for i, p in enumerate(zip(PREFILL_SLOTS, DECODE_SLOTS, strict=True)) if i != skip]
    _copy_rows(prefill, decode, pairs)
    return prefill, decode


def test_mla_layout_is_one_replicated_latent_head() -> None:
    layout, k, v, reason = kv_digest.pool_layout(_scheduler(_mla_pool()))
    assert layout is not None, reason
    assert (layout.kv_halves, layout.total_kv_heads, layout.head_dim, layout.replicated) == (1, 1, LORA + ROPE, True)
    assert len(k) == LAYERS and v is None


def test_mla_faithful_transfer_compares_equal() -> None:
    prefill, decode = _mla_pair()
    assert checksum.compare([_digest(prefill, PREFILL_SLOTS)], _digest(decode, DECODE_SLOTS), "r").verdict \
        is Verdict.ALLOW


def test_mla_flipped_bit_aborts() -> None:
    prefill, decode = _mla_pair()
    decode.kv_buffer[LAYERS - 1][DECODE_SLOTS[7]].view(torch.uint8).reshape(-1)[5] ^= 0x10
    assert checksum.compare([_digest(prefill, PREFILL_SLOTS)], _digest(decode, DECODE_SLOTS), "r").verdict \
        is Verdict.ABORT


def test_mla_row_never_written_aborts() -> None:
    prefill, decode = _mla_pair(skip=N_TOKENS - 1)
    assert checksum.compare([_digest(prefill, PREFILL_SLOTS)], _digest(decode, DECODE_SLOTS), "r").verdict \
        is Verdict.ABORT


# ------------------------------------------------------------------------------------------ the canary


def _canary_commit(pool: Any, room: int, written: list[int], pages: list[int], others: tuple[Any, ...] = ()) -> Any:
    """Stamp ``pages`` through the real ``send_metadata`` wrapper, "transfer" into ``written`` of ``pool`` and of
    every pool in ``others`` (a draft model's), then ask the canary's commit step."""
    RUNTIME.decode_kv_pool = pool
    send = kv_canary.stamp_before_send(lambda self, kv_indices, *a, **k: None)
    send(SimpleNamespace(bootstrap_room=room), np.array(pages, dtype=np.int32), 0)
    for target in (pool, *others):
        _copy_rows(_source_like(target), target, [(p, p) for p in written])
    step = kv_canary.canary_step()
    decode_req = SimpleNamespace(req=SimpleNamespace(rid=f"canary-{room}", bootstrap_room=room))
    decision = step.decide(None, decode_req, step.launch(None, decode_req))
    assert decision is not None, "on the CPU the check lands at once"
    return decision


def _source_like(pool: Any) -> Any:
    return _fill(_mla_pool() if hasattr(pool, "kv_buffer") and not hasattr(pool, "k_buffer")
                 else _mha_pool(len(pool.k_buffer)), 11)


def test_mla_canary_passes_a_fully_written_transfer() -> None:
    pages = list(range(10, 18))
    assert _canary_commit(_mla_pool(), 601, pages, pages).allows


def test_mla_canary_catches_a_page_the_transfer_skipped() -> None:
    pages = list(range(10, 18))
    decision = _canary_commit(_mla_pool(), 602, pages[:-1], pages)
    assert decision.verdict is Verdict.ABORT and decision.fields["unwritten_pages"] == [17]


# ------------------------------------------------------------------------------------------ the gate


def test_gate_refuses_the_canary_where_it_covers_only_the_target_pool() -> None:
    pages = list(range(10, 18))
    # the canary catches a target page the transfer skipped ...
    target, draft = _mha_pool(), _fill(_mha_pool(layers=1), 21)  # the draft's pages hold an earlier tenant's KV
    assert _canary_commit(target, 701, pages[:-1], pages, others=(draft,)).verdict is Verdict.ABORT
    # ... and commits a transfer that wrote every target page and no draft page: the harm, with the canary armed
    target, draft = _mha_pool(), _fill(_mha_pool(layers=1), 21)
    earlier_tenant = draft.k_buffer[0][pages].clone()
    assert _canary_commit(target, 702, pages, pages).allows, "the canary reads only the target pool"
    assert torch.equal(draft.k_buffer[0][pages], earlier_tenant), "the draft model would attend over foreign KV"
    # the gate: that node does not start with the canary (or any page or byte guard) armed
    scheduler = _scheduler(target, spec="EAGLE")
    with pytest.raises(HardenRefusal) as refused:
        model_shape.shape_gate(scheduler, "decode", ROLES)
    message = str(refused.value)
    assert "canary on speculative" in message and "SGLANG_HARDEN_CANARY=off" in message
    assert all(f"SGLANG_HARDEN_{g.upper()}=off" in message for g in PAGE_AND_BYTE_GUARDS)
    # with them off it starts, and says what covers what
    RUNTIME.armed = tuple(g for g in GUARDS if g not in PAGE_AND_BYTE_GUARDS)
    model_shape.shape_gate(scheduler, "decode", ROLES)
    assert RUNTIME.model_shape["shapes"] == ["mha", "speculative"]
    assert RUNTIME.model_shape["guards"]["coverage"] == {"mha": "e2e", "speculative": "independent"}


def test_log_mode_starts_and_names_the_partial_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLANG_HARDEN_MODE=log refuses nothing: the gate's refusal is a counted warning there."""
    monkeypatch.setattr(RUNTIME, "config", load_config({"SGLANG_HARDEN_MODE": "log"}))
    before = events.snapshot().get("model_shape:reject_logged", 0)
    model_shape.shape_gate(_scheduler(_mla_pool(), spec="EAGLE"), "decode", ROLES)
    assert RUNTIME.model_shape["partial_in_log_mode"] == sorted(PAGE_AND_BYTE_GUARDS)
    assert events.snapshot()["model_shape:reject_logged"] == before + 1
    mixed = load_config({"SGLANG_HARDEN_MODE": "log", "SGLANG_HARDEN_LIFECYCLE": "enforce"})
    monkeypatch.setattr(RUNTIME, "config", mixed)
    with pytest.raises(HardenRefusal, match="lifecycle on speculative"):
        model_shape.shape_gate(_scheduler(_mla_pool(), spec="EAGLE"), "decode", ROLES)


def test_a_guard_that_does_not_run_in_the_role_is_not_judged() -> None:
    """page_tags and the canary run on decode only: a speculative prefill node is refused without them."""
    with pytest.raises(HardenRefusal) as refused:
        model_shape.shape_gate(_scheduler(_mla_pool(), spec="EAGLE"), "prefill", ROLES)
    message = str(refused.value)
    assert "lifecycle on speculative" in message and "checksum on speculative" in message, message
    assert "page_tags" not in message and "canary" not in message, message


@pytest.mark.parametrize("where", ["0.4.9: server_args.enable_dp_attention", "0.5.21: scheduler.enable_dp_attention",
                                   "0.5.23: server_args.attn_dp_size"])
def test_attention_dp_is_read_where_each_pin_keeps_it(where: str) -> None:
    for width, expect in ((1, []), (4, [KVShape.DP_ATTENTION])):
        scheduler = _scheduler(_mha_pool())
        del scheduler.ps
        if where.startswith("0.4.9"):
            scheduler.server_args = SimpleNamespace(enable_dp_attention=width > 1)
        elif where.startswith("0.5.21"):
            scheduler.enable_dp_attention = width > 1
        else:
            scheduler.server_args = SimpleNamespace(attn_dp_size=width, enable_dp_attention=False)
        assert model_shape.read_shapes(scheduler)[0] == [KVShape.MHA, *expect], (where, width)


def test_speculative_algorithm_read_from_server_args_where_the_scheduler_has_none() -> None:
    scheduler = _scheduler(_mha_pool())
    del scheduler.spec_algorithm
    scheduler.server_args = SimpleNamespace(speculative_algorithm=None, enable_dp_attention=False)
    assert model_shape.read_shapes(scheduler)[0] == [KVShape.MHA]
    scheduler.server_args.speculative_algorithm = "EAGLE3"
    assert model_shape.read_shapes(scheduler)[0] == [KVShape.MHA, KVShape.SPECULATIVE]


def test_gate_passes_mla_with_every_guard() -> None:
    model_shape.shape_gate(_scheduler(_mla_pool()), "decode", ROLES)
    assert RUNTIME.model_shape["guards"]["lifecycle"] == RUNTIME.model_shape["guards"]["page_tags"] == {"mla": "e2e"}
    assert RUNTIME.model_shape["guards"]["canary"] == {"mla": "e2e"}
    assert RUNTIME.model_shape["guards"]["checksum"] == {"mla": "e2e"}


def test_gate_passes_the_testbeds_shape_with_every_guard() -> None:
    model_shape.shape_gate(_scheduler(_mha_pool()), "decode", ROLES)
    assert RUNTIME.model_shape["shapes"] == ["mha"]
    assert set(RUNTIME.model_shape["guards"]) == {g for g in GUARDS if "decode" in ROLES.get(g, {"decode"})}
