"""Checkpoints, epochs, persistence across a PC restart, and failover (§6.8)."""

import httpx
import pytest

from kvsp_moq.errors import BadRecord, StaleEpoch
from kvsp_moq.protocol.records import SessionCheckpoint
from pc.sessions import SessionStore, accept_checkpoint, move_session, resume_body
from tests.pc.fakes import checkpoint, fake_agents, new_session, pc_server, status, status_path
from tests.polling import eventually

II = "http://127.0.0.1:9001/"


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


def cp(session, **kw):
    return SessionCheckpoint.from_json(checkpoint(session, **kw))


# --------------------------------------------------------------------------- rules


def test_checkpoint_rules():
    s = new_session()
    with pytest.raises(BadRecord):
        accept_checkpoint(None, cp(s), None)          # who serves it?
    st = accept_checkpoint(None, cp(s, offset=3), II)
    assert (st.epoch, st.instance, st.output_offset) == (1, II, 3)
    assert accept_checkpoint(st, cp(s, offset=2), None) is st          # older: kept as is
    st = accept_checkpoint(st, cp(s, offset=5), II)
    assert st.output_offset == 5
    moved = move_session(st, "http://127.0.0.1:9002")
    assert (moved.epoch, moved.instance, moved.output_offset) == (2, "http://127.0.0.1:9002/", 5)
    assert resume_body(moved) == {"checkpoint": st.checkpoint, "epoch": 2}
    with pytest.raises(StaleEpoch):
        accept_checkpoint(moved, cp(s, epoch=1, offset=9), II)
    with pytest.raises(StaleEpoch):                    # epoch 2 belongs to the new instance
        accept_checkpoint(moved, cp(s, epoch=2, offset=6), II)
    st2 = accept_checkpoint(moved, cp(s, epoch=2, offset=5), None)
    assert st2.checkpoint["epoch"] == 2 and st2.epoch == 2


def test_store_survives_reopen(tmp_path):
    db = tmp_path / "s.db"
    s = new_session()
    store = SessionStore(db)
    store.checkpoint(cp(s, offset=4), II)
    assert store.move(s, "http://127.0.0.1:9002/", expect_epoch=1).epoch == 2
    assert store.move(s, "http://127.0.0.1:9003/", expect_epoch=1) is None   # compare-and-set
    store.close()
    again = SessionStore(db)
    st = again.get(s)
    assert (st.epoch, st.instance, st.output_offset) == (2, "http://127.0.0.1:9002/", 4)
    assert [x.session for x in again.on_instance("http://127.0.0.1:9002")] == [s]
    again.close()


# --------------------------------------------------------------------------- over HTTP


async def test_checkpoint_epochs_over_http(tmp_path, http):
    s = new_session()
    with pc_server(str(tmp_path / "pc.db")) as pc:
        url = f"{pc.url}sessions/{s}"
        r = await http.put(url + "/checkpoint", json=checkpoint(s, epoch=3, offset=2, instance=II))
        assert r.status_code == 200
        assert r.json() == {"session": s, "epoch": 3, "instance": II, "output_offset": 2}
        await http.put(url + "/checkpoint", json=checkpoint(s, epoch=3, offset=6))
        await http.put(url + "/checkpoint", json=checkpoint(s, epoch=3, offset=4))
        assert (await http.get(url)).json()["output_offset"] == 6
        r = await http.put(url + "/checkpoint", json=checkpoint(s, epoch=2, offset=9))
        assert r.status_code == 409
        assert r.json()["type"] == "urn:kvsp:problem:kvsp-stale-epoch"
        assert (await http.get(url)).json() == {"session": s, "epoch": 3, "instance": II,
                                                "output_offset": 6}
        # Bodies: the path names the session; malformed members are named.
        r = await http.put(f"{pc.url}sessions/{new_session()}/checkpoint",
                           json=checkpoint(s, instance=II))
        assert r.status_code == 400 and r.json()["member"] == "session"
        bad = checkpoint(s)
        bad["output_offset"] = 99
        r = await http.put(url + "/checkpoint", json=bad)
        assert r.status_code == 400 and r.json()["member"] == "output_offset"
        r = await http.put(f"{pc.url}sessions/{new_session()}/checkpoint", json={})
        assert r.status_code == 400
        assert (await http.get(f"{pc.url}sessions/{new_session()}")).status_code == 404
        assert (await http.get(f"{pc.url}sessions/not-a-uuid")).json()["member"] == "session"
        assert (await http.delete(url)).status_code == 204
        # Ended: still readable (where it ended), never resumed, no checkpoint brings it back.
        assert (await http.get(url)).json() == {"session": s, "epoch": 3, "instance": II,
                                                "output_offset": 6, "ended": True}
        r = await http.put(url + "/checkpoint", json=checkpoint(s, epoch=3, offset=8))
        assert r.status_code == 409 and "ended" in r.json()["detail"]
        assert (await http.delete(url)).status_code == 404
        assert pc.pc.sessions.on_instance(II) == [] and pc.pc.sessions.count() == 0
        assert pc.pc.sessions.purge_ended(keep_s=-1) == 1
        assert (await http.get(url)).status_code == 404


