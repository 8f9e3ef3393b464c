"""The link between an agent and the rest of the fleet cut in the middle of a streamed session
(§6.8): the PC fails the instance when its status runs out, resumes the session on the other
agent, and the front end, in a namespace of its own, gets every token once, each as an
uninterrupted run makes it (greedy). Agents are `kvsp agent` with the tiny model, paced so that
the cut lands mid-session. Needs root (it fails, not skips, without it)."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import httpx

from kvsp_moq.fleet.services import Fleet
from kvsp_moq.fleet.topology import fleet_topology
from kvsp_moq.frontend import FrontEnd, Token

PROMPT = list(range(1, 73))  # 4 complete blocks of 16 and a tail of 8
NEW = 64
CUT_AT = 12  # tokens delivered before the serving agent's link may be cut


def test_a_session_whose_agent_is_cut_off_resumes_elsewhere_every_token_once() -> None:
    with Fleet(fleet_topology(clients=1, agents=2), prefix=f"kvspfs{os.getpid()}",
               agent_token_interval_s=0.05, agent_args=("--status-ttl-ms", "1000")) as fleet:
        a, b = fleet.agent_url("agent1"), fleet.agent_url("agent2")
        pc, user = fleet.index_url, {"Authorization": f"Bearer {fleet.token('frontend')}"}
        observer = {"Authorization": f"Bearer {fleet.token('pc')}"}

        def states() -> dict[str, str]:
            """What the PC says of each instance (asked from the client's host)."""
            def ask() -> Any:
                with httpx.Client(trust_env=False, timeout=5) as client:
                    return client.get(pc + "instances", headers=observer).json()["instances"]

            return {i["instance"]: i["state"] for i in fleet.net.in_host("client1", ask)}

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if [states().get(x) for x in (a, b)] == ["active", "active"]:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"both agents active at the PC: not within 60 s\n{fleet.logs()}")

        async def front_end() -> tuple[list[int], list[Token]]:
            async with httpx.AsyncClient(trust_env=False, timeout=60, headers=user) as client:
                r = await client.post(b + "generate", json={"tokens": PROMPT, "max_new_tokens": NEW})
                assert r.status_code == 200, r.text
                reference = r.json()["tokens"]
                session = str(uuid.uuid4())
                async with client.stream("POST", a + "generate", json={
                        "tokens": PROMPT, "max_new_tokens": NEW, "session": session,
                        "sampler": {"method": "greedy"}, "stream": True}) as r:
                    assert r.status_code == 200  # the front end reads the session from here
            got: list[Token] = []
            cut = False
            async with FrontEnd(pc, token=fleet.token("frontend"), timeout_s=60, backoff_s=0.1,
                                read_timeout_s=3) as fe, \
                    httpx.AsyncClient(trust_env=False, timeout=5, headers=user) as client:
                async for tok in fe.stream(session, instance=a):
                    got.append(tok)
                    # cut once the PC holds a checkpoint of the session (before it, there is
                    # nothing to resume from: the session would be lost, not moved)
                    if not cut and len(got) >= CUT_AT and \
                            (await client.get(f"{pc}sessions/{session}")).status_code == 200:
                        fleet.net.set_link("agent1", False)  # A runs on, unreachable
                        cut = True
            assert cut, "the session ended before the PC held a checkpoint of it"
            return reference, got

        try:
            reference, got = fleet.net.in_host("client1", lambda: asyncio.run(front_end()))
        except Exception as e:
            raise AssertionError(f"{e!r}\n{fleet.logs(40)}") from e
        assert [t.index for t in got] == list(range(NEW))
        epochs = [t.epoch for t in got]
        assert epochs == sorted(epochs) and epochs[0] == 1 and epochs[-1] == 2, epochs
        assert epochs.count(1) >= CUT_AT
        assert [t.token for t in got] == reference  # greedy: the same wherever computed
        assert states().get(a) != "active"  # failed when its status ran out
        assert states().get(b) == "active"


