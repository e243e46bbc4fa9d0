"""Shared pytest fixtures. Each group lives in its own module and is imported here."""

from etcd_fixture import etcd_prefix, etcd_server, etcd_url, private_etcd
from netns_fixture import make_netns
from tls_fixture import ca

__all__ = ["ca", "etcd_prefix", "etcd_server", "etcd_url", "make_netns", "private_etcd"]
