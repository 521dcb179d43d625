"""How a 0.5.x scheduler ends a request with an error (SGLang's ``prepare_abort``, then the output streamer), and
reads whether a request is aborted: shared by the family's guard hooks and its lifecycle hooks."""

from __future__ import annotations

from typing import Any


def abort_and_stream(scheduler: Any, req: Any, message: str, status_code: int) -> None:
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(req, message, status_code=status_code)
    if hasattr(req, "to_finish"):
        req.to_finish = None
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def is_aborted(req: Any) -> bool:
    from sglang.srt.disaggregation.utils import is_aborted as sglang_is_aborted

    return bool(sglang_is_aborted(req))
