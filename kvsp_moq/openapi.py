"""OpenAPI 3.1 description of the project's HTTP APIs (DESIGN §3, §6).

One document covers every component; `document(component)` cuts out the paths one server
actually serves, so each server can publish an accurate `GET /openapi.json` and clients and
fuzzers can be generated from the same schemas the tests check against.
"""

from __future__ import annotations

import copy
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvsp_moq.errors import PROBLEM_PREFIX
from kvsp_moq.protocol.container import MEDIA_TYPE as BLOCK_MEDIA_TYPE
from kvsp_moq.protocol.problems import MEDIA_TYPE as PROBLEM_MEDIA_TYPE

KVSP_JSON = "application/kvsp+json"
NDJSON = "application/x-ndjson"
COMPONENTS = ("index", "pc", "holder", "agent")



def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _hex(octets: int) -> dict[str, Any]:
    return {"type": "string", "pattern": f"^[0-9a-f]{{{2 * octets}}}$"}


_URL = {"type": "string", "format": "uri"}
_INT = {"type": "integer", "minimum": 0}
_RANGE = {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}
_OBJ = {"type": "object"}

SCHEMAS: dict[str, dict[str, Any]] = {
    "Problem": {
        "description": "RFC 9457 problem details; `type` is urn:kvsp:problem:<name> or "
                       "about:blank.",
        "type": "object",
        "required": ["type", "title", "status"],
        "properties": {
            "type": {"type": "string",
                     "anyOf": [{"pattern": f"^{PROBLEM_PREFIX}"}, {"const": "about:blank"}]},
            "title": {"type": "string"},
            "status": {"type": "integer", "minimum": 400, "maximum": 599},
            "detail": {"type": "string"},
            "instance": {"type": "string"},
            "member": {"type": "string", "description": "the offending member of the input"},
        },
    },
    "Residency": {
        "type": "object", "required": ["tier", "layers"],
        "properties": {"tier": {"type": "string", "maxLength": 64}, "layers": _RANGE,
                       "read_mbit_per_s": {"type": "number", "exclusiveMinimum": 0}},
    },
    "ReplicaRecord": {
        "description": "KVSP §4.4 Replica Record.",
        "type": "object",
        "required": ["block_key", "compat_id", "scope_id", "holder", "codec", "size", "digest",
                     "ttl_ms"],
        "properties": {
            "block_key": _hex(32), "compat_id": _hex(32), "scope_id": _hex(16),
            "holder": _URL, "codec": {"type": "integer", "minimum": 0, "maximum": 65535},
            "size": _INT, "digest": {"type": "string", "pattern": "^sha-256:[0-9a-f]{64}$"},
            "ttl_ms": {"type": "integer", "minimum": 1},
            "layer_digests": {"type": "array", "items": _hex(32)},
            "residency": {"type": "array", "items": _ref("Residency")},
            "moqt_namespace": {"type": "string"},
            "http_holder": _URL,
        },
    },
    "ReplicaPutResult": {
        "type": "object", "required": ["replica_id", "ttl_ms"],
        "properties": {"replica_id": _hex(16), "ttl_ms": {"type": "integer"}},
    },
    "ReplicaBatch": {
        "type": "object", "required": ["records"],
        "properties": {"records": {"type": "array", "items": _ref("ReplicaRecord"),
                                   "maxItems": 1000}},
    },
    "ReplicaBatchResult": {
        "type": "object", "required": ["created", "refreshed", "ttl_capped", "max_ttl_ms"],
        "properties": {k: {"type": "integer"}
                       for k in ("created", "refreshed", "ttl_capped", "max_ttl_ms")},
    },
    "LookupRequest": {
        "description": "KVSP §6.2 lookup.",
        "type": "object", "required": ["scope_id", "compat_id", "block_keys"],
        "properties": {"scope_id": _hex(16), "compat_id": _hex(32),
                       "block_keys": {"type": "array", "items": _hex(32)},
                       "targets": {"type": ["array", "null"], "items": _URL, "maxItems": 4096,
                                   "description": "instances to estimate; null is as absent"}},
    },
    "LookupResponse": {
        "description": "DESIGN §6: matched keys in prefix order with their replicas.",
        "type": "object", "required": ["matched", "blocks"],
        "properties": {
            "matched": _INT,
            "blocks": {"type": "array", "items": {
                "type": "object", "required": ["block_key", "replicas"],
                "properties": {"block_key": _hex(32),
                               "replicas": {"type": "array", "items": _ref("ReplicaRecord")}}}},
            "targets": {"type": "array", "items": {
                "type": "object", "required": ["instance", "fetch_us", "recompute_us"],
                "properties": {"instance": _URL, "fetch_us": {"type": "number"},
                               "recompute_us": {"type": "number"}}}},
        },
    },
    "Link": {
        "type": "object", "required": ["holder", "mbit_per_s"],
        "properties": {"holder": _URL, "mbit_per_s": {"type": "number", "exclusiveMinimum": 0},
                       "rtt_us": {"type": "number", "minimum": 0}},
    },
    "InstanceStatus": {
        "description": "KVSP §6.3 Instance Status Record.",
        "type": "object", "required": ["instance", "epoch", "state", "ttl_ms"],
        "properties": {
            "instance": _URL, "epoch": _INT,
            "state": {"type": "string", "enum": ["active", "draining", "sleeping", "starting"]},
            "ttl_ms": {"type": "integer", "minimum": 1},
            "running": _INT, "queued": _INT, "batch_size": _INT,
            "kv_utilization": {"type": "number", "minimum": 0, "maximum": 1},
            "prefill_tokens_per_s": {"type": "number", "minimum": 0},
            "decode_tokens_per_s": {"type": "number", "minimum": 0},
            "links": {"type": "array", "items": _ref("Link")},
            "requested_state": {"type": "string"},
            "admitted": {"type": "integer", "minimum": 0,
                         "description": "Extension: requests admitted in this epoch."},
        },
    },
    "InstanceStatusNow": {
        "description": "An instance's GET /status: its Instance Status Record when it reports "
                       "to a PC; without a PC there is no report, so no `ttl_ms`.",
        "type": "object", "required": ["instance", "epoch", "state"],
        "properties": {"instance": _URL, "epoch": _INT, "state": {"type": "string"},
                       "ttl_ms": {"type": "integer", "minimum": 1},
                       "running": _INT, "queued": _INT},
    },
    "InstanceReply": {"type": "object", "required": ["state"],
                      "properties": {"state": {"type": "string"}}},
    "InstanceList": {"type": "object", "required": ["instances"],
                     "properties": {"instances": {"type": "array", "items": _OBJ}}},
    "StateChange": {
        "type": "object", "required": ["state"],
        "properties": {"state": {"type": "string", "enum": ["active", "draining", "sleeping"]},
                       "epoch": _INT},
    },
    "Sampler": {
        "type": "object", "required": ["method"],
        "properties": {"method": {"type": "string", "maxLength": 64}, "params": _OBJ,
                       "seed": {"type": "integer"}, "step": {"type": "integer"},
                       "deterministic": {"type": "boolean"}},
    },
    "SessionCheckpoint": {
        "description": "KVSP §6.8 Session Checkpoint.",
        "type": "object",
        "required": ["session", "epoch", "compat_id", "scope_id", "prompt_blocks",
                     "prompt_tail", "generated", "output_offset", "sampler"],
        "properties": {
            "session": {"type": "string", "format": "uuid"}, "epoch": _INT,
            "compat_id": _hex(32), "scope_id": _hex(16),
            "prompt_blocks": {"type": "array", "items": _hex(32)},
            "prompt_tail": {"type": "array", "items": _INT},
            "generated": {"type": "array", "items": _INT},
            "output_offset": _INT, "sampler": _ref("Sampler"), "instance": _URL,
        },
    },
    "SessionState": {
        "description": "DESIGN §6: where a session runs and at which epoch.",
        "type": "object", "required": ["session", "epoch"],
        "properties": {"session": {"type": "string"}, "epoch": _INT, "instance": _URL,
                       "output_offset": _INT},
    },
    "RouteRequest": {"type": "object", "description": "Prompt tokens in (our extension).",
                     "properties": {"tokens": {"type": "array", "items": _INT},
                                    "scope_id": _hex(16), "compat_id": _hex(32),
                                    "exclude": {"type": "array", "items": _URL,
                                                "description": "Instances not to place it on."}}},
    "RouteDecision": {"type": "object", "description": "The chosen instance and directive.",
                      "properties": {"instance": _URL, "directive": _ref("PrefetchDirective")}},
    "ShardMap": {
        "type": "object", "required": ["map", "version", "shards"],
        "properties": {"map": {"type": "string"}, "version": _INT,
                       "shards": {"type": "array", "items": {
                           "type": "object", "required": ["tokens", "instance"],
                           "properties": {"tokens": _RANGE, "instance": _URL}}},
                       "deadline_ms": {"type": "integer", "minimum": 1, "maximum": 600000}},
    },
    "ReshardMessage": {"type": "object", "description": "A §6.9 plan, commit or abort.",
                       "required": ["map", "kind"],
                       "properties": {"map": {"type": "string"},
                                      "kind": {"type": "string",
                                               "enum": ["plan", "commit", "abort"]}}},
    "PrefetchBlock": {"type": "object", "required": ["block_key", "sources"],
                      "properties": {"block_key": _hex(32),
                                     "sources": {"type": "array", "items": _URL}}},
    "PrefetchDirective": {
        "description": "KVSP §6.5 Prefetch Directive.",
        "type": "object",
        "required": ["directive", "scope_id", "compat_id", "blocks", "deadline_ms", "lease_ms"],
        "properties": {
            "directive": {"type": "string"}, "request_ref": {"type": "string"},
            "scope_id": _hex(16), "compat_id": _hex(32),
            "blocks": {"type": "array", "items": _ref("PrefetchBlock")},
            "layer_order": {"type": "string", "enum": ["ascending"]},
            "deadline_ms": {"type": "integer", "minimum": 1},
            "lease_ms": {"type": "integer", "minimum": 1},
        },
    },
    "PrefetchState": {"type": "object", "required": ["directive", "state"],
                      "properties": {"directive": {"type": "string"},
                                     "state": {"type": "string"},
                                     "loaded": {"type": "array", "items": _hex(32)},
                                     "failed": {"type": "array", "items": _hex(32)},
                                     "sources": {
                                         "description": "blocks loaded per transport",
                                         "type": "object",
                                         "additionalProperties": {"type": "integer"}},
                                     "request_ref": {"type": "string"},
                                     "elapsed_ms": {"type": "number"}}},
    "LeaseRequest": {
        "description": "KVSP §6.6 lease request.",
        "type": "object", "required": ["block_keys", "ttl_ms"],
        "properties": {"block_keys": {"type": "array", "items": _hex(32), "minItems": 1},
                       "ttl_ms": {"type": "integer", "minimum": 1}},
    },
    "Lease": {"description": "KVSP §6.6 lease grant.",
              "type": "object", "required": ["lease", "ttl_ms"],
              "properties": {"lease": _hex(16), "ttl_ms": {"type": "integer", "minimum": 1}}},
    "LeaseRenewal": {"type": "object",
                     "properties": {"ttl_ms": {"type": "integer", "minimum": 1}}},
    "GenerateRequest": {
        "type": "object", "required": ["tokens"],
        "properties": {"tokens": {"type": "array", "items": _INT},
                       "max_new_tokens": {"type": "integer", "minimum": 0},
                       "sampler": _ref("Sampler"), "session": {"type": "string"},
                       "stream": {"type": "boolean"}, "scope": {"type": "string"},
                       "timeline": {"type": "boolean"},
                       "epoch": {"type": "integer", "minimum": 1}},
    },
    "GenerateResponse": {
        "type": "object", "required": ["session", "epoch", "tokens", "cached_tokens"],
        "properties": {"session": {"type": "string"}, "epoch": _INT,
                       "tokens": {"type": "array", "items": _INT}, "prompt_tokens": _INT,
                       "cached_tokens": _INT, "ttft_ms": {"type": "number"},
                       "sources": {"type": "object",
                                   "additionalProperties": {"type": "integer"}},
                       "timing": _OBJ, "load": _OBJ, "timeline": _OBJ},
    },
    "ResumeRequest": {"type": "object", "required": ["checkpoint", "epoch"],
                      "properties": {"checkpoint": _ref("SessionCheckpoint"), "epoch": _INT}},
    "Health": {"type": "object", "required": ["status"],
               "properties": {"status": {"type": "string", "const": "ok"}}},
}