async def test_pc_restart_keeps_sessions(tmp_path, http):
    db = str(tmp_path / "pc.db")
    s1, s2 = new_session(), new_session()
    with pc_server(db) as pc:
        await http.put(f"{pc.url}sessions/{s1}/checkpoint",
                       json=checkpoint(s1, epoch=4, offset=7, instance=II))
        await http.put(f"{pc.url}sessions/{s2}/checkpoint",
                       json=checkpoint(s2, epoch=1, offset=1, instance=II))
    with pc_server(db) as pc:
        assert (await http.get(f"{pc.url}sessions/{s1}")).json() == {
            "session": s1, "epoch": 4, "instance": II, "output_offset": 7}
        assert (await http.get(f"{pc.url}sessions/{s2}")).json()["epoch"] == 1
        r = await http.put(f"{pc.url}sessions/{s1}/checkpoint", json=checkpoint(s1, epoch=3))
        assert r.status_code == 409


async def test_failover_resumes_on_another_active_instance(tmp_path, http):
    s = new_session()
    with fake_agents(3) as (a, b, c), pc_server(str(tmp_path / "pc.db")) as pc:
        await http.put(pc.url + status_path(a.url), json=status(a.url, ttl_ms=300))
        await http.put(pc.url + status_path(b.url), json=status(b.url))
        await http.put(pc.url + status_path(c.url), json=status(c.url, queued=50))  # costlier
        body = checkpoint(s, epoch=1, offset=3, instance=a.url)
        await http.put(f"{pc.url}sessions/{s}/checkpoint", json=body)
        # A stops reporting; its record expires and B (the cheaper) gets the session.
        (resume,) = await eventually(lambda: b.received("resume"), timeout=5, what="a resume at B")
        del body["instance"]
        assert resume == {"session": s, "checkpoint": body, "epoch": 2}
        st = (await http.get(f"{pc.url}sessions/{s}")).json()
        assert st == {"session": s, "epoch": 2, "instance": b.url, "output_offset": 3}
        assert a.received("resume") == [] and c.received("resume") == []
        # The failed instance's messages under the old epoch are refused.
        r = await http.put(f"{pc.url}sessions/{s}/checkpoint",
                           json=checkpoint(s, epoch=1, offset=5, instance=a.url))
        assert r.status_code == 409


async def test_failover_moves_on_when_an_instance_refuses(tmp_path, http):
    s = new_session()
    with fake_agents(3) as (a, b, c), pc_server(str(tmp_path / "pc.db")) as pc:
        b.resume_status = 503                          # B keeps failing: bounded tries, then C
        await http.put(pc.url + status_path(a.url), json=status(a.url, ttl_ms=200))
        await http.put(pc.url + status_path(b.url), json=status(b.url))
        await http.put(pc.url + status_path(c.url), json=status(c.url, queued=5))
        await http.put(f"{pc.url}sessions/{s}/checkpoint",
                       json=checkpoint(s, offset=2, instance=a.url))
        (resume,) = await eventually(lambda: c.received("resume"), timeout=5, what="a resume at C")
        assert len(b.received("resume")) == 3          # attempts_per_target
        assert {r["epoch"] for r in b.received("resume")} == {2}
        assert resume["epoch"] == 3                     # a new instance, a new epoch
        st = (await http.get(f"{pc.url}sessions/{s}")).json()
        assert (st["epoch"], st["instance"]) == (3, c.url)


async def test_restarted_pc_fails_over_sessions_of_silent_instances(tmp_path, http):
    db = str(tmp_path / "pc.db")
    s = new_session()
    with fake_agents(2) as (a, b):
        with pc_server(db) as pc:
            await http.put(pc.url + status_path(a.url), json=status(a.url))
            await http.put(f"{pc.url}sessions/{s}/checkpoint",
                           json=checkpoint(s, offset=4, instance=a.url))
        # A dies while the PC is down; the new PC never hears from it.
        with pc_server(db, startup_grace_ms=300) as pc:
            await http.put(pc.url + status_path(b.url), json=status(b.url))
            (resume,) = await eventually(lambda: b.received("resume"), timeout=5, what="a resume at B")
            assert resume["epoch"] == 2 and resume["checkpoint"]["output_offset"] == 4
            st = (await http.get(f"{pc.url}sessions/{s}")).json()
            assert (st["instance"], st["epoch"]) == (b.url, 2)


async def test_restarted_instance_gets_its_sessions_back_under_a_new_epoch(tmp_path, http):
    s = new_session()
    with fake_agents(1) as (a,), pc_server(str(tmp_path / "pc.db")) as pc:
        await http.put(pc.url + status_path(a.url), json=status(a.url, epoch=100))
        await http.put(f"{pc.url}sessions/{s}/checkpoint",
                       json=checkpoint(s, offset=2, instance=a.url))
        r = await http.put(pc.url + status_path(a.url), json=status(a.url, epoch=200))
        assert r.json() == {"state": "active"}
        (resume,) = await eventually(lambda: a.received("resume"), timeout=5, what="a resume at A")
        assert resume["epoch"] == 2
