"""An aiomoqt publisher of deterministic objects, driven by the interop tests.

    python aiomoqt_pub.py moqt://127.0.0.1:PORT NAMESPACE TRACK GROUPS OBJECTS SIZE SEED

Announces NAMESPACE ("/"-separated fields), answers one SUBSCRIBE for TRACK, and sends GROUPS
groups of OBJECTS objects, one subgroup stream per group, each payload SIZE octets of
SHAKE-256 over "SEED:group:object" (so the receiving side can recompute every byte), then
PUBLISH_DONE. Prints READY once the namespace is accepted and DONE after PUBLISH_DONE.
Runs with the aiomoqt virtual environment (interop/.venv-aiomoqt/bin/python).
"""

import asyncio
import hashlib
import sys

from aiomoqt.client import MOQTClient
from aiomoqt.context import profile_for
from aiomoqt.messages import SubgroupHeader
from aiomoqt.types import MOQTMessageType, RequestErrorCode, SubscribeDoneCode
from aiomoqt.utils.url import parse_relay_url


def payload(seed: str, group: int, obj: int, size: int) -> bytes:
    return hashlib.shake_256(f"{seed}:{group}:{obj}".encode()).digest(size)


class Publisher:
    def __init__(self, track: str) -> None:
        self.track = track.encode()
        self.request = None
        self.alias = None
        self.subscribed = asyncio.Event()

    async def on_subscribe(self, session, msg) -> None:
        name = msg.track_name if isinstance(msg.track_name, bytes) else str(msg.track_name).encode()
        if name != self.track or self.request is not None:
            session.subscribe_error(request_id=msg.request_id, error_code=RequestErrorCode.DOES_NOT_EXIST,
                                    reason="no such track")
            return
        ok = session.subscribe_ok(request_msg=msg)
        self.request, self.alias = msg, ok.track_alias
        self.subscribed.set()

    async def send(self, session, groups: int, objects: int, size: int, seed: str) -> None:
        prof = profile_for(session.negotiated_draft)
        for group in range(groups):
            stream_id = await session.open_uni_stream()
            header = SubgroupHeader(track_alias=self.alias, group_id=group, subgroup_id=0,
                                    publisher_priority=128, prof=prof)
            session.stream_write(stream_id, header.serialize().data)
            for obj in range(objects):
                buf = header.next_object(payload=payload(seed, group, obj, size), object_id=obj)
                await session.stream_write_drain(stream_id, buf.data)
            session.stream_write(stream_id, b"", end_stream=True)
        session.subscribe_done(request_id=self.request.request_id, status_code=SubscribeDoneCode.TRACK_ENDED,
                               stream_count=groups, reason="track ended")


async def main(url: str, namespace: str, track: str, groups: int, objects: int, size: int, seed: str) -> None:
    relay = parse_relay_url(url)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True, verify_tls=False,
                        supported_drafts=18)
    publisher = Publisher(track)
    client.register_handler(MOQTMessageType.SUBSCRIBE, publisher.on_subscribe)
    async with client.connect() as session:
        await session.client_session_init()
        await session.publish_namespace(namespace=namespace, parameters={}, wait_response=True)
        print("READY", flush=True)
        await asyncio.wait_for(publisher.subscribed.wait(), 30)
        await publisher.send(session, groups, objects, size, seed)
        print("DONE", flush=True)
        await asyncio.sleep(2.0)  # let the relay take the last objects before the session ends
        session.close()


if __name__ == "__main__":
    u, ns, tr, g, o, s, seed = sys.argv[1:8]
    asyncio.run(asyncio.wait_for(main(u, ns, tr, int(g), int(o), int(s), seed), 60))
