"""Certificates made in the test (trustme), for every TLS test.

Policy: each test that needs TLS gets a fresh CA of its own (the ``ca`` fixture) and
writes the PEM files it needs under its ``tmp_path``: nothing is shared between tests,
nothing outside the test's directory is read, and no system trust store is involved.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme


@dataclass(frozen=True)
class Pem:
    """One end's files: its certificate chain, its key, and the CA it trusts."""

    certfile: str
    keyfile: str
    ca_file: str


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


def issue(
    ca: trustme.CA, directory: Path, name: str, *identities: str, trusting: trustme.CA | None = None
) -> Pem:
    """Files for a certificate *ca* issues to *identities* (host names, IP addresses),
    named after *name* in *directory*; it trusts *trusting* (default: *ca*)."""
    cert = ca.issue_cert(*identities)
    certfile, keyfile = directory / f"{name}.pem", directory / f"{name}.key"
    ca_file = directory / f"{name}-ca.pem"
    for blob in cert.cert_chain_pems:
        with certfile.open("ab") as f:
            f.write(blob.bytes())
    cert.private_key_pem.write_to_path(str(keyfile))
    (trusting or ca).cert_pem.write_to_path(str(ca_file))
    return Pem(str(certfile), str(keyfile), str(ca_file))


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    """An HTTPS client's context that trusts *ca* alone."""
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context
