"""Bounded input (issue 35, attack 7): bodies are refused at their limit before they are read
whole, a block PUT needs a length and shares an in-flight budget, and every server closes
requests that arrive too slowly, heads that are too large and connections beyond its cap.

Raw sockets show what an HTTP client library would hide: that a refusal comes while the body is
still unsent (the server could not have waited for it), and what happens to a half-sent request.
Every wait on a socket is bounded by its timeout; nothing here asserts how long anything took.
"""

from __future__ import annotations

import socket
from typing import Iterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from index.app import IndexSettings
from index.app import create_app as create_index_app
from kvsp_moq.auth import Authenticator
from kvsp_moq.errors import SettingError
from kvsp_moq.holder.service import Holder, HolderSettings
from kvsp_moq.http_limits import HttpLimits
from kvsp_moq.web import BackgroundServer, build_app, json_response, read_json
from tests.polling import wait_until
from tests.security.conftest import COMPAT, SCOPE_A, TOKEN_A, TOKEN_METRICS, auth, authenticator, bkey, container

#: Seconds any one socket operation may take before the test fails.
WAIT = 10.0
MiB = 1 << 20


def connect(url: str) -> socket.socket:
    host, port = httpx.URL(url).host, httpx.URL(url).port
    assert port is not None
    sock = socket.create_connection((host, port), timeout=WAIT)
    sock.settimeout(WAIT)
    return sock


def read_response(sock: socket.socket, limit: int = 1 << 16) -> bytes:
    """What the server sends until it closes the connection or its response is complete."""
    data = b""
    while len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = [line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")]
            if length and len(body) >= int(length[0]):
                break
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def header(response: bytes, name: str) -> str | None:
    for line in response.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.lower().encode():
            return value.strip().decode()
    return None


def echo_app() -> object:
    """One route that reads a JSON body with the default limit (64 MiB), as every service does."""
    async def echo(request: Request) -> Response:
        return json_response({"got": await read_json(request)})

    return build_app([Route("/echo", echo, methods=["POST"])], name="echo",
                     auth=Authenticator.open())


@pytest.fixture(scope="module")
def index_url() -> Iterator[str]:
    settings = IndexSettings(auth=authenticator(), sweep_interval_s=None, max_body_bytes=4096)
    with BackgroundServer(create_index_app(settings)) as server:
        yield server.url


def block_path(n: int) -> str:
    return f"blocks/{COMPAT}/{SCOPE_A}/{bkey(n, 'a')}"


# ------------------------------------------------------------------ bodies


def test_a_300_mib_json_body_is_refused_from_its_content_length_before_any_of_it_is_read():
    with BackgroundServer(echo_app()) as server:  # type: ignore[arg-type]
        with connect(server.url) as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (300 * MiB))
            # Nothing of the body is sent: a server that read it first would never answer.
            response = read_response(sock)
    assert status_of(response) == 413
    assert b"urn:kvsp:problem:kvsp-too-large" in response and b"Content too large" in response


def test_an_agents_generate_refuses_a_300_mib_body_before_reading_it(agent):
    with connect(agent.url) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                     TOKEN_A.encode() + b"\r\nContent-Length: %d\r\n\r\n" % (300 * MiB))
        response = read_response(sock)
    assert status_of(response) == 413


def test_a_declared_body_over_the_index_limit_is_refused_before_reading(index_url):
    with connect(index_url) as sock:
        sock.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                     TOKEN_A.encode() + b"\r\nContent-Length: 5000\r\n\r\n")
        response = read_response(sock)
    assert status_of(response) == 413


