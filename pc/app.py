"""The Placement Controller as an app of its own (`kvsp index --role pc`).

The controller is `pc.controller`, its HTTP resources `pc.routes`, its calls to instances
`pc.instances_client`; their main names are importable from here too.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from starlette.applications import Starlette

from kvsp_moq.auth import Authenticator
from kvsp_moq.web import build_app
from pc.controller import PCSettings, PlacementController
from pc.instances_client import InstanceClient, command_start_hook
from pc.placement import LookupFn, ScopeKeys, StartHook
from pc.routes import create_pc_routes

__all__ = ["InstanceClient", "PCSettings", "PlacementController", "command_start_hook", "create_pc_app",
           "create_pc_routes"]

log = logging.getLogger("kvsp.pc")


def create_pc_app(settings: PCSettings, *, lookup: LookupFn | None = None,
                  start_hook: StartHook | None = None, keys: ScopeKeys | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Starlette:
    """The PC alone (`kvsp index --role pc`); `app.state.pc` is the controller."""
    pc = PlacementController(settings, lookup=lookup, start_hook=start_hook, keys=keys,
                             clock=clock)
    auth = Authenticator.from_file(settings.principals)
    if auth.is_open:
        log.warning("no principals file: the PC runs open")
    return build_app(create_pc_routes(pc), name="kvsp_pc", auth=auth, on_startup=[pc.start],
                     on_shutdown=[pc.close], state={"pc": pc}, openapi="pc")
