"""The attacks of one tenant on another at the PC and at instances, each as it was tried: with a
valid token of tenant B, against tenant A's instance, sessions and shards. Each is refused, and
A's own traffic goes on as before.

(Holders' storage, request bodies and the relay have tests of their own in this folder.)
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from kvsp_moq.protocol.instances import instance_id

from .test_authorization_table import (
    COMPAT,
    EPOCHS,
    INST,
    PROMPT,
    SCOPES,
    Env,
    checkpoint,
    env,
    ok,
    refused,
    report,
    seeded,
    status_record,
    tok,
)

__all__ = ["env"]  # the servers of the authorization table, shared by module


def status_url(base: str, url: str) -> str:
    return f"{base}instances/{instance_id(url)}/status"


def instances(env: Env, who: str) -> dict[str, dict[str, Any]]:
    r = ok(env.http.get(env.urls["pc"] + "instances", headers=tok(who)))
    return {i["instance"]: i for i in r.json()["instances"]}


# --------------------------------------------------------------------------- 1. forged status


def test_b_cannot_forge_a_status_of_as_instance(env: Env) -> None:
    base = env.urls["pc"]
    ok(report(env, base, "a"))
    forged = {**status_record(INST["a"], 10**12), "state": "failed"}
    refused(env.http.put(status_url(base, INST["a"]), json=forged, headers=tok("inst-b")))
    # A is not locked out: its next record, at its own epoch, is taken, and it is active.
    ok(report(env, base, "a"))
    assert instances(env, "inst-a")[INST["a"]]["state"] == "active"
    assert instances(env, "inst-a")[INST["a"]]["epoch"] == EPOCHS["a"]


def test_an_instance_reports_only_urls_it_may_speak_for(env: Env) -> None:
    base = env.urls["pc"]
    evil = "http://collector.test/"  # would receive other tenants' prompts and tokens
    refused(env.http.put(status_url(base, evil), json=status_record(evil), headers=tok("inst-b")))
    assert evil not in instances(env, "admin")


def test_a_second_principal_of_the_same_scope_cannot_take_a_live_instance_over(env: Env) -> None:
    """Even a principal that may speak for the URL (the holders list is an operator's typo
    away) does not replace the one that reported a live incarnation."""
    base = env.urls["pc"]
    ok(report(env, base, "a"))
    refused(env.http.put(status_url(base, INST["a"]), json=status_record(INST["a"], 10**12),
                         headers=tok("role-instance")))  # holders "*"
    ok(report(env, base, "a"))


# --------------------------------------------------------------------------- 2. placement


def test_routes_go_only_to_instances_serving_the_scope(env: Env) -> None:
    base = env.urls["pc"]
    ok(report(env, base, "a"))
    ok(report(env, base, "b"))
    route_b = {"block_keys": [], "scope_id": SCOPES["b"], "compat_id": COMPAT}
    # B excludes its own instance: A's, which cannot serve B, is not the answer.
    r = env.http.post(base + "route", json={**route_b, "exclude": [INST["b"]]},
                      headers=tok("client-b"))
    assert r.status_code == 503 and r.json()["type"].endswith("kvsp-no-instance"), r.text
    # Thirty routes of B neither land on A's instance nor count in its load...
    for _ in range(30):
        assert ok(env.http.post(base + "route", json=route_b,
                                headers=tok("client-b"))).json()["instance"] == INST["b"]
    assert instances(env, "admin")[INST["a"]]["routed"] == 0
    # ... and A's client is routed to A's instance, never to B's.
    route_a = {"block_keys": [], "scope_id": SCOPES["a"], "compat_id": COMPAT}
    for _ in range(5):
        assert ok(env.http.post(base + "route", json=route_a,
                                headers=tok("client-a"))).json()["instance"] == INST["a"]


def test_the_instance_listing_shows_each_tenant_its_own(env: Env) -> None:
    base = env.urls["pc"]
    ok(report(env, base, "a"))
    ok(report(env, base, "b"))
    seen_b = instances(env, "inst-b")
    assert INST["a"] not in seen_b and seen_b[INST["b"]]["scopes"] == [SCOPES["b"]]
    assert {INST["a"], INST["b"]} <= set(instances(env, "admin"))


def test_a_lookup_estimates_only_for_instances_of_its_scope(env: Env) -> None:
    """A lookup's targets get cost estimates from the instances' status records: B naming A's
    instance learns nothing of it."""
    base = env.urls["index"]
    ok(report(env, base, "a"))
    ok(report(env, base, "b"))
    for t in "ab":
        body = {"compat_id": COMPAT, "scope_id": SCOPES[t], "block_keys": ["ee" * 32],
                "targets": [INST["a"], INST["b"]]}
        answer = ok(env.http.post(base + "lookup", json=body, headers=tok(f"inst-{t}"))).json()
        assert [e["instance"] for e in answer["targets"]] == [INST[t]]


# --------------------------------------------------------------------------- 3. sessions


def a_session(env: Env) -> tuple[str, str]:
    base = env.urls["pc"]
    ok(report(env, base, "a"))
    sid = str(uuid.uuid4())
    ok(env.http.put(f"{base}sessions/{sid}/checkpoint",
                    json=checkpoint(sid, "a", instance=INST["a"]), headers=tok("inst-a")))
    return base, sid


def test_b_cannot_take_as_session_over(env: Env) -> None:
    base, sid = a_session(env)
    url = f"{base}sessions/{sid}/checkpoint"
    # B's instance, with B's scope and a high epoch (as B's agent would send it when B's client
    # generates with A's session id and "epoch": 51): refused, and A's session is unchanged.
    refused(env.http.put(url, json=checkpoint(sid, "b", epoch=51, instance=INST["b"]),
                         headers=tok("inst-b")))
    refused(env.http.delete(f"{base}sessions/{sid}", headers=tok("inst-b")))
    state = ok(env.http.get(f"{base}sessions/{sid}", headers=tok("client-a"))).json()
    assert (state["epoch"], state["instance"]) == (1, INST["a"])
    # A's instance goes on checkpointing its session.
    ok(env.http.put(url, json=checkpoint(sid, "a", offset=6, instance=INST["a"]),
                    headers=tok("inst-a")))


def test_an_epoch_jump_from_another_instance_waits_for_the_sessions_own_to_die(env: Env) -> None:
    """Within one scope: a second instance of tenant A may continue A's session only once the
    session's instance is no longer alive (a front end restarting a lost session)."""
    base, sid = a_session(env)
    url = f"{base}sessions/{sid}/checkpoint"
    other = "http://inst-a2.test/"  # a principal of scope A that may speak for it: the admin
    r = env.http.put(url, json=checkpoint(sid, "a", epoch=2, instance=other), headers=tok("admin"))
    assert r.status_code == 409 and r.json()["type"].endswith("kvsp-stale-epoch"), r.text
    EPOCHS["a"] += 1
    failed = {**status_record(INST["a"], EPOCHS["a"]), "state": "failed"}
    ok(env.http.put(status_url(base, INST["a"]), json=failed, headers=tok("inst-a")))
    state = ok(env.http.put(url, json=checkpoint(sid, "a", epoch=2, instance=other),
                            headers=tok("admin"))).json()
    assert (state["epoch"], state["instance"]) == (2, other)
    EPOCHS["a"] += 1
    ok(report(env, base, "a"))  # A's instance back, at a new epoch, for the other tests


