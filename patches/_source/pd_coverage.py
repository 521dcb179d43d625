"""How many prompt tokens of KV a transfer carried (sglang-harden backport, not upstream SGLang code).

On the last chunk prefill writes the count into a spare int32 slot of the request's metadata row
(cached_tokens slot 15), bound to the request's bootstrap room so that a value left by the row's previous
occupant does not read as this request's. Decode commits the transfer only when the count equals the prompt
it reserved pages for. The encoding is sglang-harden's own (its plugin runs the same code), so a patched
prefill and a plugin decode, or the reverse, check each other's transfers.
"""

from __future__ import annotations

COVERAGE_SLOT = 15

# <embed sglang_harden/channels/coverage_wire.py>