_RESPONSES: dict[str, dict[str, Any]] = {
    str(code): {"description": title,
                "content": {PROBLEM_MEDIA_TYPE: {"schema": _ref("Problem")}}}
    for code, title in ((400, "Malformed input"), (401, "Unauthorized"),
                        (403, "Not authorized for this scope, or no role that may do this"),
                        (404, "Not found"), (408, "The request head did not arrive in time"),
                        (409, "Stale epoch"), (411, "Length required"),
                        (412, "Precondition failed"), (413, "Content too large"),
                        (428, "Precondition required"), (429, "Lease quota exceeded"),
                        (431, "Request head too large"), (502, "Upstream failure"),
                        (503, "Not active, or overloaded (see Retry-After)"),
                        (507, "Insufficient storage"))
}


def _problems(*codes: int) -> dict[str, Any]:
    return {str(c): {"$ref": f"#/components/responses/{c}"} for c in codes}


def _json(schema: str | dict[str, Any], description: str = "OK") -> dict[str, Any]:
    body = _ref(schema) if isinstance(schema, str) else schema
    return {"description": description, "content": {KVSP_JSON: {"schema": body}}}


def _body(schema: str) -> dict[str, Any]:
    return {"required": True, "content": {KVSP_JSON: {"schema": _ref(schema)},
                                          "application/json": {"schema": _ref(schema)}}}


