"""An aiomoqt client that FETCHes one whole group of a track, driven by the interop tests.

    python aiomoqt_fetch.py URL NAMESPACE TRACK GROUP OUT [--draft N] [--timeout S]

NAMESPACE is its fields joined by "/", each field hex ("6b767370/ab12..."). Connects at
the one draft given (default 18), sends a standalone FETCH of group GROUP (Object 0 of the
end meaning the whole group; from draft-20 aiomoqt sends it as a LOCATION_FILTER), waits
for the fetch stream to end, and writes OUT: a JSON list of [group, object, size,
sha256 hex] per object received, then prints DONE. Runs in aiomoqt's virtual environment.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json

from aiomoqt.client import MOQTClient
from aiomoqt.utils.url import parse_relay_url


async def main(a: argparse.Namespace) -> None:
    relay = parse_relay_url(a.url)
    client = MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=True, verify_tls=False,
                        supported_drafts=a.draft)
    namespace = tuple(bytes.fromhex(part) for part in a.namespace.split("/"))
    received: list = []

    def on_object(msg, *_):
        data = bytes(getattr(msg, "payload", b"") or b"")
        received.append([msg.group_id, msg.object_id, len(data), hashlib.sha256(data).hexdigest()])

    async with client.connect() as session:
        await session.client_session_init()
        session.on_fetch_object = on_object
        ok = await session.fetch(namespace=namespace, track_name=a.track.encode(), start_group=a.group,
                                 start_object=0, end_group=a.group, end_object=0, wait_response=True)
        await session.await_fetch_done(ok.request_id, timeout=a.timeout)
        with open(a.out, "w") as f:
            json.dump(received, f)
        print("DONE", flush=True)
        session.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("namespace")
    p.add_argument("track")
    p.add_argument("group", type=int)
    p.add_argument("out")
    p.add_argument("--draft", type=int, default=18)
    p.add_argument("--timeout", type=float, default=30.0)
    args = p.parse_args()
    asyncio.run(asyncio.wait_for(main(args), args.timeout + 10))
