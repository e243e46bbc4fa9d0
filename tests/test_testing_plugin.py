"""headwater's pytest plugin, as its users meet it: their test files, run by pytest.

Policy: ``pytester`` runs the user's files in this process (the tokenizer, loaded once,
is shared; imported modules stay), with the plugin named by ``-p`` as its entry point
names it, warnings as errors, and no other configuration: what a project that installed
headwater has. The examples of docs/examples are such files.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import openai
import pytest

import headwater.testing.sdk
import headwater.testing.server

#: pytester forgets the modules an inner run imported, and with them the tokenizer the
#: server caches: imported here, they stay for every run.
KEPT = (openai, headwater.testing.sdk, headwater.testing.server)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "docs" / "examples").glob("test_*.py"))
PLUGIN = "headwater.testing.plugin"

#: A user's test file: the issue's agent test, the marker, the 60-second generation; each
#: writes what it saw (without ids: they are random) for the second run to compare.
USER_TESTS = """
import json, os, time
import pytest, trio

pytestmark = pytest.mark.trio
DSML = "｜DSML｜"
CALL = (f"<{DSML}tool_calls>\\n<{DSML}invoke name=\\"get_weather\\">\\n"
        f"<{DSML}parameter name=\\"city\\" string=\\"true\\">Paris</{DSML}parameter>\\n"
        f"</{DSML}invoke>\\n</{DSML}tool_calls>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
SEEN = {}

def see(name, value):
    SEEN[name] = value
    with open(f"seen-{os.environ['RUN']}.json", "w") as f:
        json.dump(SEEN, f, sort_keys=True)

async def my_agent(client, question):
    r = await client.chat.completions.create(
        model="deepseek-v4", messages=[{"role": "user", "content": question}], tools=TOOLS)
    return r.choices[0].message

async def test_agent_retries_a_broken_stream(headwater, autojump_clock):
    server = await headwater.start(script=[{"prompt_contains": "weather", "text": CALL}])
    server.faults.break_stream(after_tokens=5, times=1)
    answer = await my_agent(server.openai_client(), "what is the weather in Paris?")
    assert answer.tool_calls[0].function.name == "get_weather"
    assert server.requests[-1].attempt == 2
    see("agent", [answer.tool_calls[0].function.arguments, trio.current_time(),
                  [(leg.worker_id, leg.outcome, leg.tokens, leg.started, leg.ended)
                   for leg in server.requests[-1].legs]])

@pytest.mark.headwater([{"default": True, "text": "Hi there."}], token_delay=0.1)
async def test_marker_script(headwater_server, autojump_clock):
    client = headwater_server.client()
    r = await client.post("/v1/completions", json={"model": "deepseek-v4", "prompt": "x"})
    assert r.json()["choices"][0]["text"] == "Hi there."
    see("marker", [r.json()["usage"], trio.current_time()])

async def test_a_60_second_generation_takes_no_real_time(headwater, autojump_clock):
    server = await headwater.start(script=[{"default": True, "text": "tick " * 100}],
                                   token_delay=1.0)
    client = server.openai_client()
    start, wall = trio.current_time(), time.perf_counter()
    r = await client.chat.completions.create(
        model="deepseek-v4", messages=[{"role": "user", "content": "go"}], max_tokens=60)
    wall = time.perf_counter() - wall
    assert r.choices[0].finish_reason == "length"
    assert trio.current_time() - start == 60.0
    assert wall < 1.0, wall
    print(f"60 s of generation took {wall:.3f} s")
    see("minute", [r.choices[0].message.content, r.usage.completion_tokens])
"""


#: Warnings are errors, but the SDKs' streams' unfinished async generators, which they
#: leave to the garbage collector at [DONE] (as this repository's pyproject.toml says).
INI = r"""
[pytest]
filterwarnings =
    error
    ignore:Async generator '(http(x|core)2?|openai\._streaming)\.:ResourceWarning
"""


def run_twice(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> list[pytest.RunResult]:
    pytester.makeini(INI)
    results = []
    for run in ("1", "2"):
        monkeypatch.setenv("RUN", run)
        # importlib: the examples' modules may be imported already, from docs/examples.
        results.append(
            pytester.runpytest_inprocess(
                "-p",
                PLUGIN,
                "-p",
                "no:cacheprovider",
                "--import-mode=importlib",
                "-rA",
                "-s",
            )
        )
    return results


def outcomes(result: pytest.RunResult) -> list[str]:
    """``PASSED test_x.py::test_y`` lines, sorted."""
    return sorted(
        line
        for line in result.outlines
        if line.startswith(("PASSED ", "FAILED ", "ERROR ", "SKIPPED "))
    )


@pytest.mark.slow
def test_a_users_test_file_passes_and_runs_the_same_twice(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_user=USER_TESTS)
    first, second = run_twice(pytester, monkeypatch)
    first.assert_outcomes(passed=3)
    second.assert_outcomes(passed=3)
    assert outcomes(first) == outcomes(second)
    seen = [json.loads((pytester.path / f"seen-{run}.json").read_text()) for run in "12"]
    assert seen[0] == seen[1]
    assert set(seen[0]) == {"agent", "marker", "minute"}
    assert any("60 s of generation took" in line for line in first.outlines)


@pytest.mark.slow
def test_the_examples_pass_twice_alike(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert [p.name for p in EXAMPLES] == [
        "test_agent_loop.py",
        "test_retry_policy.py",
        "test_streaming_consumer.py",
    ]
    for example in EXAMPLES:
        pytester.makepyfile(**{example.stem: example.read_text()})
    first, second = run_twice(pytester, monkeypatch)
    first.assert_outcomes(passed=9)
    assert outcomes(first) == outcomes(second)


def test_the_marker_takes_one_script(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_marker=textwrap.dedent("""
        import pytest
        @pytest.mark.trio
        @pytest.mark.headwater([{"default": True, "text": "a"}], script="b.jsonl")
        async def test_two_scripts(headwater_server):
            pass
    """)
    )
    result = pytester.runpytest_inprocess("-p", PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*takes the script as its only positional argument*"])


def test_the_entry_point_alone_brings_the_fixtures(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `pip install headwater` registers (pyproject.toml's pytest11 entry point),
    # as installed metadata on the path: a user's test needs nothing else.
    with (REPO / "pyproject.toml").open("rb") as f:
        entry_points = tomllib.load(f)["project"]["entry-points"]["pytest11"]
    assert entry_points == {PLUGIN: PLUGIN}
    dist = pytester.mkdir("site") / "headwater_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: headwater-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    )
    monkeypatch.syspath_prepend(str(pytester.path / "site"))
    pytester.makepyfile(
        test_hello=textwrap.dedent("""
        import pytest
        @pytest.mark.trio
        @pytest.mark.headwater([{"default": True, "text": "Hello."}])
        async def test_hello(headwater_server, autojump_clock):
            r = await headwater_server.client().post("/v1/completions",
                                                     json={"model": "deepseek-v4", "prompt": "Hi"})
            assert r.json()["choices"][0]["text"] == "Hello."
    """)
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "error")
    result.assert_outcomes(passed=1)


@pytest.mark.slow
def test_the_plugin_loads_nothing_until_a_fixture_is_used() -> None:
    # Autoloaded in every project that installs headwater: its import must stay light,
    # and the SDKs optional even for headwater.testing.
    code = textwrap.dedent(f"""
        import sys
        import {PLUGIN}
        plugin_only = set(sys.modules)
        import headwater.testing
        print(sorted(m for m in ("frontend", "quart", "tokenizers") if m in plugin_only))
        print(sorted(m for m in ("openai", "anthropic", "httpx2") if m in sys.modules))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")
    assert out[:2] == ["[]", "[]"]
