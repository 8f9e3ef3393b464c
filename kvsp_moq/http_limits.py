"""What bounds one HTTP server's input, whatever the request: how long a client may take to send
its head and each part of its body, how long an idle connection is kept, how many connections
are served at once and how large a request head may be.

Without these a client that sends slowly, or not at all, holds a connection (and whatever its
request reserved) for as long as it likes; 150 half-sent requests were enough to keep a holder's
memory reserved. Every server of the project runs uvicorn through `kvsp_moq.web.uvicorn_config`,
which applies an `HttpLimits` (by default `HttpLimits.from_env()`):

    header_timeout_s     10    KVSP_HTTP_HEADER_TIMEOUT      the request head, from its first octet
                                                             (or the connection's start): else 408
                                                             and the connection is closed
    body_idle_timeout_s  30    KVSP_HTTP_BODY_IDLE_TIMEOUT   between two parts of a body: else the
                                                             connection is closed
    keep_alive_s         30    KVSP_HTTP_KEEP_ALIVE          an idle connection between requests
    max_connections      1024  KVSP_HTTP_MAX_CONNECTIONS     beyond it a request is answered 503
                                                             (Retry-After) and its connection closed
    max_header_bytes     64K   KVSP_HTTP_MAX_HEADER_BYTES    a larger request head: 431

uvicorn's own options carry what they can (timeout_keep_alive, h11_max_incomplete_event_size);
the rest is enforced by the HTTP/1.1 protocol class in `kvsp_moq.web`, because a deadline on a
request head cannot be kept by anything that runs only once the head has arrived (an ASGI
middleware), and uvicorn's limit_concurrency counts running requests as well as connections
and answers in plain text rather than with a problem document. The size of
a body is the handler's limit (`kvsp_moq.web.read_body`), checked against Content-Length before
anything is read and counted as the body streams.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Mapping

from kvsp_moq.errors import SettingError

__all__ = ["ENV", "HttpLimits"]

#: The environment variable of each field.
ENV = {
    "header_timeout_s": "KVSP_HTTP_HEADER_TIMEOUT",
    "body_idle_timeout_s": "KVSP_HTTP_BODY_IDLE_TIMEOUT",
    "keep_alive_s": "KVSP_HTTP_KEEP_ALIVE",
    "max_connections": "KVSP_HTTP_MAX_CONNECTIONS",
    "max_header_bytes": "KVSP_HTTP_MAX_HEADER_BYTES",
}


@dataclass(frozen=True)
class HttpLimits:
    """The input bounds of one HTTP server (see the module docstring)."""

    header_timeout_s: float = 10.0
    body_idle_timeout_s: float = 30.0
    keep_alive_s: float = 30.0
    max_connections: int = 1024
    max_header_bytes: int = 64 << 10
    #: the Retry-After (seconds) of a 503 for too many connections
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise SettingError(f"{ENV.get(f.name, f.name)} must be a positive number, "
                                   f"not {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "HttpLimits":
        """The defaults, each replaced by its KVSP_HTTP_* variable where that is set; a value
        that is not a positive number is a SettingError (one line, exit status 2)."""
        env = os.environ if environ is None else environ
        values: dict[str, float | int] = {}
        for f in fields(cls):
            name = ENV.get(f.name)
            text = env.get(name, "").strip() if name else ""
            if not text:
                continue
            integral = f.type in (int, "int")
            try:
                values[f.name] = int(text) if integral else float(text)
            except ValueError:
                kind = "a positive integer" if integral else "a positive number of seconds"
                raise SettingError(f"{name} must be {kind}, not {text!r}") from None
        return cls(**values)  # type: ignore[arg-type]
