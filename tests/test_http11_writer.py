"""The httptools protocol's response writer, without I/O (frontend/http/serving/http11_writer.py).

Policy: unit tests of the bytes it gives for each event; that they are h11's bytes is
tests/test_http_parsers.py's differential test, through both protocols.
"""

from __future__ import annotations

import pytest

from frontend.http.serving.http11_codec import ResponseHeadError
from frontend.http.serving.http11_writer import DONE, ERROR, IDLE, WAITING, ResponseWriter

HOST = [(b"host", b"t")]


def _writer(method: bytes = b"GET", version: bytes = b"1.1", **fields: bytes) -> ResponseWriter:
    writer = ResponseWriter()
    writer.request(method, version, [*HOST, *((k.encode(), v) for k, v in fields.items())])
    return writer


def test_a_known_length_head_is_held_and_leaves_with_its_body() -> None:
    writer = _writer()
    assert writer.response(200, [(b"content-length", b"5")]) == b""
    assert writer.body(b"hello") == b"HTTP/1.1 200 \r\ncontent-length: 5\r\n\r\nhello"
    assert writer.end() == b""
    assert writer.reusable


def test_a_body_of_unknown_length_is_chunked_for_http11_and_closes_for_http10() -> None:
    writer = _writer()
    assert writer.response(200, []) == b"HTTP/1.1 200 \r\nTransfer-Encoding: chunked\r\n\r\n"
    assert writer.body(b"abc") == b"3\r\nabc\r\n"
    assert writer.end() == b"0\r\n\r\n"
    assert writer.reusable
    old = _writer(version=b"1.0")
    assert old.response(200, []) == b"HTTP/1.1 200 \r\nConnection: close\r\n\r\n"
    assert old.body(b"abc") == b"abc"
    assert old.end() == b""
    assert old.state is DONE
    assert not old.reusable


def test_a_client_asking_to_close_is_answered_so_and_not_reused() -> None:
    writer = _writer(connection=b"close")
    writer.response(204, [])
    writer.end()
    assert not writer.reusable


def test_100_continue_only_while_the_client_waits_for_it() -> None:
    writer = _writer(expect=b"100-continue")
    assert writer.waiting_for_continue
    assert writer.informational(100, []) == b"HTTP/1.1 100 \r\n\r\n"
    assert (writer.waiting_for_continue, writer.state) == (False, WAITING)
    writer.response(200, [(b"content-length", b"0")])
    with pytest.raises(ResponseHeadError):
        writer.informational(100, [])  # after the response started
    assert writer.state is ERROR


def test_a_length_broken_or_a_second_response_raises_unless_the_client_failed() -> None:
    writer = _writer()
    writer.response(200, [(b"content-length", b"2")])
    with pytest.raises(ResponseHeadError):
        writer.body(b"abc")
    writer = _writer()
    writer.response(200, [(b"content-length", b"2")])
    with pytest.raises(ResponseHeadError):
        writer.end()
    writer = _writer()
    writer.response(200, [])
    with pytest.raises(ResponseHeadError):
        writer.response(200, [])
    failed = _writer()
    failed.client_failed = True
    failed.response(200, [])
    assert failed.response(200, []) == b""  # dropped, as hypercorn drops h11's error


def test_recycle_readies_the_next_request() -> None:
    writer = _writer(method=b"HEAD")
    writer.response(200, [(b"content-length", b"9")])
    assert writer.end() == b"HTTP/1.1 200 \r\ncontent-length: 9\r\n\r\n"  # no body for HEAD
    writer.recycle()
    assert writer.state is IDLE
    assert writer.may_answer
