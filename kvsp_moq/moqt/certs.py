"""Self-signed certificates for MOQT servers in tests and local deployments."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["SelfSignedCertificate", "generate_self_signed"]


@dataclass(frozen=True)
class SelfSignedCertificate:
    """A certificate and its key, usable directly in a QuicConfiguration."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    @property
    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def private_key_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, certificate_path: str | Path, key_path: str | Path) -> None:
        """Write PEM files (the key readable by the owner only)."""
        Path(certificate_path).write_bytes(self.certificate_pem)
        key_file = Path(key_path)
        key_file.touch(mode=0o600, exist_ok=True)
        key_file.write_bytes(self.private_key_pem)


def generate_self_signed(
    hostnames: Iterable[str] = ("localhost", "127.0.0.1", "::1"),
    *,
    valid_days: int = 30,
) -> SelfSignedCertificate:
    """A P-256 certificate for `hostnames` (DNS names or IP addresses).

    Clients trust it by passing `certificate_pem` as `cadata`.
    """
    names = list(hostnames)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0] if names else "localhost")])
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        # An end-entity certificate (CA:FALSE): qh3 refuses a CA certificate as a server's own.
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if alternative:
        builder = builder.add_extension(x509.SubjectAlternativeName(alternative), critical=False)
    certificate = builder.sign(key, hashes.SHA256())
    return SelfSignedCertificate(certificate, key)
