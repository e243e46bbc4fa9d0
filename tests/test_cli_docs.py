"""The command-line reference (docs/cli.md) is the parsers' own, and every option is
documented: help, a HEADWATER_* variable that really sets it, its default."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from headwater.cli import SUBCOMMANDS, build_parser, env_name

REPO = Path(__file__).resolve().parent.parent


def test_the_reference_is_generated_from_the_parsers() -> None:
    # In a process of its own: the generator replaces the CPU count before any import.
    done = subprocess.run(
        [sys.executable, "-m", "scripts.gen_cli_docs", "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_option_has_help_and_a_variable_that_sets_it(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = build_parser(command)
    options = [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert options
    for action in options:
        name = action.option_strings[-1]
        if action.help == argparse.SUPPRESS:
            continue  # set by a supervisor for its children, not by users
        assert action.help, f"{command} {name}: no help"
        assert len(action.help) > 10, f"{command} {name}: {action.help!r} says nothing"
        if isinstance(action, argparse._AppendAction):
            continue  # repeatable: no variable of its own
        var = env_name(next(o for o in action.option_strings if o.startswith("--")))
        assert f"[env {var}]" in action.help, f"{command} {name}: no variable in its help"
    # A variable sets its option: the parser built with it defaults to its value.
    valued = next(a for a in options if a.type is int and not isinstance(a, argparse._AppendAction))
    monkeypatch.setenv(env_name(valued.option_strings[0]), "7")
    flag = next((a for a in options if isinstance(a, argparse._StoreTrueAction)), None)
    if flag is not None:
        monkeypatch.setenv(env_name(flag.option_strings[0]), "true")
    parsed = build_parser(command).parse_args([])
    assert getattr(parsed, valued.dest) == 7
    if flag is not None:
        assert getattr(parsed, flag.dest) is True
