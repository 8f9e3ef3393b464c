"""An aiomoqt subscriber that records what it receives, driven by the interop tests.

    python aiomoqt_sub.py moqt://127.0.0.1:PORT NAMESPACE TRACK COUNT OUT.json [--draft N] [--each]

Subscribes to NAMESPACE ("/"-separated fields) / TRACK, prints SUBSCRIBED after SUBSCRIBE_OK,
and once COUNT objects have arrived (or PUBLISH_DONE and a short grace), writes them to
OUT.json as [[group, object, payload hex], ...] in arrival order and prints DONE. With --each
it also prints OBJECT GROUP OBJECT SIZE SHA256-HEX as each object arrives, so that a test can
hold back what it publishes next until the peer has what came before.
Runs with the aiomoqt virtual environment (interop/.venv-aiomoqt/bin/python).
"""

import asyncio
import hashlib
import json
import sys

from aiomoqt.client import MOQTClient
from aiomoqt.track import SubscribedTrack
from aiomoqt.types import FilterType, ObjectStatus
from aiomoqt.utils.url import parse_relay_url


async def main(url: str, namespace: str, track: str, count: int, out: str, draft: int = 18,
               each: bool = False) -> None:
    relay = parse_relay_url(url)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True, verify_tls=False,
                        supported_drafts=draft)
    received: list = []
    enough = asyncio.Event()

    def on_object(msg, size, recv_time, group_id=None, subgroup_id=None, *_):
        status = getattr(msg, "status", None)
        if status not in (None, ObjectStatus.NORMAL):
            return
        group = getattr(msg, "group_id", None)
        group = group_id if group is None else group
        data = bytes(msg.payload or b"")
        received.append([group, msg.object_id, data.hex()])
        if each:
            print("OBJECT", group, msg.object_id, len(data), hashlib.sha256(data).hexdigest(), flush=True)
        if len(received) >= count:
            enough.set()

    def on_done(msg):
        asyncio.get_running_loop().call_later(1.0, enough.set)

    async with client.connect() as session:
        await session.client_session_init()
        subscription = SubscribedTrack(session, namespace, track, on_object=on_object, on_done=on_done)
        subscription._quiet = True
        # Everything from the start: no filter, which draft-14 cannot say (Absolute Start {0, 0}).
        if draft == 14:
            await subscription.subscribe(forward=1, filter_type=FilterType.ABSOLUTE_START)
        else:
            await subscription.subscribe(forward=1, filter_type=None)
        print("SUBSCRIBED", flush=True)
        await asyncio.wait_for(enough.wait(), 30)
        with open(out, "w") as f:
            json.dump(received, f)
        print("DONE", flush=True)
        session.close()


if __name__ == "__main__":
    u, ns, tr, n, o = sys.argv[1:6]
    d = int(sys.argv[sys.argv.index("--draft") + 1]) if "--draft" in sys.argv else 18
    asyncio.run(asyncio.wait_for(main(u, ns, tr, int(n), o, d, "--each" in sys.argv), 60))
