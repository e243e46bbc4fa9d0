"""The ``headwater`` command: ``serve``, ``worker`` and ``launch``.

This package and :mod:`headwater.cluster` are headwater's top layer: the only code
that imports both the frontend and the workers (``tests/test_layering.py``). Each
subcommand is one module here exposing ``add_arguments(parser)`` and
``main(args) -> int``; it turns options into the config object of the code it runs.
Every option can also be set from the environment: ``--tokenizer-threads 4`` is
``HEADWATER_TOKENIZER_THREADS=4`` (command-line flags win;
:func:`headwater.cli.options.apply_env_defaults`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from headwater.cli.options import apply_env_defaults, env_name

#: subcommand → (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("headwater.cli.serve", "run the OpenAI-compatible HTTP frontend"),
    "worker": ("headwater.cli.worker", "run one prefill / decode / aggregated worker process"),
    "launch": ("headwater.cli.launch", "run a local cluster: etcd, workers and a frontend"),
}

__all__ = ["SUBCOMMANDS", "build_parser", "env_name", "main"]


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand; its module is imported only now (serve is heavy)."""
    module_name, help_text = SUBCOMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"headwater {command}",
        description=(module.__doc__ or help_text).strip(),
        formatter_class=_HelpFormatter,
        # The options are listed by group below; a usage line of all ~100 is unreadable.
        usage=f"headwater {command} [options]"
        + (" [-- SERVE OPTIONS]" if command == "launch" else ""),
    )
    module.add_arguments(parser)
    apply_env_defaults(parser)
    parser.set_defaults(_main=module.main)
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help, unless it has none to show: unset (None, an
    empty value) or said in the help already ("default: the engine's ...")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, "", [], ()) or "default:" in text or "(default" in text:
            return text
        return super()._get_help_string(action)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        top = argparse.ArgumentParser(
            prog="headwater",
            description="headwater: a structured-concurrency frontend for LLM inference serving",
            epilog="\n".join(f"  {n:<8} {h}" for n, (_, h) in SUBCOMMANDS.items()),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        top.add_argument("command", choices=list(SUBCOMMANDS), help="see below; COMMAND --help")
        top.parse_args(argv[:1])
        return 2
    args = build_parser(argv[0]).parse_args(argv[1:])
    args.argv = tuple(argv[1:])  # the command line as given: supervisors pass it on
    return int(args._main(args) or 0)
