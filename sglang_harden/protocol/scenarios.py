"""Named configurations of the model: the incident's asymmetric pools by default."""

from __future__ import annotations

from sglang_harden.protocol.world import ModelConfig, RequestSpec

# r0 and r1 fit everywhere (r1 reuses r0's pages: the late-write race); r2 is too long for prefill but fits
# decode (the incident's tenant B); r3 is too long for prefill, which runs with --allow-auto-truncate.
DEFAULT_REQUESTS = (
    RequestSpec(2),
    RequestSpec(1),
    RequestSpec(3),
    RequestSpec(3, auto_truncate=True),
    RequestSpec(2),
    RequestSpec(1),
)
# The incident: tenant A fits, tenant B is too long for prefill's pool but not for decode's.
INCIDENT_REQUESTS = (RequestSpec(2), RequestSpec(3))
# Short sends: B is too long for prefill, which truncates instead of rejecting.
TRUNCATE_REQUESTS = (RequestSpec(2), RequestSpec(3, auto_truncate=True))


def build_config(
    requests: int = 3,
    pages: int = 3,
    prefill_limit: int | None = None,
    decode_limit: int | None = None,
    specs: tuple[RequestSpec, ...] | None = None,
    **overrides: object,
) -> ModelConfig:
    """``pages`` KV pages on each node; prefill's input limit one page short of its pool (the incident:
    context fits, pool does not), decode's limit the whole pool. Prompts longer than a limit are clipped."""
    p_limit = max(1, pages - 1) if prefill_limit is None else prefill_limit
    d_limit = pages if decode_limit is None else decode_limit
    chosen = specs if specs is not None else _default_specs(requests)
    clipped = tuple(RequestSpec(min(s.prompt_len, d_limit), s.auto_truncate) for s in chosen)
    context = max(d_limit, p_limit, *(s.prompt_len for s in clipped))
    settings: dict[str, object] = {
        "requests": clipped,
        "prefill_pages": pages,
        "decode_pages": pages,
        "prefill_limit": p_limit,
        "decode_limit": d_limit,
        "context_len": context,
    }
    settings.update(overrides)
    return ModelConfig(**settings)  # type: ignore[arg-type]


def _default_specs(requests: int) -> tuple[RequestSpec, ...]:
    if requests < 1:
        raise ValueError("need at least one request")
    return tuple(DEFAULT_REQUESTS[i % len(DEFAULT_REQUESTS)] for i in range(requests))
