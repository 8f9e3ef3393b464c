"""kvsp-moq relay service: a MOQT (draft-18) relay with an object cache, scope authorization
and relay chaining. `Relay` runs in process; `relay.service` is the `kvsp relay` command."""

from .relay import Relay, RelaySettings, RelayStats

__all__ = ["Relay", "RelaySettings", "RelayStats"]
