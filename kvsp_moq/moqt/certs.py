"""Certificates on both sides of a MOQT session.

Servers: self-signed certificates for relays in tests and deployments (`generate_self_signed`,
`certificate_names`, `fingerprint`). Clients: the one rule that decides how a relay's
certificate is checked (`client_tls`), and the one line that says what to do when it is not
trusted (`untrusted_certificate`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvsp_moq.errors import CertificateRejected, SettingError
from kvsp_moq.serving import is_loopback, is_unspecified

__all__ = ["LOOPBACK_NAMES", "CertificateRejected", "ClientTls", "SelfSignedCertificate",
           "add_relay_tls_options", "certificate_names", "check_trusted", "client_tls", "fingerprint",
           "generate_self_signed", "load_or_generate", "untrusted_certificate"]

#: The names every generated certificate covers.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


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


def certificate_names(*hosts: str | None) -> list[str]:
    """The names a server's generated certificate covers: each given host that is not
    unspecified (0.0.0.0, ::), then the loopback names, without repeats."""
    names: list[str] = []
    for host in (*hosts, *LOOPBACK_NAMES):
        if not host or is_unspecified(host):
            continue
        host = host.strip("[]")
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            host = host.lower()
        if host not in names:
            names.append(host)
    return names


def load_or_generate(certificate_path: Path, key_path: Path, names: list[str], *,
                     valid_days: int = 365) -> tuple[SelfSignedCertificate, bool]:
    """The certificate already at these paths when it covers `names` and is valid for another
    day (so clients keep trusting the copy they were given), else a new one written there;
    True when reused."""
    try:
        certificate = x509.load_pem_x509_certificate(certificate_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        covered = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        have = {str(n) for n in covered.get_values_for_type(x509.DNSName)}
        have |= {str(a) for a in covered.get_values_for_type(x509.IPAddress)}
        fresh = certificate.not_valid_after_utc > (datetime.datetime.now(datetime.timezone.utc)
                                                   + datetime.timedelta(days=1))
        public_key = certificate.public_key()
        if (isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(public_key, ec.EllipticCurvePublicKey)
                and fresh and set(names) <= have
                and public_key.public_numbers() == key.public_key().public_numbers()):
            return SelfSignedCertificate(certificate, key), True
    except (OSError, ValueError, x509.ExtensionNotFound):
        pass
    generated = generate_self_signed(names, valid_days=valid_days)
    generated.write(certificate_path, key_path)
    return generated, False


def fingerprint(certificate_pem: bytes) -> str:
    """SHA-256 of the certificate's DER form, as colon-separated hex (as openssl prints it)."""
    cert = x509.load_pem_x509_certificate(certificate_pem)
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


