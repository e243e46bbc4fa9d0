"""Options declared once: a config dataclass's field says what its command-line option is.

A field becomes an option of ``headwater serve`` (or ``worker``) when it is declared
with :func:`option`: its help, the group ``--help`` shows it in, and what argparse needs
beyond what the default already says (the type of the default is the option's type, an
enum's members are its choices, a bool is an ``--x``/``--no-x`` pair). From that one
declaration :mod:`headwater.cli.options` generates the option, its ``HEADWATER_*``
variable, its ``--help`` line and its row in docs/cli.md, and reads the parsed value back
into the config. Adding an option is adding a field.

Plain ``field(metadata={"help": ...})`` declarations (the engines' configs) are options
too: :func:`option` only spells out the keys this module defines.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

#: Seconds a process drains on SIGTERM, one default for all (a frontend, a worker, a
#: launched cluster's): in-flight requests finish while new ones go elsewhere. 30 s, as
#: Kubernetes' default grace period; docs/fault-tolerance.md.
DRAIN_TIMEOUT = 30.0

#: The metadata keys an option's field may carry.
HELP = "help"  # what it does (required: a field without help is not an option)
GROUP = "group"  # the --help section it is listed under
TYPE = "type"  # argparse's type callable, when the default's type does not say enough
CHOICES = "choices"  # the values it takes, when not an enum's members
METAVAR = "metavar"
FLAGS = "flags"  # its option strings, when not --field-name
FROM_MODEL = "from_model"  # unset, the engine's model decides (else the field's default)
REPEAT = "repeat"  # may be given more than once; the values make a tuple
HIDDEN = "hidden"  # set by a supervisor for its children; not in --help
SUB = "sub_config"  # a field holding a config whose own fields are options


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    group: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: tuple[Any, ...] | None = None,
    metavar: str | None = None,
    flags: tuple[str, ...] | None = None,
    from_model: bool = False,
    repeat: bool = False,
    hidden: bool = False,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    repr: bool = True,
) -> Any:
    """A dataclass field that is also a command-line option (this module's docstring).

    ``from_model``: the option's default is "what the in-process engine's model says,
    else the field's default" (a tokenizer, a context length); the command line leaves
    it unset unless given. ``repeat``: a tuple field given as ``--x A --x B``.
    """
    metadata: dict[str, Any] = {HELP: help}
    for key, value in (
        (GROUP, group),
        (TYPE, type),
        (CHOICES, choices),
        (METAVAR, metavar),
        (FLAGS, flags),
    ):
        if value is not None:
            metadata[key] = value
    for key, flag in ((FROM_MODEL, from_model), (REPEAT, repeat), (HIDDEN, hidden)):
        if flag:
            metadata[key] = True
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata=metadata, repr=repr
    )


def sub_config(config_type: type[Any], *, group: str) -> Any:
    """A field holding a *config_type* (a concern's own config: the router's health
    rules, the request limits) whose option fields are options of the config that holds
    it, listed under *group*. Defaults to a *config_type* at its defaults."""
    return dataclasses.field(default_factory=config_type, metadata={SUB: config_type, GROUP: group})


def sub_config_fields(config_type: type[Any]) -> list[dataclasses.Field[Any]]:
    """The fields of *config_type* declared with :func:`sub_config`."""
    return [f for f in dataclasses.fields(config_type) if f.metadata.get(SUB)]


def option_fields(config_type: type[Any]) -> list[dataclasses.Field[Any]]:
    """The fields of *config_type* that are options (they have a help), in order."""
    return [f for f in dataclasses.fields(config_type) if f.metadata.get(HELP)]


def flags_of(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """A field's option strings: ``--field-name`` unless it names its own."""
    flags: tuple[str, ...] = f.metadata.get(FLAGS) or ("--" + f.name.replace("_", "-"),)
    return flags


def dest_of(f: dataclasses.Field[Any]) -> str:
    """Where argparse puts a field's value: its first option's name (``--kv-block-size``:
    ``kv_block_size``), unique across a command's options as field names need not be."""
    return flags_of(f)[0][2:].replace("-", "_")


# ---- value types: argparse ``type`` callables, each a clear error for a bad value -----


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """A number above 0."""
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A number of at least 0."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def sample_ratio(text: str) -> float:
    """A share from 0 to 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return value


def process_count(text: str) -> int:
    """``auto`` (0: the engine's choice, else one per usable CPU) or at least 1."""
    if text.strip().lower() == "auto":
        return 0
    return positive_int(text)


def address_list(text: str) -> tuple[str, ...]:
    """Comma-separated addresses (``tcp://a:1,tcp://b:2``), blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