def _params(*names: str, query: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
           for n in names]
    out += [{"name": n, "in": "query", "required": False, "schema": {"type": "string"}}
            for n in query]
    return out


def _op(summary: str, responses: dict[str, Any], *, body: str | None = None,
        params: list[dict[str, Any]] | None = None, auth: bool = True) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": dict(responses)}
    # Any operation: a request the HTTP layer cannot parse (a bad Transfer-Encoding, say) is
    # answered 400 before it reaches the operation, a head too slow 408, too large 431, a
    # connection over the server's cap 503 (`kvsp_moq.web.ProblemHttpProtocol`,
    # `kvsp_moq.http_limits`).
    op["responses"].update(_problems(400, 408, 431, 503))
    if body is not None:
        op["requestBody"] = _body(body)
    if params:
        op["parameters"] = params
    if auth:
        # 401 without a valid token; 403 for a principal whose roles may not do this
        # (kvsp-forbidden-role, kvsp_moq.auth.PERMISSIONS), or outside the scope.
        op["responses"].update(_problems(401, 403))
    else:
        op["security"] = []
    return op


_BLOCK = _params("compat", "scope", "key", query=("layers", "codec"))
_REPLICA = _params("compat", "scope", "block_key", "replica_id")
#: A block is stored once (428 without this header, 412 when a replica is already held).
_IF_NONE_MATCH = {"name": "If-None-Match", "in": "header", "required": True,
                  "schema": {"type": "string", "enum": ["*"]}}
