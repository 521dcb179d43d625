"""An executable model of SGLang's prefill/decode KV handoff, checked against the real guard decisions.

Imports no SGLang. ``world`` holds the state, ``model`` the events and properties, ``policies`` the two rule
sets (``vanilla`` = upstream <= 0.5.19, ``hardened`` = calls into ``sglang_harden.guards``), ``explorer`` the
bounded breadth-first checker, ``scenarios`` the request scripts, ``cli`` ``sglang-harden model check``.
The hypothesis state machine lives in ``tests/model/test_stateful.py``.
"""
