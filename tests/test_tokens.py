"""Token arrays: the one form a prompt's ids take from the tokenizer to the engine."""

from __future__ import annotations

import pytest

from headwater.wire.tokens import (
    TOKEN_TYPECODE,
    copy_tokens,
    from_uint32_le,
    to_uint32_le,
    token_array,
)


def test_a_token_array_passes_through_and_anything_else_is_converted() -> None:
    ids = token_array([1, 2, 3])
    assert ids.typecode == TOKEN_TYPECODE
    assert ids.itemsize == 4
    assert token_array(ids) is ids  # no copy on the serving path
    assert token_array(range(3)) == token_array([0, 1, 2])
    assert token_array() == token_array([])


def test_copy_tokens_is_a_separate_array() -> None:
    ids = token_array([7, 8])
    copy = copy_tokens(ids)
    copy.append(9)
    assert (ids.tolist(), copy.tolist()) == ([7, 8], [7, 8, 9])


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_ids_outside_uint32_are_a_value_error(bad: list[object]) -> None:
    for make in (token_array, copy_tokens, to_uint32_le):
        with pytest.raises(ValueError, match="token ids"):
            make(bad)  # type: ignore[arg-type]


def test_bytes_are_little_endian_uint32_both_ways() -> None:
    ids = [0, 1, 258, 2**32 - 1]
    data = to_uint32_le(ids)
    assert data == b"".join(i.to_bytes(4, "little") for i in ids)
    back = from_uint32_le(data)
    assert back == token_array(ids)
    assert back.typecode == TOKEN_TYPECODE
    assert from_uint32_le(memoryview(data)) == back
    with pytest.raises(ValueError, match="uint32"):
        from_uint32_le(data[:-1])
