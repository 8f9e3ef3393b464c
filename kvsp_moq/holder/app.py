"""`kvsp holder` as one Starlette app: the HTTP resources of `holder.api` over a holder
assembled by `holder.assembly`.

With a relay (`HolderSettings.relay`) the same store is also served over MOQT (DESIGN §4): a
`BlockPublisher` runs on the app's event loop from startup to shutdown, announces every
compat and scope the store holds, and the index gets a MOQT record beside each HTTP record.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.applications import Starlette

from kvsp_moq.auth import Authenticator
from kvsp_moq.holder.assembly import HolderAssembly
from kvsp_moq.holder.leases import Clock
from kvsp_moq.holder.moqt_publisher import BlockPublisher
from kvsp_moq.holder.settings import HolderSettings
from kvsp_moq.web import build_app

__all__ = ["create_app"]


def create_app(settings: HolderSettings, *, clock: Clock | None = None) -> Starlette:
    """The holder as one Starlette app; its store, leases and publisher are on app.state.

    The publisher needs the holder's public base URL; set `app.state.publisher.holder_url`
    before the app starts when it is known only once the socket is bound.
    """
    auth = settings.auth if settings.auth is not None else Authenticator.from_file(
        settings.principals)
    holder = HolderAssembly(settings, auth=auth, clock=clock)
    state: dict[str, Any] = {"store": holder.store, "leases": holder.leases,
                             "publisher": holder.publisher, "api": holder.api, "holder": holder,
                             "settings": settings, "loop": None, "moqt_publisher": None}

    def on_moqt(publisher: BlockPublisher | None) -> None:
        app.state.moqt_publisher = publisher

    holder.on_moqt = on_moqt

    async def startup() -> None:
        app.state.loop = asyncio.get_running_loop()
        await holder.start()

    app = build_app(holder.api.routes(), name="kvsp_holder", auth=auth, on_startup=[startup],
                    on_shutdown=[holder.stop], state=state, openapi="holder")
    holder.add_gauges(app.state.metrics)
    return app
