"""The dashboard's recent errors: every error answer with its request id, bounded."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from frontend.http.dashboard import LoadHistory
from frontend.http.recent_errors import MAX_MESSAGE, ErrorAnswer, RecentErrors, error_fields
from headwater.cluster.group_view import Member, merge_dashboards

MODEL = "deepseek-v4"


def test_error_fields_read_openai_and_anthropic_shapes() -> None:
    openai = {"error": {"message": "bad", "type": "invalid_request_error", "code": None}}
    anthropic = {"type": "error", "error": {"type": "not_found_error", "message": "gone"}}
    assert error_fields(orjson.dumps(openai)) == ("invalid_request_error", "bad")
    assert error_fields(orjson.dumps(anthropic)) == ("not_found_error", "gone")
    assert error_fields(b"<html>502</html>") == (None, None)
    assert error_fields(b'{"error": "a string"}') == (None, None)
    assert error_fields(b"[1, 2]") == (None, None)
    long = orjson.dumps({"error": {"message": "x" * 10_000, "type": "t"}})
    assert error_fields(long) == ("t", "x" * MAX_MESSAGE)


def test_the_ring_keeps_the_newest_and_counts_all() -> None:
    ring = RecentErrors(capacity=3)
    for i in range(5):
        ring.add(ErrorAnswer(float(i), 400, "POST", "/v1/x", f"r{i}", None, None))
    assert [e.request_id for e in ring.records()] == ["r4", "r3", "r2"]
    assert ring.total == 5
    with pytest.raises(ValueError):
        RecentErrors(capacity=0)


async def test_error_answers_reach_the_dashboard_with_their_request_ids(headwater: Any) -> None:
    server = await headwater.start()
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    async with server.client() as client:
        assert (await client.post("/v1/chat/completions", json=ok)).status_code == 200
        bad_json = await client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json", "X-Request-Id": "client-id-1"},
        )
        assert bad_json.status_code == 400
        unknown = await client.post("/v1/chat/completions", json={**ok, "model": "nope"})
        assert unknown.status_code == 404
        generated = unknown.headers["X-Request-Id"]
        anthropic = await client.post("/v1/messages", json={"model": MODEL, "messages": []})
        assert anthropic.status_code == 400
        assert (await client.get("/debug/no-such-view")).status_code == 404  # own views: not
        data = (await client.get("/dashboard/data")).json()
    errors = data["errors"]
    assert [e["status"] for e in errors] == [400, 404, 400]  # newest first; the 200 is not one
    first_anthropic, second_unknown, third_bad = errors
    assert third_bad["request_id"] == "client-id-1"
    assert third_bad["type"] == "invalid_request_error"
    assert third_bad["message"]
    assert (third_bad["method"], third_bad["path"]) == ("POST", "/v1/chat/completions")
    assert second_unknown["request_id"] == generated
    assert "nope" in second_unknown["message"]
    assert first_anthropic["path"] == "/v1/messages"
    assert first_anthropic["type"] == "invalid_request_error"  # Anthropic's shape read too
    assert first_anthropic["request_id"] == anthropic.headers["X-Request-Id"]


def test_a_groups_dashboard_merges_every_processs_errors_newest_first() -> None:
    def snapshot(errors: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "model": MODEL,
            "loop": {
                "threshold_s": 0.02,
                "window_s": 60.0,
                "bucket_s": 0.25,
                "delays": [],
                "max_delay_s": 0.0,
                "instrumented": True,
            },
            "stalls": {"records": [], "statistics": None},
            "pool": {"mode": "thread"},
            "requests": {"inflight": 0, "by_status": {}, "by_code": {}, "disconnected_clients": 0},
            "latency": {name: {"window_s": 60.0, "count": 0} for name in ("ttft", "itl")},
            "workers": [],
            "errors": errors,
        }

    def error(at: float, rid: str) -> dict[str, Any]:
        return ErrorAnswer(at, 429, "POST", "/v1/completions", rid, "rate_limit", "m").to_dict()

    members = [
        Member(slot=i, pid=100 + i, url=f"http://127.0.0.1:{9000 + i}", running=True, restarts=0)
        for i in (0, 1)
    ]
    parts = [snapshot([error(3.0, "a3"), error(1.0, "a1")]), snapshot([error(2.0, "b2")])]
    merged = merge_dashboards(members, parts, LoadHistory(), 10.0, [])
    assert [(e["request_id"], e["process"]) for e in merged["errors"]] == [
        ("a3", 0),
        ("b2", 1),
        ("a1", 0),
    ]
