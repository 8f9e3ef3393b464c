"""Three Placement Controllers on one Redis act as one (`kvsp index --store redis://`): a
status reported to one is used by a route at another, a checkpoint stored at one is read and
failed over by another, an instance's sessions move once whichever PC holds the duties, and a
PC cut off from the store answers 503 instead of answering from memory."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

from tests.pc.fakes import COMPAT, PC, checkpoint, fake_agents, new_session, pc_server, status, status_path
from tests.polling import eventually

ROUTE = {"tokens": list(range(40)), "scope": "tenant", "compat_id": COMPAT}


@contextlib.contextmanager
def pcs(n: int, store: str, tmp_path, **kw) -> Iterator[list[PC]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(pc_server(str(tmp_path / f"unused{i}.db"), store=store,
                                             duties_ttl_ms=600, **kw)) for i in range(n)]


async def test_three_pcs_share_instances_sessions_and_failover(redis_url, http, tmp_path) -> None:
    s = new_session()
    with fake_agents(3) as (a, b, c), pcs(3, redis_url, tmp_path) as (p1, p2, p3):
        assert not (tmp_path / "unused0.db").exists()  # no SQLite with a shared store
        await http.put(p1.url + status_path(a.url), json=status(a.url, ttl_ms=500))
        await http.put(p2.url + status_path(b.url), json=status(b.url))
        await http.put(p3.url + status_path(c.url), json=status(c.url, queued=50))

        async def everyone_sees_three() -> bool:
            for p in (p1, p2, p3):
                listed = (await http.get(p.url + "instances")).json()["instances"]
                if len(listed) != 3:
                    return False
            return True

        await eventually(everyone_sees_three, timeout=5, what="each PC seeing all three")
        r = await http.post(p2.url + "route", json=ROUTE)  # routed on statuses sent elsewhere
        assert r.status_code == 200 and r.json()["instance"] in (a.url, b.url)
        body = checkpoint(s, epoch=1, offset=3, instance=a.url)
        assert (await http.put(f"{p1.url}sessions/{s}/checkpoint", json=body)).status_code == 200
        assert (await http.get(f"{p3.url}sessions/{s}")).json() == {
            "session": s, "epoch": 1, "instance": a.url, "output_offset": 3}
        # §6.8 across PCs: an older epoch refused at another PC than the one that stored it.
        r = await http.put(f"{p2.url}sessions/{s}/checkpoint", json=checkpoint(s, epoch=0, offset=9))
        assert r.status_code == 409
        # A stops reporting: its session moves to B once, whichever PC holds the duties.
        await eventually(lambda: [p.pc.duties.held for p in (p1, p2, p3)].count(True) == 1,
                         timeout=5, what="one PC holding the duties")
        (resume,) = await eventually(lambda: b.received("resume"), timeout=10, what="a resume at B")
        assert resume["epoch"] == 2
        await asyncio.sleep(1.0)  # three sweepers had every chance to move it again
        assert len(b.received("resume")) == 1 and c.received("resume") == []
        for p in (p1, p2, p3):
            st = (await http.get(f"{p.url}sessions/{s}")).json()
            assert (st["epoch"], st["instance"]) == (2, b.url)


async def test_the_duties_pass_to_another_pc_when_their_holder_stops(redis_url, http, tmp_path) -> None:
    s = new_session()
    with fake_agents(2) as (a, b):
        with pc_server(str(tmp_path / "x.db"), store=redis_url, duties_ttl_ms=400) as p2:
            with pc_server(str(tmp_path / "y.db"), store=redis_url, duties_ttl_ms=400) as p1:
                await eventually(lambda: p1.pc.duties.held or p2.pc.duties.held, timeout=5,
                                 what="a holder of the duties")
                first, other = (p1, p2) if p1.pc.duties.held else (p2, p1)
                # The holder stalls (its sweeper stops, as in a process that hangs): the
                # lease lapses and the other PC takes the duties.
                sweeper = first.pc._sweeper
                assert sweeper is not None
                sweeper.cancel()
                await http.put(other.url + status_path(b.url), json=status(b.url))
                await http.put(other.url + status_path(a.url), json=status(a.url, ttl_ms=300))
                await http.put(f"{other.url}sessions/{s}/checkpoint",
                               json=checkpoint(s, offset=2, instance=a.url))
                (resume,) = await eventually(lambda: b.received("resume"), timeout=10,
                                             what="a resume at B by the PC that took over")
                assert resume["epoch"] == 2 and other.pc.duties.held


async def test_a_pc_cut_off_from_the_store_refuses_and_comes_back(own_redis, http, tmp_path) -> None:
    server = own_redis(persistent=True)
    s = new_session()
    with fake_agents(1) as (a,), pcs(2, server.url, tmp_path) as (p1, p2):
        await http.put(p1.url + status_path(a.url), json=status(a.url))
        body = checkpoint(s, epoch=1, offset=4, instance=a.url)
        assert (await http.put(f"{p1.url}sessions/{s}/checkpoint", json=body)).status_code == 200
        server.stop()  # a clean restart: its append-only file holds what was acknowledged

        async def refused() -> bool:
            r = await http.post(p2.url + "route", json=ROUTE)
            return r.status_code == 503

        await eventually(refused, timeout=10, what="routes refused while the store is away")
        r = await http.post(p2.url + "route", json=ROUTE)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "store" in r.json()["detail"]
        r = await http.put(f"{p1.url}sessions/{s}/checkpoint", json=checkpoint(s, offset=5))
        assert r.status_code == 503
        r = await http.put(p1.url + status_path(a.url), json=status(a.url))
        assert r.status_code == 503
        server.start()

        async def routed() -> bool:
            await http.put(p1.url + status_path(a.url), json=status(a.url))
            r = await http.post(p2.url + "route", json=ROUTE)
            return r.status_code == 200

        await eventually(routed, timeout=15, what="routes again once the store is back")
        st = (await http.get(f"{p2.url}sessions/{s}")).json()
        assert (st["epoch"], st["output_offset"]) == (1, 4)  # nothing acknowledged was lost


def test_db_and_a_shared_store_exclude_each_other(tmp_path) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "kvsp_moq.cli", "index", "--role", "pc",
                        "--store", "redis://127.0.0.1:1/0", "--db", str(tmp_path / "x.db"),
                        "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "exclude each other" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


