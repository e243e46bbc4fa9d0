"""Option helpers shared by the subcommands: value types, ``HEADWATER_*`` variables, and
command-line options generated from config dataclasses (the frontend's, an engine's).

A config field becomes an option when its metadata has a ``help``
(:mod:`headwater.config_fields`): ``speedup_ratio: float = field(default=1.0,
metadata={"help": "..."})`` is ``--speedup-ratio``, typed by its default, defaulting to
it. :func:`add_config_options` declares them,
:func:`config_from_args` reads them back, :func:`config_argv` writes the ones that
differ from their defaults as a command line (a supervisor passing them to a child).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
from typing import TYPE_CHECKING, Any

from headwater.config_fields import (
    CHOICES,
    FROM_MODEL,
    GROUP,
    HELP,
    HIDDEN,
    METAVAR,
    REPEAT,
    SUB,
    TYPE,
    dest_of,
    flags_of,
    option_fields,
    sub_config_fields,
)

# Re-exported: the value types of options, for the subcommands' own.
from headwater.config_fields import non_negative_float as non_negative_float
from headwater.config_fields import non_negative_int as non_negative_int
from headwater.config_fields import positive_float as positive_float
from headwater.config_fields import positive_int as positive_int

# Re-exported: the subcommands take their logging from here.
from headwater.logs import LOG_FORMATS as LOG_FORMATS
from headwater.logs import LOG_LEVELS as LOG_LEVELS
from headwater.logs import configure_logging as configure_logging

if TYPE_CHECKING:
    from headwater.etcd.client import EtcdCredentials
    from workers.engines.config import EngineConfig

ENV_PREFIX = "HEADWATER_"


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
        if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
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


# ---- options from a config dataclass (headwater/config_fields.py) -----------------------


def add_config_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_type: type[Any]
) -> None:
    """Declare an option per option field of *config_type*, and of each config it holds
    (:func:`~headwater.config_fields.sub_config`), each in the ``--help`` group its
    field names (given a parser; a group given keeps them all). Names already declared
    are skipped: two engines with a ``--max-num-seqs`` share the one option."""
    taken = {s for a in parser._actions for s in a.option_strings}
    for f in option_fields(config_type):
        flags = flags_of(f)
        if flags[0] in taken:
            continue
        meta = f.metadata
        target = parser
        if isinstance(parser, argparse.ArgumentParser) and meta.get(GROUP):
            target = argument_group(parser, meta[GROUP])
        default = _field_default(f)
        kwargs: dict[str, Any] = {
            "dest": dest_of(f),
            "help": argparse.SUPPRESS if meta.get(HIDDEN) else meta[HELP],
        }
        if meta.get(METAVAR):
            kwargs["metavar"] = meta[METAVAR]
        if isinstance(default, bool):
            target.add_argument(
                *flags, default=default, action=argparse.BooleanOptionalAction, **kwargs
            )
            continue
        if isinstance(default, enum.Enum):
            kwargs["choices"] = [m.value for m in type(default)]
            conv: Any = str
        else:
            conv = meta.get(TYPE) or (str if default is None or meta.get(REPEAT) else type(default))
            if meta.get(CHOICES):
                kwargs["choices"] = list(meta[CHOICES])
        if meta.get(REPEAT):
            target.add_argument(*flags, type=conv, action="append", default=None, **kwargs)
        else:
            unset = meta.get(FROM_MODEL) or isinstance(default, tuple)
            target.add_argument(*flags, type=conv, default=None if unset else default, **kwargs)
    for f in sub_config_fields(config_type):
        group = parser
        if isinstance(parser, argparse.ArgumentParser):
            group = argument_group(parser, f.metadata[GROUP])
        add_config_options(group, f.metadata[SUB])


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"option {f.name} has no default")


def argument_group(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """*parser*'s group titled *title*, made if it has none yet."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def config_from_args(
    config_type: type[Any],
    args: argparse.Namespace,
    model_defaults: dict[str, Any] | None = None,
    **fixed: Any,
) -> Any:
    """A *config_type* from the options parsed into *args*, others at their defaults,
    the configs it holds (:func:`~headwater.config_fields.sub_config`) likewise.

    *model_defaults*: what the engine's model decides, by option (``kv_block_size``),
    for the ``from_model`` options left unset; *fixed*: fields that are not options.
    Raises ValueError when a config rejects a value.
    """
    model_defaults = model_defaults or {}
    given: dict[str, Any] = {}
    for f in option_fields(config_type):
        value = getattr(args, dest_of(f), None)
        if value is None and f.metadata.get(FROM_MODEL):
            value = model_defaults.get(dest_of(f))
        if value is not None:
            given[f.name] = tuple(value) if isinstance(value, list) else value
    for f in sub_config_fields(config_type):
        if f.name not in fixed:
            given[f.name] = config_from_args(f.metadata[SUB], args, model_defaults)
    return config_type(**{**given, **fixed})


def config_argv(config: Any) -> list[str]:
    """The options that give *config* from its type's defaults, as a command line."""
    argv: list[str] = []
    for f in option_fields(type(config)):
        value = getattr(config, f.name)
        if value == _field_default(f):
            continue
        flag = flags_of(f)[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def declared_flags(config_type: type[Any]) -> set[str]:
    """Every option string of *config_type*'s options and its sub-configs'."""
    flags = {flag for f in option_fields(config_type) for flag in flags_of(f)}
    for f in sub_config_fields(config_type):
        flags |= declared_flags(f.metadata[SUB])
    return flags


def engine_config_from_args(
    args: argparse.Namespace, shared: set[str] | frozenset[str] = frozenset()
) -> EngineConfig:
    """The chosen engine's (``--engine``) config from its options. An option given on the
    command line that only other engines have is refused (ValueError): ``--model`` with
    the mocker would otherwise be ignored without a word. *shared*: the command's own
    options, which an engine may share (``serve --model-vocab-size``). Variables are not
    checked: a deployment's environment may carry every engine's."""
    from workers.engines import registry

    owners: dict[str, list[str]] = {}
    for name in registry.names():
        for f in option_fields(registry.config_type(name)):
            for flag in flags_of(f):
                owners.setdefault(flag, []).append(name)
                owners.setdefault("--no-" + flag[2:], []).append(name)
    argv = list(getattr(args, "argv", ()))
    if "--" in argv:  # launch: what follows is the frontend's
        argv = argv[: argv.index("--")]
    for word in argv:
        flag = word.split("=", 1)[0]
        engines = owners.get(flag)
        if engines and args.engine not in engines and flag not in shared:
            raise ValueError(
                f"{flag} is an option of the {' and '.join(engines)} engine, not of "
                f"{args.engine} (--engine {args.engine})"
            )
    config: EngineConfig = config_from_args(registry.config_type(args.engine), args)
    return config


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
