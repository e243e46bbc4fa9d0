"""Shared pytest fixtures. Each group lives in its own module and is imported here."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from headwater.secret_env import SECRET_ENV_VARS

from etcd_fixture import etcd_prefix, etcd_server, etcd_url, private_etcd
from frontend_fixture import http_parser
from heap_fixture import frozen_heap
from netns_fixture import make_netns
from tls_fixture import ca
from vllm_fixture import start_in_background, stop_cluster, vllm_cluster

__all__ = [
    "ca",
    "etcd_prefix",
    "etcd_server",
    "etcd_url",
    "frozen_heap",
    "http_parser",
    "make_netns",
    "private_etcd",
    "vllm_cluster",
]


@pytest.hookimpl(trylast=True)  # after ``-m`` deselected: ``-m "not vllm"`` starts none
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` run last, and their vLLM servers start now, in the
    background, while the others run (tests/vllm_fixture.py)."""
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    if not vllm:
        return
    items[:] = [item for item in items if not item.get_closest_marker("vllm")] + vllm
    start_in_background()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_cluster()


@pytest.fixture(autouse=True)
def _secrets_stay_in_their_test() -> Iterator[None]:
    """The secret variables each test started with are there when it ends: a test that
    sets one (through code under test, beyond monkeypatch's reach) would otherwise have
    every later test's plane clients demand a secret their workers do not have."""
    before = {name: os.environ.get(name) for name in SECRET_ENV_VARS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
