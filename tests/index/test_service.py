"""`kvsp index` options and start-up, and the lookup benchmark in its smallest form."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from index import service
from tests.fixtures import DESCRIPTOR


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvsp index")
    service.configure_parser(p)
    return p.parse_args(argv)


def test_defaults():
    args = parse()
    assert (args.listen, args.max_ttl_ms, args.principals, args.role) == \
        ("127.0.0.1:8700", 600_000, None, "both")
    settings = service.settings_from_args(args)
    assert settings.auth.is_open and settings.max_ttl_ms == 600_000


def test_descriptor_sets_the_block_size(tmp_path):
    from kvsp_moq.protocol.compat import CompatDescriptor

    d = tmp_path / "d.json"
    d.write_text(json.dumps(DESCRIPTOR))
    settings = service.settings_from_args(parse("--descriptor", str(d), "--block-tokens", "64",
                                                "--max-ttl-ms", "5000"))
    compat = CompatDescriptor.from_dict(DESCRIPTOR).compat_hex
    assert settings.block_tokens == {compat: DESCRIPTOR["block_tokens"]}
    assert settings.default_block_tokens == 64 and settings.max_ttl_ms == 5000


@pytest.mark.parametrize("argv, fragment", [
    (("--token-file", "/nonexistent/token"), "/nonexistent/token"),
    (("--listen", "0.0.0.0:8700"), "refusing to run open"),
    (("--max-ttl-ms", "0"), "--max-ttl-ms"),
    (("--principals", "/nonexistent/p.toml"), "principals"),
    (("--descriptor", "/nonexistent/d.json"), "descriptor"),
    (("--listen", "127.0.0.1:notaport"), "--listen"),
])
def test_refusals_exit_2_with_one_line(argv, fragment, capsys):
    assert service.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serves_and_says_it_runs_open(tmp_path):
    port = _free_port()
    code = ("import argparse, sys; from index import service; p = argparse.ArgumentParser(); "
            "service.configure_parser(p); sys.exit(service.run(p.parse_args(sys.argv[1:])))")
    proc = subprocess.Popen([sys.executable, "-c", code, "--listen", f"127.0.0.1:{port}",
                             "--db", str(tmp_path / "pc.sqlite3")],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert r.json() == {"status": "ok"}
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "running OPEN" in err.decode()


def test_benchmark_runs_small():
    from kvsp_moq.bench import http_lookup

    # The Redis part has its own test (tests/index_redis); this one measures the in-memory IS.
    result = http_lookup.run_lookup(quick=True, records=2_000, requests=20, keys_per_lookup=64,
                                    redis=False)
    assert result["records"] == 2_000 and result["matched_per_lookup"] == 64
    assert result["index"]["lookups_per_s"] > 0 and result["bare_starlette"]["lookups_per_s"] > 0
    assert result["memory"]["rss_bytes_per_record"] > 0