_BLOCK_BODY = {"description": "A KVB1 container",
               "content": {BLOCK_MEDIA_TYPE: {"schema": {"type": "string",
                                                         "contentMediaType": BLOCK_MEDIA_TYPE}}}}

#: Why a lease on another scope's block is a 404 where a GET of it is a 403.
LEASE_SCOPE_NOTE = ("A lease names block keys, not scopes. A block the token's principal may not "
                    "read (another scope's) is answered 404 kvsp-not-found, \"not held\", exactly "
                    "as a block this holder does not have, so that a lease never tells whether "
                    "the holder keeps another scope's block; a GET of that block, whose URL "
                    "names its scope, is answered 403.")

_HOLDER_PATHS: dict[str, dict[str, Any]] = {
    "/blocks/{compat}/{scope}/{key}": {
        "get": _op("Read a block, or a range of its layers (§6.7)",
                   {"200": _BLOCK_BODY, **_problems(400, 403, 404)}, params=_BLOCK),
        "put": {**_op("Store a block (If-None-Match: * required)",
                      {"201": _json("ReplicaRecord", "Stored; the replica record"),
                       **_problems(400, 403, 411, 412, 413, 428, 503, 507)},
                      params=[*_params("compat", "scope", "key"), _IF_NONE_MATCH]),
                "requestBody": {"required": True, "content": _BLOCK_BODY["content"]}},
    },
    "/leases": {"post": {**_op("Take a lease on blocks (§6.6)",
                               {"201": _json("Lease", "Granted"), **_problems(400, 404, 429)},
                               body="LeaseRequest"),
                         "description": LEASE_SCOPE_NOTE}},
    "/leases/{lease}": {
        "put": {**_op("Renew a lease", {"200": _json("Lease"), **_problems(400, 404, 429)},
                      params=_params("lease")),
                "requestBody": {"required": False,
                                "content": {KVSP_JSON: {"schema": _ref("LeaseRenewal")}}}},
        "delete": _op("Release a lease", {"204": {"description": "Released"},
                                          **_problems(400, 404)}, params=_params("lease")),
    },
}

