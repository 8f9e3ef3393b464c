"""`kvsp agent` on the command line: options, the scope keys file, a real process serving."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from agent.service import configure_parser, settings_from_args
from kvsp_moq.errors import BadRecord
from kvsp_moq.scope_keys import (
    OPEN_SCOPE,
    read_scope_keys,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(list(argv))


def test_options_make_settings(tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'tenant-a = "{"11" * 32}"\ntenant-b = "{"22" * 40}"\n')
    s = settings_from_args(parse("--listen", "127.0.0.1:0", "--model", "tiny", "--index", "http://i/",
                                 "--pc", "http://p/", "--relay", "moqt://r:4443", "--scope-keys", str(keys),
                                 "--scope", "tenant-b", "--public-url", "http://me:1", "--token", "t",
                                 "--replicate-to", "http://h1/", "--replicate-to", "http://h2/"))
    assert s.index_url == "http://i/" and s.pc_url == "http://p/" and s.relay == "moqt://r:4443"
    assert s.scope == "tenant-b" and s.scope_keys["tenant-a"] == bytes([0x11]) * 32
    assert s.public_url == "http://me:1/" and s.token == "t"
    assert list(s.replicate_to) == ["http://h1/", "http://h2/"]
    default = settings_from_args(parse())
    assert default.scope == OPEN_SCOPE and default.device == "cpu" and default.model == "tiny"
    with pytest.raises(BadRecord):
        settings_from_args(parse("--scope-keys", str(keys), "--scope", "nobody"))
    short = tmp_path / "short.toml"
    short.write_text('x = "abcd"\n')
    with pytest.raises(BadRecord):
        read_scope_keys(short)


def test_agent_process_serves(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    proc = subprocess.Popen([sys.executable, "-m", "agent.service", "--listen", f"127.0.0.1:{port}",
                             "--model", "tiny", "--data", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        r = httpx.post(url + "generate", json={"tokens": list(range(3, 40)), "max_new_tokens": 3}, timeout=60)
        assert r.status_code == 200 and len(r.json()["tokens"]) == 3
        assert (tmp_path / "models").is_dir()  # --model tiny is made under --data
        assert "kvsp_agent_sessions_running" in httpx.get(url + "metrics").text
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_block_store_budgets_and_block_size_come_from_the_command_line() -> None:
    s = settings_from_args(parse("--host-bytes", "64M", "--disk-bytes", "2G", "--block-tokens", "64",
                                 "--status-ttl-ms", "5000"))
    assert s.host_bytes == 64 << 20 and s.disk_bytes == 2 << 30
    assert s.block_tokens == 64 and s.status_ttl_ms == 5000
    default = settings_from_args(parse())
    assert default.host_bytes == 1 << 30 and default.block_tokens == 16
    for bad in (["--block-tokens", "0"], ["--host-bytes", "lots"], ["--status-ttl-ms", "-1"]):
        with pytest.raises(SystemExit):
            parse(*bad)
