"""Schemathesis against a live ``headwater serve``, from the server's own ``/openapi.json``.

Policy: one real process (``python -m headwater serve``, HF tokenizer backend: about
1 s to load) on 127.0.0.1 port 0, with an API key, so the keyed routes and the open
probes are both exercised; ``st run`` (schemathesis' CLI) with a fixed seed and a
bounded number of examples per operation, in two runs of about a minute each (the core
API, and the APIs translated onto the chat pipeline). The server is started
with a small context and ``--max-tokens-cap 64``, so that the longest completion the
document allows is short, and with a request deadline, so that 504 is in the document.

The checks: no 5xx (``not_a_server_error``); every status, content type, header and
body as documented (``*_conformance``, SSE events included); schema-invalid bodies
refused with a 4xx (``negative_data_rejection``); an undeclared method gets 405 with
``Allow`` (``unsupported_method``); a keyed route refuses a request without the key
(``ignored_auth``). Not ``positive_data_acceptance``: some schema-valid bodies are
refused on purpose (JSON Schema's ``integer`` admits ``2.0``, which the API refuses as
OpenAI's does; a chat template refuses an empty developer message).

Schemathesis is in the test extra; without it the test skips, except under ``CI=true``
where it fails.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import trio

from headwater.cluster.recipes import spawn_frontend, wait_healthy

KEY = "schemathesis-key"
SERVE = (
    sys.executable,
    "-m",
    "headwater",
    "serve",
    "--host",
    "127.0.0.1",
    "--port",
    "0",
    "--tokenizer-backend",
    "hf",
    "--speedup-ratio",
    "1000",
    "--context-length",
    "4096",
    "--max-tokens-cap",
    "64",
    "--request-timeout",
    "30",
    "--log-level",
    "warning",
)
CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "unsupported_method",
    "ignored_auth",
)


def _schemathesis() -> str:
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        message = "schemathesis is not installed (pip install -e '.[test]')"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return st


#: The operations in two runs, each about a minute on an idle machine: OpenAI's and the
#: rest of the core API; the APIs translated onto the chat pipeline (/tokenize,
#: Anthropic's Messages, OpenAI's Responses). Not GET and DELETE /v1/responses/{id}: their
#: ids come from a POST, which a link cannot follow through a stream, so every id
#: schemathesis made up would be a 404 (tests/test_api_responses.py checks them).
TRANSLATED = "^/(tokenize|detokenize|v1/messages|v1/responses)"
TRANSLATED_POSTS = "^/(tokenize|detokenize|v1/messages|v1/messages/count_tokens|v1/responses)$"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "operations",
    [("--exclude-path-regex", TRANSLATED), ("--include-path-regex", TRANSLATED_POSTS)],
    ids=["core", "translated"],
)
async def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    tmp_path: Path, nursery: trio.Nursery, operations: tuple[str, str]
) -> None:
    st = _schemathesis()
    env = {**os.environ, "HEADWATER_API_KEYS": KEY}
    frontend = await spawn_frontend(
        nursery,
        SERVE,
        name="frontend",
        env=env,
        log_path=tmp_path / "frontend.log",
        ready_within=90,
    )
    await wait_healthy(frontend.address, within=60, child=frontend)
    run = await trio.run_process(
        [
            st,
            "run",
            f"{frontend.address}/openapi.json",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--checks",
            ",".join(CHECKS),
            "--max-examples",
            "15",
            "--seed",
            "20261201",
            "--generation-database",
            "none",
            "--workers",
            "2",
            "--request-timeout",
            "60",
            *operations,
        ],
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    out = (run.stdout + run.stderr).decode(errors="replace")
    assert run.returncode == 0, out[-20_000:] + "\n--- server log ---\n" + frontend.log_tail()
    assert "No issues found" in out, out[-5_000:]
    assert frontend.returncode is None  # the server is still up