PATHS: dict[str, dict[str, dict[str, Any]]] = {
    "index": {
        "/replicas/{compat}/{scope}/{block_key}/{replica_id}": {
            "put": _op("Publish or refresh one Replica Record (§6.1)",
                       {"200": _json("ReplicaPutResult", "Refreshed"),
                        "201": _json("ReplicaPutResult", "Created"), **_problems(400, 403)},
                       body="ReplicaRecord", params=_REPLICA),
            "delete": _op("Withdraw one Replica Record",
                          {"204": {"description": "Withdrawn"}, **_problems(400, 403, 404)},
                          params=_REPLICA),
        },
        "/replicas:batch": {"post": _op("Publish up to 1,000 records, all or none",
                                        {"200": _json("ReplicaBatchResult"),
                                         **_problems(400, 403)}, body="ReplicaBatch")},
        "/lookup": {"post": _op("Matched leading keys and their replicas (§6.2)",
                                {"200": _json("LookupResponse"), **_problems(400, 403)},
                                body="LookupRequest")},
    },
    "pc": {
        "/instances/{id}/status": {"put": _op(
            "Report an Instance Status Record (§6.3)",
            {"200": _json("InstanceReply"), **_problems(400, 403)},
            body="InstanceStatus", params=_params("id"))},
        "/instances/{id}/state": {"put": _op(
            "Ask an instance to change state", {"200": _json(_OBJ), **_problems(400, 403, 404)},
            body="StateChange", params=_params("id"))},
        "/instances": {"get": _op("Known instances", {"200": _json("InstanceList")})},
        "/sessions/{session}/checkpoint": {"put": _op(
            "Checkpoint a session (§6.8)", {"200": _json("SessionState"), **_problems(400, 403)},
            body="SessionCheckpoint", params=_params("session"))},
        "/sessions/{session}": {
            "get": _op("Where a session runs", {"200": _json("SessionState"),
                                               **_problems(400, 403, 404)},
                       params=_params("session")),
            "delete": _op("End a session", {"204": {"description": "Ended"},
                                            **_problems(400, 403, 404)},
                          params=_params("session")),
        },
        "/route": {"post": _op("Choose an instance for prompt tokens",
                               {"200": _json("RouteDecision"), **_problems(400, 403)},
                               body="RouteRequest")},
        "/reshard/{map}": {"post": _op(
            "Reshard to a Shard Map of version v+1 (§6.9)",
            {"200": _json(_OBJ, "Outcome"), "201": _json(_OBJ, "Installed"),
             **_problems(400, 403, 409)}, body="ShardMap", params=_params("map"))},
        "/shardmaps/{map}": {"get": _op("The authoritative Shard Map",
                                        {"200": _json("ShardMap"), **_problems(404)},
                                        params=_params("map"))},
    },
    "holder": _HOLDER_PATHS,
    "agent": {
        "/generate": {"post": {**_op(
            "Generate tokens (our extension)",
            {"200": {"description": "The generation, or NDJSON tokens with stream",
                     "content": {KVSP_JSON: {"schema": _ref("GenerateResponse")},
                                 NDJSON: {"schema": {"type": "string"}}}},
             **_problems(400, 403, 503)}, body="GenerateRequest")}},
        "/sessions/{session}": {"get": _op("A session's state", {"200": _json(_OBJ),
                                                                **_problems(400, 403, 404)},
                                           params=_params("session"))},
        "/sessions/{session}/stream": {"get": _op(
            "NDJSON tokens from index k on",
            {"200": {"description": "NDJSON", "content": {NDJSON: {"schema": {"type": "string"}}}},
             **_problems(400, 403, 404)}, params=_params("session", query=("from",)))},
        "/sessions/{session}/resume": {"post": _op(
            "Resume a session from its checkpoint", {"202": _json("SessionState", "Accepted"),
                                                     **_problems(400, 403, 409)},
            body="ResumeRequest", params=_params("session"))},
        "/prefetch": {"post": _op("Submit a Prefetch Directive (§6.5)",
                                  {"202": _json("PrefetchState", "Accepted"),
                                   **_problems(400, 403, 503)}, body="PrefetchDirective")},
        "/prefetch/{directive}": {"get": _op("A directive's progress",
                                             {"200": _json("PrefetchState"), **_problems(404)},
                                             params=_params("directive"))},
        "/state": {"put": _op("Change state at this instance's epoch",
                              {"200": _json("StateChange"), **_problems(400, 403, 409)},
                              body="StateChange")},
        "/status": {"get": _op("The Instance Status Record as it would be sent now",
                               {"200": _json("InstanceStatusNow")})},
        "/reshard": {"post": _op("A reshard plan, commit or abort (§6.9)",
                                 {"200": _json(_OBJ), "202": _json(_OBJ, "Accepted"),
                                  **_problems(400, 403, 409)}, body="ReshardMessage")},
        **_HOLDER_PATHS,
    },
}

