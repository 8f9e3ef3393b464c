"""The relay's generated certificate (its names, where it goes, that it goes away) and the one
rule by which MOQT clients check a relay's certificate (kvsp_moq.moqt.certs.client_tls)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.certs import CertificateRejected, ClientTls, client_tls, generate_self_signed, untrusted_certificate
from kvsp_moq.moqt.errors import MoqtError, SessionClosed
from kvsp_moq.moqt.quic import connect

from .conftest import CERT, STEP, running_relay

ROOT = Path(__file__).resolve().parents[2]


def relay_settings(*argv: str, cleanup: contextlib.ExitStack | None = None):
    from relay.service import configure_parser, settings_from_args

    p = argparse.ArgumentParser()
    configure_parser(p)
    return settings_from_args(p.parse_args(list(argv)), cleanup)


def sans(pem: bytes) -> list[str]:
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


def test_the_generated_certificate_names_the_listen_address_and_the_public_host(tmp_path):
    settings, notes = relay_settings("--listen", "198.18.0.1:4443", "--insecure-open",
                                     "--public-url", "moqt://relay.example:4443", "--cert-dir", str(tmp_path))
    names = sans(settings.certificate.certificate_pem)
    assert names == ["198.18.0.1", "relay.example", "localhost", "127.0.0.1", "::1"]
    cert = x509.load_pem_x509_certificate((tmp_path / "relay-cert.pem").read_bytes())
    ips = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.IPAddress)
    assert ipaddress.ip_address("198.18.0.1") in ips  # an IP SAN, not a DNS name
    assert any(n.startswith("certificate SHA-256 fingerprint ") for n in notes)
    assert any("--relay-ca" in n and str(tmp_path / "relay-cert.pem") in n for n in notes)
    # 0.0.0.0 is no name of the relay: the public URL's host and loopback only
    settings, _ = relay_settings("--listen", "0.0.0.0:4443", "--insecure-open", "--public-url",
                                 "moqt://10.77.0.2:4443", "--cert-dir", str(tmp_path))
    assert sans(settings.certificate.certificate_pem) == ["10.77.0.2", "localhost", "127.0.0.1", "::1"]
    assert settings.public_url == "moqt://10.77.0.2:4443"


def test_a_generated_certificate_without_cert_dir_is_removed_at_exit(tmp_path):
    with contextlib.ExitStack() as cleanup:
        settings, notes = relay_settings("--listen", "127.0.0.1:0", cleanup=cleanup)
        line = next(n for n in notes if n.startswith("self-signed certificate "))
        path = Path(line.split()[2])
        assert path.exists() and path.with_name("relay-key.pem").exists() and "removed at exit" in line
    assert not path.parent.exists()
    relay_settings("--listen", "127.0.0.1:0", "--cert-dir", str(tmp_path))
    assert (tmp_path / "relay-cert.pem").exists()  # --cert-dir is kept
    first = (tmp_path / "relay-cert.pem").read_bytes()
    _, notes = relay_settings("--listen", "127.0.0.1:0", "--cert-dir", str(tmp_path))
    assert (tmp_path / "relay-cert.pem").read_bytes() == first  # clients' copies stay good
    assert any(n.startswith("self-signed certificate ") and "reused" in n for n in notes)
    relay_settings("--listen", "127.0.0.1:0", "--public-url", "moqt://relay.example:1",
                   "--cert-dir", str(tmp_path))
    assert (tmp_path / "relay-cert.pem").read_bytes() != first  # a new name: a new certificate


def test_a_relay_process_removes_its_certificate_at_exit():
    proc = subprocess.Popen([sys.executable, "-m", "relay.service", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith(b"relay listening on moqt://127.0.0.1:")
        line = proc.stdout.readline().decode()
        assert line.startswith("self-signed certificate ") and "127.0.0.1" in line
        path = Path(line.split()[2])
        assert path.exists()
        assert proc.stdout.readline().startswith(b"certificate SHA-256 fingerprint ")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert not path.parent.exists()


async def test_an_in_process_relay_certifies_its_public_host():
    from relay.relay import Relay, RelaySettings

    relay = await Relay(RelaySettings(public_url="moqt://relay.example:4443")).start()
    try:
        assert sans(relay.settings.certificate.certificate_pem)[:2] == ["127.0.0.1", "relay.example"]
    finally:
        await relay.aclose()


# --------------------------------------------------------------------------- clients


def test_the_client_rule(tmp_path):
    ca = tmp_path / "relay-cert.pem"
    ca.write_bytes(CERT.certificate_pem)
    for url in ("moqt://127.0.0.1:4443", "moqt://127.3.2.1:1", "moqt://[::1]:4443", "moqt://localhost:4443"):
        tls = client_tls(url)
        assert not tls.verify and not tls.warn and "loopback" in tls.note, url
    remote = client_tls("moqt://10.77.0.2:4443")
    assert (remote.verify, remote.cafile, remote.note) == (True, None, None)  # the system's CAs
    pinned = client_tls("moqt://10.77.0.2:4443", cafile=ca)
    assert pinned.connect_options() == {"verify": True, "cafile": str(ca)} and pinned.note is None
    insecure = client_tls("moqt://10.77.0.2:4443", insecure=True)
    assert not insecure.verify and insecure.warn and "--relay-insecure" in insecure.note
    upstream = client_tls("moqt://10.77.0.2:4443", insecure=True, peer="upstream relay",
                          ca_option="--upstream-ca", insecure_option="--upstream-insecure")
    assert "--upstream-insecure" in upstream.note
    with pytest.raises(SettingError, match="not both"):
        client_tls("moqt://10.77.0.2:4443", cafile=ca, insecure=True)
    with pytest.raises(SettingError, match="cannot read --relay-ca"):
        client_tls("moqt://10.77.0.2:4443", cafile=tmp_path / "missing.pem")
    with pytest.raises(SettingError, match="moqt://"):
        client_tls("http://10.77.0.2:4443")
    assert untrusted_certificate(SessionClosed("gone"), "moqt://x:1") is None
    assert untrusted_certificate(OSError("refused"), "moqt://x:1") is None


async def test_a_rejected_certificate_is_one_clear_line():
    """A name the certificate does not carry, checked as any non-loopback relay would be."""
    async with running_relay() as relay:
        with pytest.raises(MoqtError) as failed:
            await asyncio.wait_for(connect(relay.url, server_name="relay.example",
                                           cadata=CERT.certificate_pem), STEP)
        line = untrusted_certificate(failed.value, "moqt://relay.example:4443")
        assert line is not None and line.startswith(
            "the certificate of the relay moqt://relay.example:4443 is not trusted (")
        assert line.endswith("); give --relay-ca FILE (its certificate, printed at relay start) or "
                             "--relay-insecure")
        upstream = ClientTls(True, peer="upstream relay", ca_option="--upstream-ca",
                             insecure_option="--upstream-insecure")
        assert "give --upstream-ca FILE" in untrusted_certificate(failed.value, relay.url, upstream)


def _other_ca(tmp_path: Path) -> Path:
    path = tmp_path / "not-the-relay.pem"
    path.write_bytes(generate_self_signed().certificate_pem)
    return path


async def test_the_fetcher_fails_with_the_line(tmp_path):
    from kvsp_moq.fetch.moqt import MoqtBlockFetcher

    async with running_relay() as relay:
        fetcher = MoqtBlockFetcher(tls=client_tls(relay.url, cafile=_other_ca(tmp_path)), timeout=STEP)
        try:
            with pytest.raises(CertificateRejected, match="is not trusted.*--relay-ca FILE"):
                await fetcher.connection(relay.url)
            assert "--relay-insecure" in fetcher.untrusted[relay.url]
        finally:
            await fetcher.aclose()
        fetcher = MoqtBlockFetcher(tls=client_tls(relay.url), timeout=STEP)  # loopback: unchecked
        try:
            await fetcher.connection(relay.url)
            assert fetcher.untrusted == {}
        finally:
            await fetcher.aclose()


async def test_a_publisher_says_it_once_and_keeps_retrying(tmp_path, caplog):
    from kvsp_moq.holder.moqt_publisher import BlockPublisher
    from kvsp_moq.holder.store import BlockStore

    async with running_relay() as relay:
        publisher = BlockPublisher(BlockStore(host_bytes=1 << 20), relay.url, "http://127.0.0.1:1/",
                                   tls=client_tls(relay.url, cafile=_other_ca(tmp_path)),
                                   retry_initial=0.05, retry_max=0.1)
        with caplog.at_level(logging.DEBUG, logger="kvsp.holder.moqt_publisher"):
            await publisher.start()
            try:
                await asyncio.sleep(1.0)
                assert publisher.connection is None
            finally:
                await publisher.aclose()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "is not trusted" in errors[0].getMessage()
        attempts = [r for r in caplog.records if "is not trusted" in r.getMessage()]
        assert len(attempts) >= 3  # retried, quietly (debug) after the first