def test_a_chunked_body_is_refused_once_it_passes_the_limit_not_at_its_end(index_url):
    with connect(index_url) as sock:
        sock.sendall(b"POST /lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " +
                     TOKEN_A.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(5):  # 5 KiB of a body that never ends, over the limit of 4 KiB
            sock.sendall(b"400\r\n" + b" " * 1024 + b"\r\n")
        response = read_response(sock)
    assert status_of(response) == 413
    assert b"kvsp-too-large" in response


def test_a_body_within_the_limit_still_works(index_url):
    r = httpx.post(index_url + "lookup", headers=auth(TOKEN_A), trust_env=False, timeout=WAIT,
                   json={"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [bkey(1, "a")]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ block PUTs


@pytest.fixture
def small_holder() -> Iterator[Holder]:
    block = len(container(0))
    h = Holder(HolderSettings(listen="127.0.0.1:0", auth=authenticator(),
                              max_block_bytes=4 * block,
                              max_put_inflight_bytes=block + block // 2)).start()
    try:
        yield h
    finally:
        h.stop()


def put(holder: Holder, n: int, content: object) -> httpx.Response:
    return httpx.put(holder.url + block_path(n), content=content,  # type: ignore[arg-type]
                     headers={"If-None-Match": "*"} | auth(TOKEN_A), trust_env=False,
                     timeout=WAIT)


def test_a_block_put_without_content_length_is_411(small_holder):
    def chunks() -> Iterator[bytes]:
        yield container(1)

    r = put(small_holder, 1, chunks())
    assert r.status_code == 411 and r.json()["type"].endswith("kvsp-length-required")
    assert put(small_holder, 1, container(1)).status_code == 201


def test_a_block_put_over_the_block_limit_is_413_before_its_body(small_holder):
    limit = small_holder.settings.max_block_bytes
    with connect(small_holder.url) as sock:
        sock.sendall(f"PUT /{block_path(2)} HTTP/1.1\r\nHost: x\r\nIf-None-Match: *\r\n"
                     f"Authorization: Bearer {TOKEN_A}\r\nContent-Length: {limit + 1}\r\n\r\n"
                     .encode())
        response = read_response(sock)
    assert status_of(response) == 413


def test_half_sent_puts_cannot_reserve_more_than_the_in_flight_budget(small_holder):
    data = container(3)
    metric = "kvsp_holder_put_inflight_bytes"

    def in_flight() -> float:
        text = httpx.get(small_holder.url + "metrics", trust_env=False, timeout=WAIT,
                         headers={"Authorization": f"Bearer {TOKEN_METRICS}"}).text
        return float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith(metric + " ")))

    with connect(small_holder.url) as sock:
        sock.sendall(f"PUT /{block_path(3)} HTTP/1.1\r\nHost: x\r\nIf-None-Match: *\r\n"
                     f"Authorization: Bearer {TOKEN_A}\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data[:100])
        wait_until(lambda: in_flight() == len(data), timeout=WAIT,
                   what="the half-sent PUT reserves its declared length")
        refused = put(small_holder, 4, container(4))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["type"].endswith("kvsp-overloaded")
        sock.sendall(data[100:])
        assert status_of(read_response(sock)) == 201
    assert in_flight() == 0
    assert put(small_holder, 4, container(4)).status_code == 201


# ------------------------------------------------------------------ connections


LIMITS = HttpLimits(header_timeout_s=1.0, body_idle_timeout_s=0.5, keep_alive_s=5,
                    max_connections=2, max_header_bytes=4096)


@pytest.fixture
def limited_url() -> Iterator[str]:
    with BackgroundServer(echo_app(), limits=LIMITS) as server:  # type: ignore[arg-type]
        yield server.url


def test_a_request_head_that_never_completes_is_closed_by_the_header_deadline(limited_url):
    with connect(limited_url) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # no blank line, ever
        response = read_response(sock)
        assert sock.recv(1) == b""  # closed
    assert status_of(response) == 408 and b"application/problem+json" in response


def test_a_connection_that_sends_nothing_is_closed_by_the_header_deadline(limited_url):
    with connect(limited_url) as sock:
        response = read_response(sock)
    assert status_of(response) == 408


def test_a_body_that_stops_arriving_is_closed_by_the_body_deadline(limited_url):
    with connect(limited_url) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
        assert read_response(sock) == b""  # closed without an answer: the client went away


def test_a_request_head_over_the_cap_is_431(limited_url):
    with connect(limited_url) as sock:  # complete, but too large
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n")
        assert status_of(read_response(sock)) == 431
    with connect(limited_url) as sock:  # still coming, and already too large
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000)
        assert status_of(read_response(sock)) == 431


def test_connections_beyond_the_cap_are_answered_503_and_closed(limited_url):
    held = [connect(limited_url) for _ in range(2)]
    try:
        for sock in held:  # each one served: both are counted before the third comes
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status_of(read_response(sock)) == 200
        with connect(limited_url) as third:
            third.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            response = read_response(third)
            assert third.recv(1) == b""
        assert status_of(response) == 503 and header(response, "retry-after") == "1"
        assert b"kvsp-overloaded" in response
    finally:
        for sock in held:
            sock.close()

    def served() -> bool:
        return httpx.get(limited_url + "healthz", trust_env=False, timeout=WAIT).status_code == 200

    wait_until(served, timeout=WAIT, what="a request is served once connections are closed")


# ------------------------------------------------------------------ settings


def test_limits_come_from_the_environment_and_bad_values_are_one_line_setting_errors():
    limits = HttpLimits.from_env({"KVSP_HTTP_MAX_CONNECTIONS": "10",
                                  "KVSP_HTTP_HEADER_TIMEOUT": "2.5"})
    assert (limits.max_connections, limits.header_timeout_s) == (10, 2.5)
    assert limits.keep_alive_s == HttpLimits().keep_alive_s
    with pytest.raises(SettingError, match="KVSP_HTTP_MAX_CONNECTIONS"):
        HttpLimits.from_env({"KVSP_HTTP_MAX_CONNECTIONS": "lots"})
    with pytest.raises(SettingError, match="KVSP_HTTP_BODY_IDLE_TIMEOUT"):
        HttpLimits.from_env({"KVSP_HTTP_BODY_IDLE_TIMEOUT": "-1"})