SERVICE_PATHS: dict[str, dict[str, Any]] = {
    "/healthz": {"get": _op("Liveness", {"200": {"description": "Alive", "content": {
        "application/json": {"schema": _ref("Health")}}}}, auth=False)},
    "/metrics": {"get": _op("Prometheus text metrics (with principals: the metrics role)",
        {"200": {"description": "Metrics",
                 "content": {"text/plain": {"schema": {"type": "string"}}}}})},
    "/openapi.json": {"get": _op("This document", {"200": {"description": "OpenAPI 3.1",
        "content": {"application/json": {"schema": {"type": "object"}}}}}, auth=False)},
}


def _refs(node: Any) -> set[str]:
    """Every $ref value under `node`."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                found.add(value)
            else:
                found |= _refs(value)
    elif isinstance(node, list):
        for item in node:
            found |= _refs(item)
    return found


def document(component: str | None = None) -> dict[str, Any]:
    """The OpenAPI document of one component ("index", "pc", "holder", "agent"), or of all.

    A server running the Index Service and the PC together serves "index+pc"; components joined
    with "+" are merged. Only the schemas and responses the chosen paths use (transitively) are
    included, so each server's document is self-contained and minimal.
    """
    names = list(COMPONENTS) if component is None else component.split("+")
    paths: dict[str, Any] = {}
    for name in names:
        if name not in PATHS:
            raise ValueError(f"unknown component {name!r}; one of {COMPONENTS}")
        for path, ops in PATHS[name].items():
            paths.setdefault(path, {}).update(copy.deepcopy(ops))
    paths.update(copy.deepcopy(SERVICE_PATHS))
    all_components = {"schemas": SCHEMAS, "responses": _RESPONSES}
    used: dict[str, dict[str, Any]] = {"schemas": {}, "responses": {}}
    pending = set(_refs(paths))
    while pending:
        ref = pending.pop()
        _, _, kind, name = ref.split("/", 3)
        if name in used[kind]:
            continue
        used[kind][name] = copy.deepcopy(all_components[kind][name])
        pending |= _refs(used[kind][name])
    return {
        "openapi": "3.1.0",
        "info": {"title": f"kvsp-moq {'+'.join(names)}", "version": "1",
                 "description": "KV Cache Storage Protocol (KVSP) HTTP resources."},
        "paths": dict(sorted(paths.items())),
        "components": {**{k: dict(sorted(v.items())) for k, v in used.items()},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


def openapi_route(component: str) -> Route:
    """`GET /openapi.json` serving `component`'s document (built once, at app creation)."""
    doc = document(component)

    async def openapi(request: Request) -> Response:
        return JSONResponse(doc)

    return Route("/openapi.json", openapi, methods=["GET"])
