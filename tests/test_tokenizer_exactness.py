"""fastokens must produce exactly HF tokenizers' ids: HF is the oracle.

Property tests over random unicode, rendered chat templates with special tokens and
long inputs; the pool's thread path is checked against the same oracle.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.preprocess.pool import TokenizerPool
from frontend.preprocess.template import ChatTemplate
from frontend.preprocess.tokenizer import Backend, Tokenizer, TokenizerLoadError
from headwater.wire.tokens import TOKEN_TYPECODE, token_array

from frontend_fixture import shared_tokenizer

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
            "<think>", "</think>"]


@pytest.fixture(scope="module")
def fast() -> Tokenizer:
    tok = shared_tokenizer("fastokens")
    assert tok.backend is Backend.FASTOKENS
    return tok


def oracle(tok: Tokenizer, text: str) -> array[int]:
    """HF's ids, as the token array the frontend carries them in."""
    return token_array(tok.hf.encode(text, add_special_tokens=False).ids)


_settings = settings(max_examples=150, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


@_settings
@given(st.text(max_size=400))
def test_random_unicode_matches_hf(fast: Tokenizer, text: str) -> None:
    assert fast.encode_ids(text) == oracle(fast, text)


@_settings
@given(st.lists(st.one_of(st.text(max_size=60), st.sampled_from(SPECIALS)), max_size=12))
def test_text_with_special_tokens_matches_hf(fast: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert fast.encode_ids(text) == oracle(fast, text)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=200)),
        min_size=1, max_size=6,
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
