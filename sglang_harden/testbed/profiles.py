"""Testbed serving profiles: how the CPU servers lay out and fill their KV cache.

``minimal`` is what most end-to-end tests ran on first: page size 1, no prefix cache, no chunking, early send of
a cached prefix off. ``paged16`` is shaped like a production PD deployment: 16-token pages, the radix prefix
cache on, chunked prefill with a chunk smaller than the test prompts (several chunks per request), and each
pin's own default for early send of the cached prefix (0.5.23: on).

A test picks one with ``PDPair(..., profile=get_profile("paged16"))``; ``SGLANG_HARDEN_TESTBED_PROFILE`` sets the
default for every pair that does not pick one (``sglang-harden testbed`` and the scripts honour it too).

CPU necessities a profile adds (not policy): ``TRITON_INTERPRET=1`` when pages are larger than one token, because
the paged allocator's Triton kernels have no CPU driver otherwise (the interpreter runs them on CPU tensors).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROFILE_ENV = "SGLANG_HARDEN_TESTBED_PROFILE"
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"


@dataclass(frozen=True)
class Profile:
    name: str
    page_size: int = 1
    radix_cache: bool = False
    # None: SGLang's default chunk (larger than every testbed prompt, so one chunk per request)
    chunked_prefill_size: int | None = None
    # False: the testbed forces early send of the cached prefix off; True: the pin's own default applies
    pin_default_early_send: bool = False

    def server_flags(self) -> list[str]:
        flags = ["--page-size", str(self.page_size)] if self.page_size != 1 else []
        if self.chunked_prefill_size is not None:
            flags += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if not self.radix_cache:
            flags.append("--disable-radix-cache")
        return flags

    def server_env(self) -> dict[str, str]:
        return {"TRITON_INTERPRET": "1"} if self.page_size > 1 else {}

    def dropped_env(self) -> tuple[str, ...]:
        """Variables of the pin's testbed env this profile removes (so SGLang's own default applies)."""
        return (EARLY_SEND_ENV,) if self.pin_default_early_send else ()

    def describe(self) -> str:
        chunk = f"chunk {self.chunked_prefill_size}" if self.chunked_prefill_size else "no chunking"
        radix = "radix on" if self.radix_cache else "radix off"
        early = "pin-default early send" if self.pin_default_early_send else "early send off"
        return f"{self.name}: page {self.page_size}, {radix}, {chunk}, {early}"


PROFILES: dict[str, Profile] = {
    "minimal": Profile("minimal"),
    "paged16": Profile("paged16", page_size=16, radix_cache=True, chunked_prefill_size=64,
                       pin_default_early_send=True),
    "paged64": Profile("paged64", page_size=64, radix_cache=True, chunked_prefill_size=64,
                       pin_default_early_send=True),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown testbed profile {name!r}; known: {sorted(PROFILES)}") from None


def default_profile() -> Profile:
    """The profile ``SGLANG_HARDEN_TESTBED_PROFILE`` names (``minimal`` when unset)."""
    return get_profile(os.environ.get(PROFILE_ENV) or "minimal")
