"""The environment variables that carry headwater's secrets, and an environment without them.

A process that starts another gives it, by environment, only the secrets it needs
(``headwater.cli.secret_args`` moves API keys there from command lines): a child that
needs none (etcd, a vLLM server) gets :func:`without_secrets`, since what it does not
hold it cannot leak (its logs, its crash reports, its own children).
"""

from __future__ import annotations

from collections.abc import Mapping

#: The variable the frontend reads API keys from (comma-separated).
API_KEYS_ENV = "HEADWATER_API_KEYS"
#: Every variable that carries one of headwater's secrets: API keys, the plane secret,
#: etcd's password.
SECRET_ENV_VARS = (API_KEYS_ENV, "HEADWATER_PLANE_SECRET", "HEADWATER_ETCD_PASSWORD")


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """*env* without :data:`SECRET_ENV_VARS`, for a child that needs none of them."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV_VARS}