def test_at_the_agent_b_cannot_resume_or_read_as_session(env: Env) -> None:
    base = env.urls["agent"]
    done = ok(env.http.post(base + "generate", headers=tok("client-a"),
                            json={"tokens": PROMPT, "max_new_tokens": 2, "scope": "a"})).json()
    session = env.agent.context.engine.sessions[done["session"]]
    cp = session.checkpoint(1).to_json()
    # B's client cannot generate under A's session id in A's scope...
    r = env.http.post(base + "generate", headers=tok("client-b"),
                      json={"tokens": PROMPT, "max_new_tokens": 2, "scope": "a",
                            "session": session.id, "epoch": 51})
    refused(r)
    # ... nor B's PC resume it under B's scope, nor anyone of B read it.
    refused(env.http.post(f"{base}sessions/{session.id}/resume", headers=tok("pc-b"),
                          json={"checkpoint": {**cp, "scope_id": SCOPES["b"]}, "epoch": 51}))
    refused(env.http.get(f"{base}sessions/{session.id}", headers=tok("client-b")))
    assert env.agent.context.engine.sessions[session.id].epoch == done["epoch"]


# --------------------------------------------------------------------------- 6. raw KV


def test_b_cannot_read_as_shards_or_state(env: Env) -> None:
    base = env.urls["agent"]
    name = seeded(env, base)
    for url, params in ((base + "kv", {"map": name, "tokens": "0-16"}),
                        (f"{base}reshard/{name}", None)):
        r = env.http.get(url, params=params, headers=tok("inst-b"))
        refused(r)
        assert not r.content.startswith(b"KVB")  # no tensor octets in a refusal
    assert ok(env.http.get(base + "kv", params={"map": name, "tokens": "0-16"},
                           headers=tok("inst-a"))).content


def test_a_seed_without_a_scope_is_of_the_instances_own_scope(env: Env) -> None:
    base = env.urls["agent"]
    name = f"noscope-{uuid.uuid4().hex[:8]}"
    # The agent's own scope applies when the seed names none: that of its --scope ("a").
    ok(env.http.put(f"{base}shards/{name}", headers=tok("admin"),
                    json={"version": 1, "tokens": PROMPT, "ranges": [[0, 16]]}))
    refused(env.http.get(f"{base}reshard/{name}", headers=tok("inst-b")))
    ok(env.http.get(f"{base}reshard/{name}", headers=tok("inst-a")))


def test_unauthenticated_requests_learn_nothing(env: Env) -> None:
    with httpx.Client(timeout=10, trust_env=False) as http:
        for url in (env.urls["pc"] + "instances", env.urls["agent"] + "status",
                    env.urls["pc"] + "metrics"):
            assert http.get(url).status_code == 401
