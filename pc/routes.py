"""The Placement Controller's HTTP resources (DESIGN §3 "PC resources"), over a
`PlacementController`; `pc.app` serves them alone, `index.service` beside the Index Service.

Resources (all JSON, `application/kvsp+json`; errors are problem documents):

- `PUT /instances/{id}/status`: an Instance Status Record; reply `{"state": ...}` (§6.3).
  `{id}` is `instance_id(url)`: the first 16 octets, in hex, of SHA-256 over the instance's base
  URL with its trailing slash (the percent-encoded URL is accepted too). The body's "instance"
  member is authoritative; an `{id}` naming another instance is refused (400, member
  "instance"). Role "instance".
- `GET /instances`: `{"instances": [record + "id", "reported_state", "expires_in_ms",
  "routed", "provisional"]}`: "queued" as reported; "routed" counts requests routed there that
  no record has accounted for yet; "provisional" marks an instance the start hook launched
  that has not reported yet ("reported_state" null).
- `PUT /instances/{id}/state`: `{"state": "active" | "draining" | "sleeping"}`; the PC records it
  and forwards `PUT {ii}state` with `{"state": ..., "epoch": <instance epoch>}`. Role "pc".
- `PUT /sessions/{session}/checkpoint`, `GET /sessions/{session}`, `DELETE /sessions/{session}`
  (our extension: the session ended, do not resume it; it stays readable with `"ended": true`
  for `ended_sessions_keep_s`, so that a front end whose stream broke learns where it ended):
  see `pc.sessions`.
- `POST /route`: see `pc.placement`; with a split policy, "prefill" names the instance that
  computes the prompt apart from its decode, and a prompt whose blocks another route sent
  somewhere moments ago names that instance as computing them (`pc.disaggregation`). Role "pc", or "client"
  holding the scope.
- `POST /reshard/{map}`: a Shard Map of version v+1 (plus an optional top-level
  "deadline_ms"); runs §6.9 and answers the outcome. A map the PC does not know yet is
  installed as given (201), with no traffic. Role "admin".
- `GET /shardmaps/{map}`: the authoritative version.
"""


from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvsp_moq.auth import Action
from kvsp_moq.errors import BadRecord, NotFound
from kvsp_moq.protocol import validate as v
from kvsp_moq.protocol.records import InstanceStatus, SessionCheckpoint, ShardMap
from kvsp_moq.web import json_response, principal, read_json
from pc.controller import PlacementController
from pc.disaggregation import PrefillChoice, choose_prefill
from pc.lifecycle import id_matches

__all__ = ["create_pc_routes"]


def _instance_for(pc: PlacementController, path_id: str) -> InstanceStatus:
    status = pc.registry.find_by_id(path_id)
    if status is None:
        raise NotFound(f"no instance {path_id}")
    return status


