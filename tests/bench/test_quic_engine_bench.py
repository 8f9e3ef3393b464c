"""The bare QUIC engine bench moves every octet through both engines and reports figures."""

from __future__ import annotations

import pytest

from kvsp_moq.bench.quic_engine import run_bare, supported


@pytest.mark.parametrize("engine", ["aioquic", "qh3"])
def test_run_bare_delivers_every_octet_and_reports_positive_figures(engine: str) -> None:
    size = 2 << 20
    # run_bare raises unless the client read exactly `size` octets, with the server's CRC-32.
    result = run_bare(engine, 1452, size=size, timeout=60)
    assert result["engine"] == engine and result["bytes"] == size
    assert "unsupported" not in result
    assert result["mb_per_s"] > 0
    assert result["server_cpu_s_per_gb"] > 0
    assert result["client_cpu_s_per_gb"] > 0
    assert 1200 <= result["largest_datagram_received"] <= 1452


def test_aioquic_refuses_datagrams_its_stream_frames_cannot_carry() -> None:
    assert supported("aioquic", 16384) is None
    assert supported("aioquic", 60000) is not None
    assert supported("qh3", 60000) is None
    result = run_bare("aioquic", 60000, size=1 << 20)
    assert "unsupported" in result and "mb_per_s" not in result
