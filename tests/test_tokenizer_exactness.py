"""fastokens must produce exactly HF tokenizers' ids: HF is the oracle.

Property tests over random unicode, rendered chat templates with special tokens and
long inputs; the pool's thread path is checked against the same oracle. The shared
tokenizer has fastokens' segment cache on (the default); the tests named for the cache
drive it on purpose: repeated and overlapping segments, a budget small enough to evict
all the time, several threads at once, and the cache off.
"""

from __future__ import annotations

import random
import threading
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.config import FrontendConfig
from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.template import ChatTemplate
from frontend.preprocess.tokenizer import (
    SEGMENT_CACHE_BYTES,
    Backend,
    Tokenizer,
    TokenizerLoadError,
)
from headwater.wire.tokens import TOKEN_TYPECODE, token_array

from frontend_fixture import shared_tokenizer

SPECIALS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
]


@pytest.fixture(scope="module")
def fast() -> Tokenizer:
    tok = shared_tokenizer("fastokens")
    assert tok.backend is Backend.FASTOKENS
    return tok


@pytest.fixture(scope="module")
def churning() -> Tokenizer:
    """The segment cache on a 64 KiB budget: segments up to 1 KiB are kept, and the
    budget is full after a few examples, so entries come and go all the time."""
    tok = Tokenizer(shared_tokenizer("fastokens").files, "fastokens", segment_cache_bytes=64 * 1024)
    assert tok.segment_cache_statistics() is not None
    return tok


def oracle(tok: Tokenizer, text: str) -> array[int]:
    """HF's ids, as the token array the frontend carries them in."""
    return token_array(tok.hf.encode(text, add_special_tokens=False).ids)


_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_settings
@given(st.text(max_size=400))
def test_random_unicode_matches_hf(fast: Tokenizer, text: str) -> None:
    assert fast.encode_ids(text) == oracle(fast, text)


@_settings
@given(st.lists(st.one_of(st.text(max_size=60), st.sampled_from(SPECIALS)), max_size=12))
def test_text_with_special_tokens_matches_hf(fast: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert fast.encode_ids(text) == oracle(fast, text)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=200)),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)
def test_rendered_chat_templates_match_hf(
    fast: Tokenizer, turns: list[tuple[str, str]], thinking: bool
) -> None:
    template = ChatTemplate.from_tokenizer_config(fast.files.config)
    messages = [{"role": r, "content": c} for r, c in turns]
    if messages[-1]["role"] == "assistant":
        messages.append({"role": "user", "content": "next"})
    prompt = template.render(messages, chat_template_kwargs={"thinking": thinking})
    ids = fast.encode_ids(prompt)
    assert ids == oracle(fast, prompt)
    assert ids[0] == fast.bos_token_id  # the template writes BOS as a special token


def test_long_inputs_match_hf(fast: Tokenizer) -> None:
    rng = random.Random(42)
    alphabet = "abcdefghij klmnopqrstuvwxyz,.;\n αβγ 中文字符 🌊🚀 ñé"
    for size in (10_000, 100_000):
        text = "".join(rng.choice(alphabet) for _ in range(size))
        ids = fast.encode_ids(text)
        assert ids == oracle(fast, text)
        # One uint32 buffer, not a list of int objects: that is what keeps building it
        # (in the tokenizer thread) and freeing it (on the loop) cheap.
        assert isinstance(ids, array)
        assert ids.typecode == TOKEN_TYPECODE


def test_batch_encode_matches_single(fast: Tokenizer) -> None:
    texts = ["hello world", "<｜User｜>hi<｜Assistant｜>", "", "数字 123 🚀" * 50]
    batch = fast.encode_batch(texts)
    assert batch == [oracle(fast, t) for t in texts]
    assert all(ids.typecode == TOKEN_TYPECODE for ids in batch)
    hf = shared_tokenizer("hf")
    assert hf.encode_batch(texts) == [oracle(hf, t) for t in texts]


async def test_pool_thread_path_matches_hf(fast: Tokenizer) -> None:
    pool = TokenizerPool(fast, mode="thread", threads=2, inline_max_chars=0)
    text = "The pool must return exactly the oracle's ids. " * 400
    assert await pool.encode(text) == oracle(fast, text)
    assert pool.statistics().inline_total == 0


