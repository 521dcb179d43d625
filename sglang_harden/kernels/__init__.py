"""Byte-level kernels: the per-KV-head transfer digest (spec, numpy reference, torch, Triton).

Importing this package imports neither numpy nor torch; pick a backend through :mod:`.digest`.
"""

from sglang_harden.kernels.digest_spec import KVLayout, ShardDigest, token_slots

__all__ = ["KVLayout", "ShardDigest", "token_slots"]
