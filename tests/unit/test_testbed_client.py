"""The testbed client's greedy comparison: equal answers, a near-tie, a real difference."""

from __future__ import annotations

from typing import Any

from sglang_harden.testbed.client import _parse, greedy_difference


def _answer(ids: list[int], tops: list[list[tuple[float, int]]]) -> Any:
    meta = {
        "output_token_logprobs": [[-0.1, t, None] for t in ids],
        "output_top_logprobs": [[[lp, tok, None] for lp, tok in top] for top in tops],
    }
    return _parse(200, {"text": "", "meta_info": meta}, 0.1)


def test_top_logprobs_are_parsed() -> None:
    res = _answer([4, 5], [[(-0.1, 4), (-2.0, 9)], [(-0.2, 5), (-0.3, 6)]])
    assert res.top_logprobs == [{4: -0.1, 9: -2.0}, {5: -0.2, 6: -0.3}]
    assert _parse(200, {"meta_info": {}}, 0.1).top_logprobs is None


def test_equal_answers_do_not_differ() -> None:
    x = _answer([4, 5], [[(-0.1, 4)], [(-0.2, 5)]])
    assert greedy_difference(x, x, 0.01) is None


def test_a_near_tie_is_not_a_difference_and_later_tokens_are_not_compared() -> None:
    x = _answer([4, 5, 7], [[(-0.1, 4)], [(-0.700, 5), (-0.705, 6)], [(-0.1, 7)]])
    y = _answer([4, 6, 8], [[(-0.1, 4)], [(-0.702, 6), (-0.704, 5)], [(-0.1, 8)]])
    assert greedy_difference(x, y, 0.01) is None


def test_a_clear_preference_is_a_difference() -> None:
    x = _answer([4, 5], [[(-0.1, 4)], [(-0.2, 5), (-1.5, 6)]])
    y = _answer([4, 6], [[(-0.1, 4)], [(-0.2, 6), (-1.5, 5)]])
    assert "ranks them" in (greedy_difference(x, y, 0.01) or "")


def test_a_difference_without_top_logprobs_or_lengths_counts() -> None:
    x = _parse(200, {"meta_info": {"output_token_logprobs": [[-0.1, 4, None]]}}, 0.1)
    y = _parse(200, {"meta_info": {"output_token_logprobs": [[-0.1, 5, None]]}}, 0.1)
    assert "do not hold both" in (greedy_difference(x, y, 0.01) or "")
    z = _parse(200, {"meta_info": {"output_token_logprobs": [[-0.1, 4, None], [-0.1, 4, None]]}}, 0.1)
    assert "output tokens" in (greedy_difference(x, z, 0.01) or "")


def test_error_messages_of_each_answer_shape() -> None:
    """SGLang's own error body, FastAPI's HTTPException body (0.4.x answers a scheduler abort of 500/503 so), text."""
    assert _parse(400, {"error": {"message": "too long"}}, 0.1).error_message() == "too long"
    assert _parse(500, {"detail": "page ownership check failed"}, 0.1).error_message() == "page ownership check failed"
    assert _parse(502, "bad gateway", 0.1).error_message() == "bad gateway"
