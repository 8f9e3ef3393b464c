"""The process-wide default datagram size, for deployments across real networks."""

from __future__ import annotations

import pytest

from kvsp_moq.errors import SettingError
from kvsp_moq.moqt import quic


def test_the_environment_sets_the_default_datagram_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(quic.DATAGRAM_SIZE_ENV, raising=False)
    settings = quic.QuicSettings()
    assert settings.max_datagram_size is None  # by destination: loopback's, or a real path's
    assert settings.datagram_size_for("127.0.0.1") >= 16384
    assert settings.datagram_size_for("198.18.0.1") == quic.PATH_DATAGRAM_SIZE == 1452
    monkeypatch.setenv(quic.DATAGRAM_SIZE_ENV, "1452")
    assert quic.QuicSettings().max_datagram_size == 1452
    assert quic.QuicSettings(max_datagram_size=9000).max_datagram_size == 9000  # explicit wins


@pytest.mark.parametrize("value", ["1199", "65508", "big", "1.5e3"])
def test_a_bad_datagram_size_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                           value: str) -> None:
    monkeypatch.setenv(quic.DATAGRAM_SIZE_ENV, value)
    with pytest.raises(SettingError, match=quic.DATAGRAM_SIZE_ENV):
        quic.QuicSettings()


def test_the_command_line_reports_a_bad_datagram_size_on_one_line() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{quic.DATAGRAM_SIZE_ENV: "big"})
    done = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "relay", "--listen", "127.0.0.1:0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"kvsp relay: {quic.DATAGRAM_SIZE_ENV}=")
    assert "Traceback" not in done.stderr
