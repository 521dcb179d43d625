"""Drain acknowledgements as SGLang's objects hold them. Decode asks for prefill's drain acknowledgement with its
abort notice (prefill acknowledges a room only after decode's notice for it, so a room whose pages go to quarantine
must have had one sent); which acks may count is decided by :mod:`sglang_harden.guards.drain_acks` from what is read
here: the prefill ranks a receiver's transfer targets, as each names itself in its ack, and the generation its
notice carries. Shared by the plugin's lifecycle (``compat/lifecycle_nodes.py``) and the backport series'
``pd_lifecycle`` (bundled into it).

Where SGLang keeps them (0.5.10 … 0.5.23, common ``CommonKVReceiver``): ``target_tp_ranks``, ``target_pp_ranks``,
``target_cp_ranks`` (copied from ``prefill_info``, the ``PrefillServerInfo`` of the receiver's bootstrap address,
which also has prefill's ``pp_size`` and ``attn_cp_size``); a prefill rank acks as ``_prefill_unique_rank()`` =
``attn_tp_rank * (pp_size * attn_cp_size) + pp_rank * attn_cp_size + attn_cp_rank``. 0.4.x (Mooncake's own
receiver): ``target_tp_ranks`` within the prefill DP group ``target_dp_group`` of ``prefill_tp_size //
prefill_dp_size`` ranks; the series' own ack names prefill's ``kv_args.engine_rank``. 0.5.22+: the generation of
the receiver's notice is ``_abort_generation`` (what ``register_deferred_abort_room`` returned and
``_deferred_abort_ack_tracker[room].generation`` holds while SGLang keeps the room armed; the receiver keeps it
after SGLang's own release timeout clears the tracker, when the pages may still be quarantined here).
"""

from __future__ import annotations

from typing import Any


def send_abort_notice(receiver: Any) -> None:
    """Make sure the abort notice of ``receiver``'s room went out (once); raises what SGLang raised."""
    if receiver is None or getattr(receiver, "abort_notified", True):
        return
    ensure = getattr(receiver, "ensure_abort_notified", None)  # 0.5.21+: also arms drain-ack accounting
    if ensure is not None:
        ensure(force_arm=True)
    elif getattr(receiver, "bootstrap_infos", None):
        receiver._send_abort_notification()
        receiver.abort_notified = True


def _ranks(values: Any) -> list[int]:
    ranks = [int(value) for value in values]
    if not ranks or min(ranks) < 0:
        raise ValueError(f"not a list of ranks: {values!r}")
    return ranks


def expected_ack_ranks(receiver: Any) -> frozenset[int] | None:
    """The prefill ranks that acknowledge the drain of ``receiver``'s transfer, as each names itself in its ack;
    None when the receiver does not say (then no ack can count: the caller fails closed)."""
    try:
        tp_ranks = _ranks(receiver.target_tp_ranks)
        info = getattr(receiver, "prefill_info", None)
        if info is not None:  # the common receiver (0.5.10+)
            pp_size, cp_size = int(info.pp_size), int(info.attn_cp_size)
            pp_ranks, cp_ranks = _ranks(receiver.target_pp_ranks), _ranks(receiver.target_cp_ranks)
            if pp_size < 1 or cp_size < 1 or max(pp_ranks) >= pp_size or max(cp_ranks) >= cp_size:
                return None
            return frozenset(tp * (pp_size * cp_size) + pp * cp_size + cp
                             for tp in tp_ranks for pp in pp_ranks for cp in cp_ranks)
        per_group = int(receiver.prefill_tp_size) // int(receiver.prefill_dp_size)  # 0.4.x Mooncake
        group = int(receiver.target_dp_group)
        if per_group < 1 or group < 0 or max(tp_ranks) >= per_group:
            return None
        return frozenset(group * per_group + tp for tp in tp_ranks)
    except (AttributeError, TypeError, ValueError):
        return None


def notice_generation(receiver: Any) -> int | None:
    """The generation ``receiver``'s abort notice carries (0.5.22+; None before its notice or on older releases)."""
    generation = getattr(receiver, "_abort_generation", None)
    return int(generation) if generation is not None else None


def notice_sent(receiver: Any) -> bool:
    """Whether ``receiver``'s abort notice already went out."""
    return bool(getattr(receiver, "abort_notified", False))


def prefill_ack_rank(manager: Any) -> int:
    """The rank a prefill KV manager names in its drain acks: SGLang's ``_prefill_unique_rank`` formula where the
    manager has attention-parallel ranks (0.5.x), else its engine rank (0.4.x)."""
    if hasattr(manager, "attn_tp_rank"):
        return (manager.attn_tp_rank * manager.pp_size * manager.attn_cp_size + manager.pp_rank * manager.attn_cp_size
                + manager.attn_cp_rank)
    return int(manager.kv_args.engine_rank)
