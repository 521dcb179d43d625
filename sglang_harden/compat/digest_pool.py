"""Where a scheduler's KV rows are and how its TP ranks agree: this rank's KV layout and buffers
(:func:`pool_layout`, from SGLang's pool and the rank's attention-TP coordinates) and the transport the checksum
guard's ranks exchange their outcomes over (:class:`TorchGroupTransport`). Shared by the plugin
(``compat/kv_digest.py``) and the backport series' ``pd_digest`` (bundled into it), so both read a pool alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sglang_harden.guards.checksum import CODE_ALLOW
from sglang_harden.kernels.digest_spec import KVLayout, check_layout


def _tp_coordinates(scheduler: Any) -> tuple[int, int] | None:
    """This scheduler's (attention TP rank, attention TP size), from where its pin keeps them: the scheduler
    itself (older pins), its ``ps`` ParallelState (0.5.19, 0.5.20) or ``runtime_context.get_parallel()``
    (0.5.21+). ``None`` when none of them says."""
    holders = (lambda: scheduler, lambda: getattr(scheduler, "ps", None), _parallel_context)
    for holder in (read() for read in holders):  # the runtime context only when the others do not say
        if holder is None:
            continue
        try:
            rank, size = getattr(holder, "attn_tp_rank", None), getattr(holder, "attn_tp_size", None)
        except Exception:  # noqa: BLE001 - a context that cannot answer is one that does not say
            continue
        if isinstance(rank, int) and isinstance(size, int) and 0 <= rank < size:
            return rank, size
    return None


def _tp_rank(scheduler: Any) -> int:
    return (_tp_coordinates(scheduler) or (0, 1))[0]


def _parallel_context() -> Any:
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:
        return None
    try:
        return get_parallel()
    except Exception:  # noqa: BLE001 - not initialised in this process
        return None


def pool_layout(scheduler: Any) -> tuple[KVLayout | None, list[Any], list[Any] | None, str]:
    """This rank's KV layout and buffers, or ``(None, [], None, reason)`` when the pool is not digestible."""
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    coordinates = _tp_coordinates(scheduler)
    rank, size = coordinates or (0, 1)
    if getattr(pool, "use_hnd", False):
        return None, [], None, "KV pool uses the HND layout"
    if getattr(pool, "kv_buffer", None) is not None and getattr(pool, "k_buffer", None) is None:
        buffers, v_buffers, halves, total, start, heads, replicated = pool.kv_buffer, None, 1, 1, 0, 1, True
    else:
        buffers, v_buffers = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
        if not buffers or not v_buffers:
            return None, [], None, f"{type(pool).__name__} has no per-layer K/V buffers"
        if buffers[0].shape[-1] != v_buffers[0].shape[-1]:
            return None, [], None, "K and V rows differ in width"
        halves, heads = 2, int(buffers[0].shape[1])
        total = int(scheduler.model_config.get_total_num_kv_heads())
        if coordinates is None and heads != total:
            return None, [], None, "this rank holds a share of the KV heads but its attention TP rank is unknown"
        replicated = total < size
        start = rank * total // size if replicated else rank * heads
    first = buffers[0]
    layout = KVLayout(
        dtype=str(getattr(pool, "dtype", first.dtype)).removeprefix("torch."),
        head_dim=int(first.shape[-1]),
        itemsize=int(first.element_size()),
        num_layers=len(buffers),
        kv_halves=halves,
        total_kv_heads=total,
        head_start=start,
        num_heads=heads,
        page_size=int(getattr(pool, "page_size", 1)),
        replicated=replicated,
    )
    try:
        check_layout(layout)
    except ValueError as exc:
        return None, [], None, f"KV layout not digestible: {exc}"
    return layout, list(buffers), list(v_buffers) if v_buffers is not None else None, ""


@dataclass
class TorchGroupTransport:
    """``all_gather`` of int32 codes over a torch.distributed (gloo) group, waited on with a timeout.

    A peer that died makes gloo raise; one that stalls makes the wait time out; both read as missing ranks.
    After either, the group is broken for later collectives: the caller must treat the failure as fatal
    for the group, as SGLang does for any failed TP collective.
    """

    group: Any = None
    rank: int = -1
    world_size: int = -1

    def __post_init__(self) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def exchange(self, codes: list[int], timeout_s: float) -> list[list[int] | None]:
        import torch
        import torch.distributed as dist

        mine = torch.tensor(codes or [CODE_ALLOW], dtype=torch.int32)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(out, mine, group=self.group, async_op=True)
            work.wait(timeout=timedelta(seconds=timeout_s))
        except Exception:  # noqa: BLE001 - timeout or dead peer: everyone else is missing
            return [codes if r == self.rank else None for r in range(self.world_size)]
        return [t.tolist()[: len(codes)] for t in out]
