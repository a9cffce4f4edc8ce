"""Finding the first of many stop strings in a stream of text, at a cost per character
that does not grow with how many there are.

The naive way, searching the text for every stop string after every token, costs the
number of stop strings times the text searched, each token; one request with a long list
of them then slows every request that shares its engine step. This module reads each
character of the output once, whatever the list, with an **Aho-Corasick automaton**:

* a *trie* of the stop strings: each node is a prefix of one or more of them (the root is
  the empty prefix), with a child per character that extends it;
* each node's *fallback*: the node of its longest proper suffix that is also a prefix of
  some stop string. Where the next character has no child, the matcher falls back (as the
  Knuth-Morris-Pratt search does for one pattern) until one has, or it is at the root;
* each node's *match*: the longest stop string that ends the node's prefix (its own, if it
  is one; else its fallback's match).

Invariant: after reading text, the matcher's state is the node of the longest suffix of
the text that is a prefix of some stop string. Hence:

* the first character after which the state has a match ends the stop string completed
  earliest, and the match is the longest ending there (so the one that starts first);
* while there is no match, the state's depth is exactly the tail to hold back from a
  stream: the longest that could still grow into a stop string.

Cost: building takes time and memory in the stop strings' total length (a node per
character: about 2 MB for 32 stop strings of 256 characters, the most `SamplingParams`
allows); `compile_stop_strings` caches it, so the `n` samples of one request share one
automaton. Reading takes, amortised, a step per character, since every fallback is paid
for by a character read earlier, and at most the longest stop string's length for one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

ROOT = 0


@dataclass(frozen=True)
class StopStringAutomaton:
    """The trie of some stop strings with their fallbacks; nodes are list indices."""

    children: list[dict[str, int]]
    fallback: list[int]
    depth: list[int]  # the length of the node's prefix
    match: list[str | None]  # the longest stop string ending the node's prefix

    def step(self, node: int, char: str) -> int:
        """The node after reading `char` in `node`."""
        while char not in self.children[node] and node != ROOT:
            node = self.fallback[node]
        return self.children[node].get(char, ROOT)


@lru_cache(maxsize=16)  # for the requests being added now: their samples share one
def compile_stop_strings(stop_strings: tuple[str, ...]) -> StopStringAutomaton:
    """The automaton of these (non-empty) stop strings."""
    children: list[dict[str, int]] = [{}]
    depth: list[int] = [0]
    own: list[str | None] = [None]  # the stop string that a node's prefix is, if any
    for stop_string in stop_strings:
        node = ROOT
        for char in stop_string:
            if char not in children[node]:
                children[node][char] = len(children)
                children.append({})
                depth.append(depth[node] + 1)
                own.append(None)
            node = children[node][char]
        own[node] = stop_string
    automaton = StopStringAutomaton(children, [ROOT] * len(children), depth, own.copy())
    # Breadth first: a node's fallback is shallower than itself, so it is already done.
    pending = deque(children[ROOT].values())
    while pending:
        node = pending.popleft()
        for char, child in children[node].items():
            automaton.fallback[child] = ROOT if node == ROOT else automaton.step(
                automaton.fallback[node], char)
            if own[child] is None:
                automaton.match[child] = automaton.match[automaton.fallback[child]]
            pending.append(child)
    return automaton


class StopStringMatcher:
    """Reads one stream of text, piece by piece, and finds the first stop string in it."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        self._automaton = compile_stop_strings(tuple(stop_strings))
        self._node = ROOT

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read the next piece of the stream. Returns (where in `text` the first completed
        stop string ends, which one it is), or None while none has."""
        automaton = self._automaton
        for position, char in enumerate(text):
            self._node = automaton.step(self._node, char)
            found = automaton.match[self._node]
            if found is not None:
                return position + 1, found
        return None

    @property
    def partial_length(self) -> int:
        """How much of the stream's tail could still grow into a stop string."""
        return self._automaton.depth[self._node]


def partial_match_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that some marker starts with (and is shorter
    than it): the part of a stream to hold back until the next piece shows whether the
    marker really follows. The stateless form, for a marker or two in a short buffer."""
    longest_possible = max((len(marker) - 1 for marker in markers), default=0)
    for length in range(min(longest_possible, len(text)), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0
