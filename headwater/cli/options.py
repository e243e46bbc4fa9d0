"""Option helpers shared by the subcommands: value types, ``HEADWATER_*`` variables, and
command-line options generated from a config dataclass (an engine's).

A config field becomes an option when its metadata has a ``help``: ``speedup_ratio:
float = field(default=1.0, metadata={"help": "..."})`` is ``--speedup-ratio``, typed
by its default, defaulting to it. :func:`add_config_options` declares them,
:func:`config_from_args` reads them back, :func:`config_argv` writes the ones that
differ from their defaults as a command line (a supervisor passing them to a child).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

# Re-exported: the subcommands take their logging from here.
from headwater.logs import LOG_FORMATS as LOG_FORMATS
from headwater.logs import configure_logging as configure_logging

if TYPE_CHECKING:
    from headwater.cluster.supervisor import RestartPolicy
    from headwater.etcd.client import EtcdCredentials
    from workers.engines.config import EngineConfig

ENV_PREFIX = "HEADWATER_"
LOG_LEVELS = ("debug", "info", "warning", "error")


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
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
        if not longs or action.dest in ("help",) or isinstance(action, argparse._AppendAction):
            continue  # a repeatable option has its own variable, if any (HEADWATER_API_KEYS)
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


# ---- options from a config dataclass ----------------------------------------------------


def option_fields(config_type: type[Any]) -> Iterator[dataclasses.Field[Any]]:
    """The fields of *config_type* that are command-line options (they have a help)."""
    for f in dataclasses.fields(config_type):
        if f.metadata.get("help"):
            yield f


def _option(f: dataclasses.Field[Any]) -> str:
    return "--" + f.name.replace("_", "-")


def add_config_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_type: type[Any]
) -> None:
    """Declare an option per option field of *config_type*; skip names already declared
    (two engines with a ``--max-num-seqs`` share the one option)."""
    defaults = config_type()
    taken = {s for a in parser._actions for s in a.option_strings}
    for f in option_fields(config_type):
        if _option(f) in taken:
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(
                _option(f),
                dest=f.name,
                default=default,
                action=argparse.BooleanOptionalAction,
                help=f.metadata["help"],
            )
        else:
            parser.add_argument(
                _option(f),
                dest=f.name,
                type=type(default),
                default=default,
                help=f.metadata["help"],
            )


def config_from_args(config_type: type[Any], args: argparse.Namespace) -> Any:
    """A *config_type* from the options parsed into *args* (others keep their defaults).

    Raises ValueError when the config rejects a value.
    """
    given = {
        f.name: getattr(args, f.name) for f in option_fields(config_type) if hasattr(args, f.name)
    }
    return config_type(**given)


def config_argv(config: Any) -> list[str]:
    """The options that give *config* from its type's defaults, as a command line."""
    defaults = type(config)()
    argv: list[str] = []
    for f in option_fields(type(config)):
        value = getattr(config, f.name)
        if value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            argv.append(_option(f) if value else "--no-" + _option(f)[2:])
        else:
            argv += [_option(f), f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def engine_frontend_defaults(engine_config: EngineConfig) -> dict[str, Any]:
    """What an engine's config tells the frontend in front of its workers, as
    FrontendConfig fields (:meth:`~workers.engines.base.EngineConfig.frontend_defaults`:
    the model's tokenizer, vocabulary size, context length, KV block size, and how many
    frontend processes ``--processes auto`` means; by default one per usable CPU). Raises
    ValueError for a model directory that cannot be read."""
    return engine_config.frontend_defaults()


def add_etcd_options(parser: argparse.ArgumentParser | Any) -> None:
    """The options that authenticate to etcd (``--discovery``): a user and a password
    file, TLS files. The password is never an option value (a command line is public):
    ``--etcd-password-file`` or ``HEADWATER_ETCD_PASSWORD``."""
    g = parser.add_argument_group(
        "etcd authentication (docs/security.md; each also a HEADWATER_ETCD_* variable)"
    )
    g.add_argument("--etcd-username", default=None, help="etcd user (etcd's auth enabled)")
    g.add_argument(
        "--etcd-password-file",
        default=None,
        help="file holding that user's password (else HEADWATER_ETCD_PASSWORD)",
    )
    g.add_argument(
        "--etcd-ca-file",
        default=None,
        metavar="PEM",
        help="CA of etcd's server certificate, for etcds:// endpoints (default: "
        "the system's store)",
    )
    g.add_argument(
        "--etcd-cert-file",
        default=None,
        metavar="PEM",
        help="this end's client certificate (etcd's --client-cert-auth)",
    )
    g.add_argument(
        "--etcd-key-file", default=None, metavar="PEM", help="the private key of --etcd-cert-file"
    )


def etcd_credentials_from_args(args: argparse.Namespace) -> EtcdCredentials | None:
    """What :func:`add_etcd_options` declared; None when nothing is set. Raises
    ValueError (half a pair), OSError (an unreadable password file)."""
    from headwater.etcd.client import EtcdCredentials

    return EtcdCredentials.load(
        username=args.etcd_username,
        password_file=args.etcd_password_file,
        ca_file=args.etcd_ca_file,
        cert_file=args.etcd_cert_file,
        key_file=args.etcd_key_file,
    )


def add_restart_options(parser: argparse.ArgumentParser | Any, stops: str) -> None:
    """The options of a :class:`~headwater.cluster.supervisor.RestartPolicy`, for a
    supervisor whose given-up process stops *stops* ("the cluster")."""
    from headwater.cluster.supervisor import RestartPolicy

    r = RestartPolicy()
    a = parser.add_argument
    a(
        "--restart-backoff",
        type=positive_float,
        default=r.backoff,
        help="seconds before a process that exited is restarted: a random delay between "
        "half of this and this, whose upper bound doubles with each restart in a row",
    )
    a(
        "--restart-backoff-max",
        type=positive_float,
        default=r.backoff_max,
        help="the highest that upper bound goes (s)",
    )
    a(
        "--restart-budget",
        type=non_negative_int,
        default=r.budget,
        help=f"restarts allowed per process within --restart-window; its next exit stops "
        f"{stops} (0: never restart)",
    )
    a(
        "--restart-window",
        type=positive_float,
        default=r.window,
        help="seconds over which restarts are counted; a process up this long starts "
        "over at the first delay",
    )


def restart_policy_from_args(args: argparse.Namespace) -> RestartPolicy:
    """The policy :func:`add_restart_options` declared; ValueError for a bad one."""
    from headwater.cluster.supervisor import RestartPolicy

    return RestartPolicy(
        backoff=args.restart_backoff,
        backoff_max=args.restart_backoff_max,
        budget=args.restart_budget,
        window=args.restart_window,
    )
