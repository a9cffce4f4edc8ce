"""Tests for the stop-string matcher: the first completed stop string, and the tail to hold
back, as a plain search finds them, fed in any pieces."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoqwen.text.stop_strings import StopStringMatcher, compile_stop_strings


def first_stop(text: str, stop: list[str]) -> tuple[int, str] | None:
    """Reference: (end, stop string) of the match that ends first; on a tie, the longest."""
    for end in range(1, len(text) + 1):
        matched = [s for s in stop if text[:end].endswith(s)]
        if matched:
            return end, max(matched, key=len)
    return None


def held_back(text: str, stop: list[str]) -> int:
    """Reference: the longest tail of `text` that is a proper prefix of a stop string."""
    return max((n for n in range(1, len(text) + 1) for s in stop
                if len(s) > n and s.startswith(text[-n:])), default=0)


ALPHABET = st.sampled_from([*"abc \n", "é", "你"])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=30),
    stop=st.lists(st.text(ALPHABET, min_size=1, max_size=5), max_size=6),
    cuts=st.lists(st.integers(0, 30), max_size=5),
)
def test_fed_in_pieces_it_finds_what_a_search_finds(text: str, stop: list[str],
                                                    cuts: list[int]) -> None:
    matcher = StopStringMatcher(stop)
    bounds = [0, *sorted(min(cut, len(text)) for cut in cuts), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        found = matcher.feed(text[start:end])
        if found is not None:
            assert (start + found[0], found[1]) == first_stop(text, stop)
            return
        assert matcher.partial_length == held_back(text[:end], stop)
    assert first_stop(text, stop) is None


def test_overlapping_stop_strings() -> None:
    # "abcd" starts first, but "bc" is complete first; at one end, the longer one wins.
    assert StopStringMatcher(["abcd", "bc"]).feed("xabcd") == (4, "bc")
    assert StopStringMatcher(["c", "abc"]).feed("xabc") == (4, "abc")
    # Falling back from "aab" to "ab" finds "abc" through a shared suffix.
    matcher = StopStringMatcher(["aabx", "abc"])
    assert matcher.feed("aab") is None and matcher.partial_length == 3
    assert matcher.feed("c") == (1, "abc")


def test_one_request_compiles_its_stop_strings_once() -> None:
    stop = ("never", "there")
    assert compile_stop_strings(stop) is compile_stop_strings(tuple(list(stop)))
