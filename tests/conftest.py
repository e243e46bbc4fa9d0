"""Shared pytest fixtures. Each group lives in its own module and is imported here."""

from etcd_fixture import etcd_prefix, etcd_server, etcd_url, private_etcd

__all__ = ["etcd_prefix", "etcd_server", "etcd_url", "private_etcd"]
