"""Write docs/cli.md, the command-line reference, from the parsers themselves.

Every option of ``headwater serve``, ``worker`` and ``launch``, by group as ``--help``
shows them: its names, its ``HEADWATER_*`` variable, its default and its help. Generated
so that it cannot drift from the code: tests/test_cli_docs.py runs this and compares.

    python -m scripts.gen_cli_docs            # rewrite docs/cli.md
    python -m scripts.gen_cli_docs --check    # exit 1 if docs/cli.md is not up to date

Defaults that depend on the machine (one per usable CPU) are written as such, not as this
machine's count: the CPU count is replaced by a marker before the parsers are built.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import headwater.machine

_MARKER = 987_654  # stands for "one per usable CPU" while the parsers are built


def _marked_cpus() -> int:
    return _MARKER


headwater.machine.usable_cpus = _marked_cpus  # before anything imports it by name

from headwater.cli import SUBCOMMANDS, build_parser, env_name  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
HEAD = """# Command-line reference

Every option of `headwater serve`, `headwater worker` and `headwater launch`, as `--help`
groups them. Each option but the repeatable ones is also an environment variable (the
column *variable*); a flag given on the command line wins over the variable. A pair
`--x` / `--no-x` has one variable, `HEADWATER_X`, true (1, true, yes, on) or false. An option
of another engine than `--engine`'s is refused, not ignored. Generated from the parsers by
`python -m scripts.gen_cli_docs`; `tests/test_cli_docs.py` fails when this page and the code
differ. Each option is declared once, as a config field (docs/architecture.md, "Adding an
option").
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace(str(_MARKER), "one per usable CPU")


def _default(action: argparse.Action) -> str:
    value: Any = action.default
    if value is None or value is argparse.SUPPRESS or value == [] or value == "":
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "on" if value else "off"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    return f"`{value}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    formatter = parser._get_formatter()
    text = formatter._expand_help(action)
    # The variable and the default have columns of their own.
    text = re.sub(r" \[env [A-Z0-9_]+\]", "", text)
    return re.sub(r" \(default: [^()]*(\([^()]*\)[^()]*)*\)$", "", text)


def reference() -> str:
    """The page."""
    out = [HEAD]
    for command, (_, summary) in SUBCOMMANDS.items():
        parser = build_parser(command)
        count = 0
        sections = []
        for group in parser._action_groups:
            rows = []
            for action in group._group_actions:
                if not action.option_strings or action.help == argparse.SUPPRESS:
                    continue
                if isinstance(action, argparse._HelpAction):
                    continue
                first_long = next(o for o in action.option_strings if o.startswith("--"))
                names = ", ".join(f"`{o}`" for o in action.option_strings)
                # A repeatable option has no variable (or one of its own, its help says).
                var = "" if isinstance(action, argparse._AppendAction) else env_name(first_long)
                rows.append(
                    f"| {names} | {f'`{var}`' if var else ''} | {_cell(_default(action))} "
                    f"| {_cell(_help(parser, action))} |"
                )
            if rows:
                count += len(rows)
                title = group.title or "options"
                sections.append(f"### {title[0].upper() + title[1:]}\n")
                sections.append("| option | variable | default | what it does |")
                sections.append("|---|---|---|---|")
                sections.extend(rows)
                sections.append("")
        out.append(f"## `headwater {command}`\n")
        out.append(f"{summary[0].upper() + summary[1:]}: {count} options.\n")
        out.extend(sections)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    text = reference()
    if "--check" in argv:
        if DOC.read_text(encoding="utf-8") != text:
            print("docs/cli.md is out of date: python -m scripts.gen_cli_docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text, encoding="utf-8")
    print(DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