def test_fallback_to_hf_when_fastokens_cannot_load(
    fast: Tokenizer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastokens

    def refuse(path: str) -> None:
        raise ValueError("unsupported tokenizer")

    monkeypatch.setattr(fastokens.Tokenizer, "from_file", refuse)
    tok = Tokenizer(fast.files, "fastokens")
    assert tok.backend is Backend.HF
    assert "falling back to hf" in caplog.text
    ids = tok.encode_ids("fallback works")
    assert ids == oracle(fast, "fallback works")
    assert ids.typecode == TOKEN_TYPECODE  # the hf backend hands over a token array too


def test_missing_tokenizer_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json"):
        Tokenizer.load(str(tmp_path), "hf")


# ---- the segment cache -------------------------------------------------------------------

#: Pieces that segments are made of, so that examples repeat each other's segments and
#: a segment is often a prefix, a suffix or a part of another one.
_pieces = st.sampled_from(["hello", " world", "你好", "🚀", "\n\n", " the", "ing", "  ", "a"]) | (
    st.text(max_size=12)
)
_segment = st.lists(_pieces, max_size=6).map("".join)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(_segment, st.sampled_from(SPECIALS)), min_size=1, max_size=8))
@pytest.mark.slow
def test_segment_cache_gives_hf_ids_for_repeated_and_overlapping_segments(
    fast: Tokenizer, churning: Tokenizer, parts: list[tuple[str, str]]
) -> None:
    # Every text is encoded twice (the second time from the cache as far as it holds
    # its segments), and also with its segments in reverse order and cut at a special.
    texts = ["".join(a + b for a, b in parts), "".join(b + a for a, b in reversed(parts))]
    texts.append(texts[0][: len(texts[0]) // 2])
    for tok in (fast, churning):
        for text in (*texts, *texts):
            assert tok.encode_ids(text) == oracle(fast, text), tok.segment_cache_statistics()


@pytest.mark.slow
def test_segment_cache_hits_and_stays_exact_on_a_repeated_system_prompt(fast: Tokenizer) -> None:
    template = ChatTemplate.from_tokenizer_config(fast.files.config)
    rng = random.Random(7)
    system = " ".join(rng.choices(["able", "river", "stone", "数字", "🌊"], k=20_000))
    before = fast.segment_cache_statistics()
    assert before is not None
    for i in range(6):
        prompt = template.render(
            [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}],
            chat_template_kwargs={"thinking": False},
        )
        assert fast.encode_ids(prompt) == oracle(fast, prompt)
    after = fast.segment_cache_statistics()
    assert after is not None
    assert after.hit_bytes - before.hit_bytes >= 5 * len(system.encode())  # encoded once


def test_segment_cache_is_exact_under_concurrent_threads(churning: Tokenizer) -> None:
    rng = random.Random(3)
    words = ["alpha", " beta", "γάμμα", "中文", "🚀", " x"]
    texts = []
    for i in range(40):
        body = "".join(rng.choices(words, k=rng.randrange(1, 300)))
        texts.append(f"<｜User｜>{body}<｜Assistant｜>{body[: i * 7]}<｜end▁of▁sentence｜>")
    expected = [oracle(churning, t) for t in texts]
    wrong: list[int] = []

    def hammer(seed: int) -> None:
        order = random.Random(seed)
        for _ in range(300):
            i = order.randrange(len(texts))
            if churning.encode_ids(texts[i]) != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    stats = churning.segment_cache_statistics()
    assert stats is not None
    assert stats.hits > 0
    assert stats.bytes <= stats.max_bytes


@pytest.mark.slow
def test_segment_cache_off_and_its_default() -> None:
    files = shared_tokenizer("fastokens").files
    off = Tokenizer(files, "fastokens", segment_cache_bytes=0)
    assert off.segment_cache_statistics() is None
    text = "<｜User｜>hi<｜Assistant｜>"
    assert off.encode_ids(text) == oracle(off, text)
    stats = shared_tokenizer("fastokens").segment_cache_statistics()
    assert stats is not None
    assert stats.max_bytes == SEGMENT_CACHE_BYTES
    assert FrontendConfig().tokenizer_cache_mb << 20 == SEGMENT_CACHE_BYTES  # one default
    assert shared_tokenizer("hf").segment_cache_statistics() is None  # hf has no such cache
    with pytest.raises(ValueError, match="segment_cache_bytes"):
        Tokenizer(files, "fastokens", segment_cache_bytes=-1)