def create_pc_routes(pc: PlacementController) -> list[Route]:
    async def put_status(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        record = InstanceStatus.from_json(await read_json(request))
        if not id_matches(request.path_params["id"], record.instance):
            raise BadRecord("names another instance than the resource path", member="instance")
        reply = pc.registry.report(record, who)
        pc.handle(reply.events)
        return json_response(reply.to_json())

    async def list_instances(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        pc.require_store()
        return json_response({"instances": pc.registry.describe(who)})

    async def put_state(request: Request) -> Response:
        who = principal(request, Action.DIRECT)
        body = v.obj(await read_json(request), "body")
        state = v.string(v.required(body, "state"), "state", max_len=32)
        status = _instance_for(pc, request.path_params["id"])
        who.require_every_scope(pc.registry.scopes_of(status.instance), f"instance {status.instance}")
        return json_response(await pc.set_state(status.instance, state))

    def session_id(request: Request) -> str:
        return v.uuid_text(request.path_params["session"], "session")

    async def put_checkpoint(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        body = await read_json(request)
        checkpoint = SessionCheckpoint.from_json(body)
        if checkpoint.session != session_id(request):
            raise BadRecord("differs from the session in the path", member="session")
        instance = body.get("instance")
        if instance is not None:
            instance = v.url(instance, "instance", schemes=("http", "https"))
        state = pc.sessions.checkpoint(checkpoint, instance, by=who,
                                       is_live=pc.registry.is_alive)
        return json_response(state.to_json())

    async def get_session(request: Request) -> Response:
        who = principal(request, Action.READ_SESSIONS)
        state = pc.sessions.get(session_id(request))
        if state is None:
            raise NotFound(f"no session {request.path_params['session']}")
        state.require_access(who)
        return json_response(state.to_json())

    async def delete_session(request: Request) -> Response:
        who = principal(request, Action.REPORT)
        if not pc.sessions.delete(session_id(request), by=who):
            raise NotFound(f"no session {request.path_params['session']}")
        return Response(status_code=204)

    async def route(request: Request) -> Response:
        who = principal(request, Action.ROUTE)
        pc.require_store()
        req = pc.router.parse(await read_json(request))
        who.require_scope(req.scope_id)
        decision = await pc.router.route(req)
        body = decision.to_json()

        def usable(instance: str) -> bool:
            """An instance that may compute this prompt for another: active, serving the scope,
            publishing live KV, and not excluded by the front end."""
            status = pc.registry.get(instance)
            return (status is not None and status.live_kv and instance not in req.exclude
                    and pc.registry.is_active(instance) and pc.registry.serves(instance, req.scope_id))

        now = time.monotonic()
        prefill = None
        if decision.matched == 0:  # nothing cached, but maybe being computed for another route
            running = pc.in_flight.computing(req.scope_id, req.compat_id, req.block_keys, 0, now)
            if running is not None and running[0] != decision.instance and usable(running[0]):
                prefill = PrefillChoice(running[0], "computing this prefix for another request",
                                        running=True, blocks=running[1])
        if prefill is None:
            prefill = choose_prefill(pc.settings.pd, decision.instance, decision.candidates,
                                     uncached_tokens=req.token_count - decision.matched_tokens,
                                     is_usable=usable)
            if prefill is not None:
                pc.registry.note_routed(prefill.instance, req.scope_id)
        computed_from = prefill.blocks if prefill is not None and prefill.running else decision.matched
        computer = prefill.instance if prefill is not None and not prefill.running else decision.instance
        pc.in_flight.note(req.scope_id, req.compat_id, req.block_keys[computed_from or 0:], computer, now)
        if prefill is not None:
            status = pc.registry.get(prefill.instance)
            if status is not None and status.holder is not None:
                prefill = dataclasses.replace(prefill, holder=status.holder)
            body["prefill"] = prefill.to_json()
        return json_response(body)

    async def reshard(request: Request) -> Response:
        principal(request, Action.RESHARD)
        body = v.obj(await read_json(request), "body")
        target = ShardMap.from_json(body)
        if target.map != request.path_params["map"]:
            raise BadRecord("differs from the map in the path", member="map")
        deadline = body.get("deadline_ms")
        if deadline is not None:
            deadline = v.integer(deadline, "deadline_ms", low=1, high=600_000)
        outcome = await pc.resharder.reshard(target, deadline_ms=deadline)
        if outcome is None:
            return json_response({"map": target.map, "version": target.version,
                                  "installed": True}, status=201)
        return json_response(outcome.to_json())

    async def get_shardmap(request: Request) -> Response:
        who = principal(request, Action.OBSERVE)
        m = pc.maps.get(request.path_params["map"])
        if m is None:
            raise NotFound(f"no shard map {request.path_params['map']}")
        who.require_resource_scope(m.scope_id)
        return json_response(m.to_json())

    return [
        Route("/instances/{id}/status", put_status, methods=["PUT"]),
        Route("/instances/{id}/state", put_state, methods=["PUT"]),
        Route("/instances", list_instances, methods=["GET"]),
        Route("/sessions/{session}/checkpoint", put_checkpoint, methods=["PUT"]),
        Route("/sessions/{session}", get_session, methods=["GET"]),
        Route("/sessions/{session}", delete_session, methods=["DELETE"]),
        Route("/route", route, methods=["POST"]),
        Route("/reshard/{map}", reshard, methods=["POST"]),
        Route("/shardmaps/{map}", get_shardmap, methods=["GET"]),
    ]
