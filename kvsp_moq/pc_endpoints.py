"""The Placement Controller's URLs, several when several PC processes share one store.

`kvsp index --store redis://...` processes act as one PC (docs/redis.md), so a client of the
PC (an instance reporting status and checkpoints, a front end) may be given all of their URLs,
comma-separated. Calls go to one; a failure that another PC may not share (no answer, a broken
connection, a 503) moves the next call to the next URL, so the loss of one PC process costs a
client one failed call instead of its status expiring. One URL is the one-process case.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvsp_moq.protocol.urls import base_url

log = logging.getLogger("kvsp.pc_endpoints")

__all__ = ["PCEndpoints"]


class PCEndpoints:
    """A ring of PC base URLs; `url` is the one in use."""

    urls: list[str]

    def __init__(self, urls: "str | Sequence[str] | PCEndpoints") -> None:
        parts: list[str]
        if isinstance(urls, PCEndpoints):
            parts = list(urls.urls)
        elif isinstance(urls, str):
            parts = urls.split(",")
        else:
            parts = list(urls)
        self.urls = [base_url(u.strip()) for u in parts if u.strip()]
        if not self.urls:
            raise ValueError("no PC URL given")
        self._at = 0

    @property
    def url(self) -> str:
        return self.urls[self._at]

    def failed(self, url: str) -> None:
        """A call to `url` failed as a dead or cut-off PC fails: use the next one (once per
        failure of the URL in use; a late failure of an older call changes nothing)."""
        if len(self.urls) > 1 and base_url(url) == self.url:
            self._at = (self._at + 1) % len(self.urls)
            log.warning("PC %s failed; using %s", url, self.url)

    def __str__(self) -> str:
        return ",".join(self.urls)
