"""Which KV shapes a scheduler serves, read from SGLang's objects at its start-up: its pool's class, its speculative
algorithm, its attention-DP width. :mod:`sglang_harden.guards.model_shape` decides what the armed guards cover;
this module only reads, and what it cannot read counts as the shape no page or byte guard covers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sglang_harden import events
from sglang_harden.compat.digest_pool import _parallel_context as parallel_context
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.config import Mode
from sglang_harden.guards.model_shape import KVShape, decide_shapes

# SGLang's pool classes by name (exact: a subclass adds buffers or a layout the guards do not read)
POOL_SHAPES = {
    "MHATokenToKVPool": KVShape.MHA,
    "MLATokenToKVPool": KVShape.MLA,
    "SWAKVPool": KVShape.SWA,
    "HybridLinearKVPool": KVShape.LINEAR_STATE,
}


def read_shapes(scheduler: Any) -> tuple[list[KVShape], list[str]]:
    """The shapes ``scheduler`` serves, and what each was read from."""
    pool_class = type(scheduler.token_to_kv_pool_allocator.get_kvcache()).__name__
    shapes, details = [POOL_SHAPES.get(pool_class, KVShape.UNKNOWN_POOL)], [f"pool {pool_class}"]
    speculative = _speculative_algorithm(scheduler)
    if speculative != "none":
        shapes.append(KVShape.SPECULATIVE)
        details.append(f"speculative algorithm {speculative}")
    attention_dp = _attention_dp_width(scheduler)
    if attention_dp != 1:
        shapes.append(KVShape.DP_ATTENTION)
        details.append(f"attention-DP width {attention_dp or 'unreadable'}")
    return shapes, details


def _speculative_algorithm(scheduler: Any) -> str:
    """``none``, the algorithm's name, or ``unreadable``."""
    algorithm = getattr(scheduler, "spec_algorithm", None)
    if callable(getattr(algorithm, "is_none", None)):
        return "none" if algorithm.is_none() else str(getattr(algorithm, "name", algorithm))
    server_args = getattr(scheduler, "server_args", None)
    if server_args is not None and hasattr(server_args, "speculative_algorithm"):
        return str(server_args.speculative_algorithm or "none")
    return "unreadable"


def _attention_dp_width(scheduler: Any) -> int | None:
    """The attention-DP width (1: none), from where the pin keeps it; a flag alone says 2+ as 2; None: unreadable.
    The runtime context first: 0.5.23's ``server_args.enable_dp_attention`` stays false under attention DP."""
    holders = (parallel_context(), getattr(scheduler, "ps", None), scheduler, getattr(scheduler, "server_args", None))
    for holder in holders:
        if holder is None:
            continue
        try:
            width, flag = getattr(holder, "attn_dp_size", None), getattr(holder, "enable_dp_attention", None)
        except Exception:  # noqa: BLE001 - a context that cannot answer is one that does not say
            continue
        if isinstance(width, int) and width >= 1:
            return width
        if isinstance(flag, bool):
            return 2 if flag else 1
    return None


def shape_gate(scheduler: Any, role: str, roles_by_owner: Mapping[str, set[str]]) -> None:
    """Start-up: refuse a node whose armed guards (those that run in ``role``) would cover only part of its KV; a
    guard in log mode is named in a counted warning instead (log mode refuses nothing)."""
    shapes, details = read_shapes(scheduler)
    armed = [guard for guard in RUNTIME.armed if role in roles_by_owner.get(guard, {role})]
    decision = decide_shapes(shapes, armed, ", ".join(details))
    refused = list(decision.fields.get("refused", []))
    enforced = [guard for guard in refused if RUNTIME.config.mode(guard) is Mode.ENFORCE]
    RUNTIME.model_shape = {
        "shapes": decision.fields["shapes"], "read_from": details, "guards": decision.fields["guards"],
        "partial_in_log_mode": sorted(set(refused) - set(enforced)),
    }
    if events.record(decision, Mode.ENFORCE if enforced else Mode.LOG, role=role):
        raise HardenRefusal("sglang-harden model-shape gate: refusing to start: " + decision.reason)
