"""Stop strings: the same text fed whole, piece by piece and split at every point gives the
same output and the same match; a stop string (or its start) never leaks."""

from __future__ import annotations

import random

import pytest

from mlx_server.parsing.stops import StopMatcher
from mlx_server.parsing.tags import held_tail_len

CASES = [
    ("Hello END world", ("END",), "Hello ", "END"),
    ("no stop here at all", ("END", "STOP"), "no stop here at all", None),
    ("almost EN", ("END",), "almost EN", None),  # a held start is text at the end
    ("a STOP b END", ("END", "STOP"), "a ", "STOP"),  # the earliest one wins
    ("ééé→stop", ("→",), "ééé", "→"),
    ("", ("END",), "", None),
]


def run(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if m.matched is None:
        out += m.flush()
    return out, m.matched


@pytest.mark.parametrize(("text", "stops", "out", "matched"), CASES)
def test_whole_by_character_and_every_split_agree(text, stops, out, matched):
    assert run([text], stops) == (out, matched)
    assert run(list(text), stops) == (out, matched)
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], stops) == (out, matched), i


def test_nothing_after_a_match_and_no_stop_text_ever_emitted():
    m = StopMatcher(("END",))
    emitted = [m.feed(p) for p in ["ab", "cE", "N", "D", "more", "text"]]
    assert "".join(emitted) == "abc" and m.matched == "END"
    assert emitted[1] == "c"  # "E" held back: it could start END
    assert m.flush() == ""


def test_the_matcher_holds_back_less_than_a_stop_string_whatever_the_text_length():
    """Each piece is scanned with at most a stop string's length of held text before it:
    the work per token does not grow with the text generated so far."""
    stop = "\n\nTHE END."
    m = StopMatcher((stop, "THE END!"))
    fed = emitted = 0
    text = "a line\n\nTHE EN\n\nTHE END\n" * 400  # starts of the stop strings, again and again
    for i in range(0, len(text), 3):
        piece = text[i : i + 3]
        fed += len(piece)
        emitted += len(m.feed(piece))
        assert fed - emitted < len(stop)
    assert m.matched is None


def _held_by_definition(text: str, tags: list[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a tag, length by length."""
    return max((n for tag in tags for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)


def test_the_held_tail_is_the_longest_suffix_that_starts_a_tag():
    rng = random.Random(7)
    alphabet = "<>/ab"  # few characters: tags overlap and repeat their first character
    for _ in range(20000):
        tags = ["".join(rng.choices(alphabet, k=rng.randint(0, 6))) for _ in range(3)]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 10)))
        assert held_tail_len(text, tags) == _held_by_definition(text, tags), (text, tags)
