"""Throwaway certificates for tests: a CA and a server certificate it signed (cryptography)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Issued:
    """PEM files written by ``issue``."""

    ca: Path
    cert: Path
    key: Path


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def issue(
    directory: Path,
    *,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
    uris: tuple[str, ...] = (),
    common: str | None = None,
) -> Issued:
    """A new CA, and a certificate for ``dns`` names, ``ips`` and ``uris`` signed by it.

    ``common``: its subject's common name (default: the first DNS name, else "server").
    """
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"test CA {x509.random_serial_number():x}")  # unique: CAs can share a bundle
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    names += [x509.UniformResourceIdentifier(u) for u in uris]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common or (dns[0] if dns else "server")))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
    )
    if names:  # (cryptography 51 refuses an empty SubjectAlternativeName)
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    issued = Issued(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    issued.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    issued.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return issued
