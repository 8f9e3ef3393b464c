"""The `kvsp holder` command: its options, and a real run in a child process."""

from __future__ import annotations

import argparse
import os
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvsp_moq.arguments import parse_size
from kvsp_moq.holder.service import configure_parser, settings_from_args
from tests.holder.conftest import make_block

ROOT = Path(__file__).resolve().parents[2]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvsp holder")
    configure_parser(p)
    return p


@pytest.mark.parametrize("text, octets", [
    ("1048576", 1 << 20), ("512M", 512 << 20), ("4G", 4 << 30), ("4GiB", 4 << 30),
    ("2k", 2048), ("1T", 1 << 40),
])
def test_sizes(text: str, octets: int) -> None:
    assert parse_size(text) == octets


def test_bad_sizes_are_usage_errors() -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--host-bytes", "lots"])


def test_options_become_settings(tmp_path) -> None:
    args = parser().parse_args([
        "--listen", "127.0.0.1:9000", "--data", str(tmp_path), "--index", "http://i/",
        "--public-url", "http://h.example/kvsp", "--host-bytes", "2G", "--disk-bytes", "8G",
        "--record-ttl-ms", "5000", "--relay", "moqt://127.0.0.1:4443", "--token", "t",
    ])
    s = settings_from_args(args)
    assert (s.listen, s.data_dir, s.index_url, s.public_url) == (
        "127.0.0.1:9000", str(tmp_path), "http://i/", "http://h.example/kvsp/")
    assert (s.host_bytes, s.disk_bytes, s.record_ttl_ms) == (2 << 30, 8 << 30, 5000)
    assert (s.relay, s.index_token) == ("moqt://127.0.0.1:4443", "t")
    assert args.func.__name__ == "run"


def test_the_command_serves_with_authentication(tmp_path) -> None:
    principals = tmp_path / "principals.toml"
    principals.write_text('[[principal]]\nname = "a"\ntoken = "tok"\nscopes = ["*"]\nroles = ["holder"]\n')
    code = ("import argparse, sys\n"
            "from kvsp_moq.holder.service import configure_parser, run\n"
            "p = argparse.ArgumentParser(); configure_parser(p)\n"
            "sys.exit(run(p.parse_args(sys.argv[1:])))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--listen", "127.0.0.1:0", "--data", str(tmp_path / "d"),
         "--principals", str(principals)],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=ROOT)
    try:
        url = None
        deadline = time.monotonic() + 20
        assert proc.stderr is not None
        while url is None and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stderr], [], [], 0.5)
            if ready:
                line = proc.stderr.readline().decode()
                m = re.search(r"holder at (http://127\.0\.0\.1:\d+/)", line)
                url = m.group(1) if m else None
        assert url, "the holder did not report its address"
        with httpx.Client(base_url=url, trust_env=False, timeout=5) as c:
            block = make_block(1)
            assert c.get("healthz").status_code == 200
            assert c.get(block.path).status_code == 401
            auth = {"Authorization": "Bearer tok"}
            r = c.put(block.path, content=block.data, headers={"If-None-Match": "*"} | auth)
            assert r.status_code == 201
            assert c.get(block.path, headers=auth).content == block.data
    finally:
        proc.terminate()
        proc.wait(10)


def test_tenancy_and_lease_options_become_settings() -> None:
    args = parser().parse_args(["--serve-scope", "AB" * 16, "--serve-scope", "cd" * 16,
                                "--scope-quota", "2G", "--max-leases", "10",
                                "--max-leases-total", "100", "--max-put-inflight", "3G"])
    s = settings_from_args(args)
    assert s.max_put_inflight_bytes == 3 << 30
    assert s.serve_scopes == ("ab" * 16, "cd" * 16) and s.scope_quota == 2 << 30
    assert (s.max_leases, s.max_leases_total) == (10, 100)
    defaults = settings_from_args(parser().parse_args([]))
    assert defaults.serve_scopes == () and defaults.scope_quota is None
    assert defaults.max_put_inflight_bytes is None  # twice the block limit
    assert (defaults.max_leases, defaults.max_leases_total) == (1024, 16384)


def test_a_bad_serve_scope_is_one_line_and_exit_2(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "holder", "--serve-scope", "tenant-a"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--serve-scope" in r.stderr
