"""What every HTTP server shares (kvsp_moq.web): a request the HTTP parser itself refuses is
answered with a problem document, like every refusal the apps make."""

from __future__ import annotations

import json
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvsp_moq.web import BackgroundServer


def _raw(port: int, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return status.encode(), headers, body


@pytest.fixture(scope="module")
def port():
    app = Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"), methods=["GET", "POST"])])
    server = BackgroundServer(app).start()
    try:
        yield server.port
    finally:
        server.stop()


@pytest.mark.parametrize("request_bytes", [
    b"POST / HTTP/1.1\r\nHost: x\r\ntransfer-encoding: )aurU_u\r\ncontent-length: 1\r\n\r\nU",
    b"GARBAGE\x00 / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHo st: x\r\n\r\n",
])
def test_an_unparseable_request_gets_a_problem(port, request_bytes):
    status, headers, body = _raw(port, request_bytes)
    assert status.startswith(b"HTTP/1.1 400"), status
    assert headers["content-type"] == "application/problem+json"
    assert int(headers["content-length"]) == len(body)
    problem = json.loads(body)
    assert problem["status"] == 400 and problem["title"], problem


def test_a_good_request_still_reaches_the_app(port):
    status, _, body = _raw(port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200") and body == b"ok"
