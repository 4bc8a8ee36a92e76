"""``bench.bigbox``'s figures for concurrent clients: the aggregate decode rate counts only the window where every
stream decodes, and the plan's prediction for that many sequences is read off ``/info``."""

from __future__ import annotations

import pytest

from bench.bigbox import concurrent_decode_rate, predicted_concurrent_rate


def test_the_decode_window_starts_at_the_last_first_token_and_ends_at_the_first_last_token() -> None:
    # two streams: one prefilled at 0, the other at 2 (its prompt came later); both then decode a token a second
    early = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    late = [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    # window (2, 5]: early's 3, 4, 5 and late's 3, 4, 5 -> 6 tokens in 3 s
    assert concurrent_decode_rate([early, late]) == pytest.approx(2.0)
    assert concurrent_decode_rate([early]) == pytest.approx(1.0)


def test_no_window_no_rate() -> None:
    assert concurrent_decode_rate([]) is None
    assert concurrent_decode_rate([[0.0, 1.0], [5.0, 6.0]]) is None, "never all decoding at once"
    assert concurrent_decode_rate([[0.0, 1.0], [0.5]]) is None, "a stream with one token never decoded"


def test_the_prediction_for_that_many_sequences() -> None:
    info = {
        "plan": {
            "prediction": {
                "concurrent": [{"sequences": 4, "tokens_per_s": 7.5}, {"sequences": 16, "tokens_per_s": 25.0}]
            }
        }
    }
    assert predicted_concurrent_rate(info, 16) == 25.0
    assert predicted_concurrent_rate(info, 8) is None
    assert predicted_concurrent_rate({"plan": {"prediction": {}}}, 16) is None, "a plan saved before the rates"
