"""Stop sequences are found however the text is cut into pieces, at the place they start in all the text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.engine.stop_matcher import StopHoldback, StopMatch, StopMatcher


def feed_all(matcher: StopMatcher, parts: list[str]) -> StopMatch | None:
    for part in parts:
        match = matcher.feed(part)
        if match is not None:
            return match
    return None


def test_a_stop_spanning_three_pieces_is_found_where_it_starts():
    match = feed_all(StopMatcher(("END",)), ["once there was an E", "N", "D of it"])
    assert match == StopMatch(stop="END", at=18)
    assert match.end == 21


def test_the_earliest_stop_wins_and_a_shorter_one_at_the_same_place_first():
    assert feed_all(StopMatcher(("lion", "fox")), ["the fox and the lion"]) == StopMatch("fox", 4)
    assert StopMatcher(("abc", "ab")).feed("xxabc") == StopMatch("ab", 2)


def test_no_stops_or_empty_pieces_never_match_and_empty_stops_are_refused():
    assert StopMatcher(()).feed("anything") is None
    assert StopMatcher(("x",)).feed("") is None
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher(("ok", ""))


@given(
    text=st.text(alphabet="ab c\n", max_size=60),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
    stops=st.lists(st.text(alphabet="ab c\n", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_any_cutting_of_the_text_finds_what_searching_the_whole_text_finds(
    text: str, cuts: list[int], stops: list[str]
):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    found = feed_all(StopMatcher(tuple(stops)), parts)
    # The reference: the first piece after which some stop is in the text, and its earliest occurrence then.
    expected = None
    for end in bounds[1:]:
        hits = [(i, s) for s in stops if (i := text[:end].find(s)) >= 0]
        if hits:
            at, stop = min(hits)
            expected = StopMatch(stop, at)
            break
    assert found == expected


@given(
    text=st.text(alphabet="ab c", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_a_held_back_stream_never_shows_a_stop_and_ends_with_the_cut_text(text: str, cuts: list[int], stops: list[str]):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher, hold, shown = StopMatcher(tuple(stops)), StopHoldback(tuple(stops)), ""
    final_text = text
    for a, b in zip(bounds, bounds[1:]):
        match = matcher.feed(text[a:b])
        if match is not None:
            final_text = text[: match.at]
            break
        shown += hold.push(text[a:b])
        assert final_text.startswith(shown)
    assert shown + hold.finish(final_text) == final_text
    assert not any(s in final_text for s in stops)