def generate_self_signed(
    hostnames: Iterable[str] = LOOPBACK_NAMES,
    *,
    valid_days: int = 30,
) -> SelfSignedCertificate:
    """A P-256 certificate for `hostnames` (IP addresses become IP SANs, names DNS SANs).

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


# --------------------------------------------------------------------------- clients


@dataclass(frozen=True)
class ClientTls:
    """How a client checks one relay's certificate, as `client_tls` decided."""

    #: check the certificate at all
    verify: bool
    #: the CA (or the relay's own certificate) to check it against; None: the system's CAs
    cafile: str | None = None
    #: a line to log at start when the certificate goes unchecked (None when it is checked)
    note: str | None = None
    #: the note is a warning (--relay-insecure), not information (a loopback relay)
    warn: bool = False
    #: the options that fix a rejected certificate, named in `untrusted_certificate`'s line
    peer: str = "relay"
    ca_option: str = "--relay-ca"
    insecure_option: str = "--relay-insecure"

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of `connect()` (and of BlockPublisher, MoqtBlockFetcher)."""
        options: dict[str, Any] = {"verify": self.verify}
        if self.cafile is not None:
            options["cafile"] = self.cafile
        return options

    def log_note(self, logger: Any) -> None:
        if self.note:
            (logger.warning if self.warn else logger.info)("%s", self.note)


def add_relay_tls_options(p: argparse.ArgumentParser, *, aliases: bool = False) -> None:
    """--relay-ca FILE and --relay-insecure, as every MOQT client of a relay takes them (read
    by `client_tls`); `aliases` adds the older spellings --ca and --insecure."""
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--relay-ca", *(["--ca"] if aliases else []), dest="relay_ca", metavar="FILE",
                     help="CA, or the relay's own certificate (printed at relay start), to verify "
                          "the relay against; default: none for a loopback relay (127.0.0.0/8, "
                          "::1, localhost), the system's CAs otherwise")
    tls.add_argument("--relay-insecure", *(["--insecure"] if aliases else []), dest="relay_insecure",
                     action="store_true",
                     help="do not verify the relay's certificate, wherever it is (warned)")


#: A PEM certificate's first line (OpenSSL also reads the TRUSTED and X509 spellings).
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN (?:TRUSTED |X509 )?CERTIFICATE-----")


def client_tls(url: str, *, cafile: str | Path | None = None, insecure: bool = False,
               peer: str = "relay", ca_option: str = "--relay-ca",
               insecure_option: str = "--relay-insecure") -> ClientTls:
    """The one rule for checking a relay's certificate, for every MOQT client of the project.

    With `cafile` (a CA, or the relay's own certificate as printed at its start) the
    certificate is verified against it. Otherwise a relay at a loopback address (127.0.0.0/8,
    ::1, localhost) is not verified: on this machine it usually runs with a generated
    certificate, and nobody else is on the path. Any other relay is verified against the
    system's CAs. `insecure` skips verification anywhere, with a warning. SettingError for a
    URL that is not moqt://, for both options at once, or an unreadable `cafile`.
    """
    parts = urlsplit(url)
    if parts.scheme.lower() != "moqt" or not parts.hostname:
        raise SettingError(f"the {peer} must be a moqt://HOST:PORT URL, not {url!r}")

    def decided(verify: bool, ca: str | None = None, note: str | None = None,
                warn: bool = False) -> ClientTls:
        return ClientTls(verify, ca, note, warn, peer=peer, ca_option=ca_option,
                         insecure_option=insecure_option)

    if cafile and insecure:
        raise SettingError(f"give {ca_option} or {insecure_option}, not both")
    if cafile:
        try:
            with open(cafile, "rb") as f:
                pem = f.read(1 << 20)
        except OSError as e:
            raise SettingError(f"cannot read {ca_option} {cafile}: {e.strerror or e}") from None
        if not _PEM_CERTIFICATE.search(pem):  # else TLS says only "(empty CA store)"
            raise SettingError(f"{ca_option} {cafile} is not a PEM certificate (no "
                               "-----BEGIN CERTIFICATE----- line): give the relay's certificate "
                               "as printed at its start, or its CA, in PEM")
        return decided(True, str(cafile))
    if insecure:
        return decided(False, note=f"NOT verifying the certificate of the {peer} {url} "
                                   f"({insecure_option}): anyone on the path can pose as it",
                       warn=True)
    if is_loopback(parts.hostname):
        return decided(False, note=f"not verifying the certificate of the loopback {peer} {url} "
                                   f"(give {ca_option} FILE to check it)")
    return decided(True)


#: QUIC CRYPTO_ERROR codes (0x100 + TLS alert) that say a certificate was not accepted:
#: bad_certificate, unsupported_certificate, certificate_revoked, certificate_expired,
#: certificate_unknown, unknown_ca.
_CERTIFICATE_ALERTS = frozenset(0x100 + alert for alert in (42, 43, 44, 45, 46, 48))


def untrusted_certificate(error: BaseException, url: str, tls: ClientTls | None = None) -> str | None:
    """When `error` (from `connect()`) is the client rejecting the peer's certificate, the one
    line that says so and how to fix it; None for any other failure."""
    code = getattr(error, "error_code", None)
    if code not in _CERTIFICATE_ALERTS:
        return None
    tls = tls or ClientTls(True)
    reason = str(error) or "certificate rejected"
    if tls.cafile is not None:  # the file given is not what signed the peer's certificate
        return (f"the certificate of the {tls.peer} {url} is not trusted ({reason}): "
                f"{tls.ca_option} {tls.cafile} is not its certificate nor its CA; give as "
                f"{tls.ca_option} FILE the one the relay printed at its start, or "
                f"{tls.insecure_option}")
    return (f"the certificate of the {tls.peer} {url} is not trusted ({reason}); give "
            f"{tls.ca_option} FILE (its certificate, printed at relay start) or "
            f"{tls.insecure_option}")


def check_trusted(error: BaseException, url: str, tls: ClientTls | None = None) -> None:
    """Raise CertificateRejected when `error`, from `connect()`, is a rejected certificate."""
    line = untrusted_certificate(error, url, tls)
    if line is not None:
        raise CertificateRejected(line, error_code=getattr(error, "error_code", None)) from None
