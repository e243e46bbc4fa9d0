"""Secrets kept out of process command lines, where every user of the machine reads them.

A process's command line is public on Linux (``ps``, ``/proc/PID/cmdline``), and every
process forked from it (a frontend group's) shows the same one. So headwater takes its
secrets from files and the environment (``--api-keys-file``, ``HEADWATER_API_KEYS``,
``--plane-secret-file``, ``HEADWATER_PLANE_SECRET``, ``--etcd-password-file``), passes
them to the processes it starts the same way, and for an ``--api-key`` given on the
command line all the same:

* :func:`hide_in_cmdline` overwrites the values in this process's own command line (the
  memory the kernel reads it from), at start, before any fork; ``ps`` shows ``*`` in
  their place from then on (a short window at start remains: use the file);
* :func:`api_keys_to_env` takes them out of a child's command line and into its
  environment, which only the same user (and root) can read; a child that needs none of
  them gets none (:mod:`headwater.secret_env`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence

from headwater.secret_env import API_KEYS_ENV

log = logging.getLogger(__name__)

__all__ = ["API_KEYS_ENV", "api_keys_to_env", "hide_in_cmdline"]
_API_KEY_OPTION = "--api-key"


def hide_in_cmdline(values: Iterable[str]) -> int:
    """Overwrite each of *values* with ``*`` wherever it stands in this process's command
    line as the kernel shows it; return how many were hidden. Linux only (elsewhere, or if
    the command line cannot be found, 0). ``sys.argv`` is a copy and keeps them."""
    wanted = [v.encode() for v in values if v]
    if not wanted:
        return 0
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Fields after the command name (which may hold spaces): the 48th and 49th
        # fields of the line are where the argument strings start and end.
        fields = stat[stat.rindex(b")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
        if not 0 < start < end:
            return 0
        area = ctypes.string_at(start, end - start)
    except (OSError, ValueError, IndexError):
        return 0
    hidden = 0
    for arg_at, arg in _arguments(area):
        for value in wanted:
            # The value alone (--api-key KEY), or after "=" (--api-key=KEY).
            if arg == value or arg.endswith(b"=" + value):
                ctypes.memset(start + arg_at + len(arg) - len(value), ord("*"), len(value))
                hidden += 1
    return hidden


def _arguments(area: bytes) -> list[tuple[int, bytes]]:
    """The NUL-separated arguments of *area*, each with its offset."""
    out, at = [], 0
    for arg in area.split(b"\0"):
        out.append((at, arg))
        at += len(arg) + 1
    return out


def api_keys_to_env(argv: Sequence[str], env: dict[str, str]) -> list[str]:
    """*argv* without its ``--api-key KEY`` / ``--api-key=KEY`` options; their keys are
    added to ``HEADWATER_API_KEYS`` in *env* (which the child reads as well). A key with a
    comma cannot travel in that comma-separated variable: it stays in the command line
    (hidden there by the child at its start), with a warning to use a keys file."""
    out: list[str] = []
    keys: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == _API_KEY_OPTION and i + 1 < len(argv):
            key, i = argv[i + 1], i + 2
        elif arg.startswith(_API_KEY_OPTION + "="):
            key, i = arg.partition("=")[2], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        if "," in key:
            log.warning(
                "an API key with a comma stays on a child's command line; "
                "give it in --api-keys-file instead"
            )
            out += [_API_KEY_OPTION, key]
        else:
            keys.append(key)
    if keys:
        present = [k for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
        env[API_KEYS_ENV] = ",".join([*present, *keys])
    return out
