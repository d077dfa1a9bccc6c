"""``ethen mesh certs``: what a user needs to run the mesh across machines (``cryptography`` library).

:func:`make_certs` writes into one directory:

==============  =================================================================================
``ca.pem``      the mesh's CA certificate: give it to every orchestrator (``ca_file``) and joining worker
``ca.key``      the CA's private key (mode 600): keep it, to sign more certificates later
``server.pem``  one server certificate for every worker (and a gateway's join port), signed by the CA, with
                subject alternative names for ``localhost``, ``127.0.0.1``, ``::1`` and each ``--hosts`` entry
                (IP addresses as IP SANs, names as DNS SANs)
``server.key``  its private key (mode 600)
``token``       a random bearer token (``secrets.token_urlsafe(32)``, mode 600) for ``--token-file`` /
                ``token_file``
==============  =================================================================================

Choices: one server certificate shared by all workers (copy the directory to each machine; add a host by
running the command again into a new directory, or list every host up front); ECDSA P-256 keys; the CA is
valid 10 years and the server certificate 2 years. Existing files are never overwritten (the command fails
naming the first one), so a token already handed out cannot be lost by accident.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ethen.mesh.auth import CredentialsError

__all__ = ["FILES", "make_certs", "parse_hosts"]

FILES = ("ca.pem", "ca.key", "server.pem", "server.key", "token")
_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


def parse_hosts(text: str) -> list[str]:
    """``"10.0.0.2, gpu.lan"`` -> ``["10.0.0.2", "gpu.lan"]`` (bad entry: ``CredentialsError``)."""
    out: list[str] = []
    for raw in text.split(","):
        h = raw.strip().strip("[]")
        if not h:
            continue
        try:
            ipaddress.ip_address(h)
        except ValueError:
            label = h.replace("-", "").replace(".", "").replace("*", "")
            if not label.isalnum() or h.startswith(".") or h.endswith("."):
                raise CredentialsError(
                    f"--hosts: {raw.strip()!r} is neither an IP address nor a host name") from None
        out.append(h)
    return out


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ethen mesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def make_certs(out: Path, hosts: Sequence[str] = (), now: dt.datetime | None = None) -> dict[str, Path]:
    """Write the CA, the server certificate and key, and a token into ``out``; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in FILES}
    for path in paths.values():
        if path.exists():
            raise CredentialsError(
                f"--out {str(out)!r}: {path.name} exists already (not overwritten; use a new directory)")
    t0 = now or dt.datetime.now(dt.UTC)
    start = t0 - dt.timedelta(minutes=5)  # tolerate small clock skew between machines
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("ethen mesh CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(t0 + dt.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, encipher_only=False,
                                       decipher_only=False),
                         critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    for h in [*_DEFAULT_HOSTS, *hosts]:
        if h in seen:
            continue
        seen.add(h)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("ethen mesh worker")).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(t0 + dt.timedelta(days=730))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    _write(paths["ca.pem"], ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths["ca.key"], _key_pem(ca_key), private=True)
    _write(paths["server.pem"], cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths["server.key"], _key_pem(key), private=True)
    _write(paths["token"], (secrets.token_urlsafe(32) + "\n").encode(), private=True)
    return paths
