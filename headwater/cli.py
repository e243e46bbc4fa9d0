"""The ``headwater`` command: ``serve``, ``worker``, ``launch`` and ``bench``.

Each subcommand lives next to the code it runs and exposes two functions,
``add_arguments(parser)`` and ``main(args) -> int``. Every option can also be set
from the environment: ``--tokenizer-threads 4`` is ``HEADWATER_TOKENIZER_THREADS=4``
(command-line flags win). :class:`EnvDefaults` does that for all subcommands at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

#: subcommand → (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("frontend.cli", "run the OpenAI-compatible HTTP frontend"),
    "worker": ("workers.cli", "run one prefill / decode / aggregated worker process"),
    "launch": ("headwater.launch", "run a local cluster: etcd, workers and a frontend"),
    "bench": ("headwater.bench", "run the benchmark suite"),
}

ENV_PREFIX = "HEADWATER_"


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a number above 0."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def env_name(option: str) -> str:
    """``--tokenizer-threads`` → ``HEADWATER_TOKENIZER_THREADS``."""
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def apply_env_defaults(parser: argparse.ArgumentParser) -> None:
    """Let ``HEADWATER_*`` variables override the defaults of *parser*'s options.

    Values go through the option's own ``type`` so validation is identical; flags
    (``store_true``) accept 1/true/yes/on. The help text names each variable.
    """
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.dest in ("help",):
            continue
        var = env_name(longs[0])
        if action.help and action.help is not argparse.SUPPRESS:
            action.help = f"{action.help} [env {var}]"
        raw = os.environ.get(var)
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = raw.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(action, argparse._StoreFalseAction):
            action.default = raw.strip().lower() not in ("1", "true", "yes", "on")
        else:
            conv = action.type or str
            try:
                action.default = conv(raw)  # type: ignore[operator]
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{var}={raw!r}: {exc}")
            if action.choices is not None and action.default not in action.choices:
                parser.error(f"{var}={raw!r}: choose from {', '.join(map(str, action.choices))}")


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand; its module is imported only now (serve is heavy)."""
    module_name, help_text = SUBCOMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"headwater {command}",
        description=(module.__doc__ or help_text).strip(),
        formatter_class=_HelpFormatter,
    )
    module.add_arguments(parser)
    apply_env_defaults(parser)
    parser.set_defaults(_main=module.main)
    return parser


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


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


if __name__ == "__main__":
    sys.exit(main())
