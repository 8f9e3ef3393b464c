"""A fetch client of the fleet: one process in a host's namespace, loading prefixes as an
agent does (KVSP §6.5-§6.7), without a model.

It takes one JSON command per line on stdin and answers each with one JSON line on stdout, so
the harness drives many of them at once and starts their loads at the same instant:

    {"op": "seed", "holder": URL, "blocks": N, "block_bytes": B, "seed": S}
        makes N blocks of 32 layers (the same bytes for the same seed) and stores them at the
        holder with PUT; answers their keys and the SHA-256 of each one's layer payloads
    {"op": "lookup", "keys": [...], "timeout": S}
        asks the Index Service until each block has an HTTP and (with a relay) a MOQT replica
    {"op": "connect"}   opens the MOQT session to the relay (an agent keeps one open)
    {"op": "load", "keys": [...], "transport": "moqt" | "http" | "any", "start_at": T}
        at CLOCK_MONOTONIC time T (the harness's clock: one clock per machine), loads every
        block, under leases at its holder, each layer verified against its record, MOQT
        through the relay first where the transport allows and HTTP after; answers when it
        started and finished, which source delivered how many layers, what failed, and (with
        "digest": true) the SHA-256 of each block's payload as delivered
    {"op": "lease", "holder": URL, "keys": [...], "ttl_ms": N}
        takes a lease at the holder (§6.6) and answers its id
    {"op": "renew", "holder": URL, "lease": ID, "ttl_ms": N}
        renews it: answers the term granted, or the refusal ("ok": false)
    {"op": "quit"}

`python -m kvsp_moq.fleet.client CONFIG.json`; CONFIG names the index, the relay and its
certificate, the token file, the scope and compat IDs, and timeouts.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvsp_moq.errors import KvspError
from kvsp_moq.protocol.records import ReplicaRecord

log = logging.getLogger("kvsp.fleet.client")

#: Layers of each block the harness makes.
LAYERS = 32


def block_key(seed: str, index: int) -> str:
    return hashlib.sha256(f"kvsp fleet block {seed} {index}".encode()).hexdigest()


def block_bytes(seed: str, index: int, size: int) -> bytes:
    """A container of LAYERS layers whose payload is `size` octets (derived from the seed)."""
    from kvsp_moq.bench.moqt import block_bytes as generated

    return generated(f"fleet-{seed}-{index}", size)


def payload_digest(container: bytes) -> str:
    from kvsp_moq.protocol.container import Container

    c = Container(container)
    return hashlib.sha256(bytes(c.payload(0, c.last_layer))).hexdigest()


class Client:
    """The client's state between commands: its records, fetchers and sessions."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.token = Path(config["token_file"]).read_text().strip()
        self.compat: str = config["compat_id"]
        self.scope: str = config["scope_id"]
        self.relay: str | None = config.get("relay")
        self.http = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(config.get("timeout", 10.0)))
        self.records: dict[str, list[ReplicaRecord]] = {}
        self._fetchers: Any = None

    async def aclose(self) -> None:
        if self._fetchers is not None:
            moqt, http, _ = self._fetchers
            if moqt is not None:
                await moqt.aclose()
            await http.aclose()
        await self.http.aclose()

    def fetchers(self) -> tuple[Any, Any, dict[str, Any]]:
        """(MOQT fetcher or None, HTTP fetcher, sources by kind), made once."""
        if self._fetchers is None:
            from kvsp_moq.fetch.http import HttpFetcher
            from kvsp_moq.fetch.sources import HttpLayerSource, MoqtLayerSource

            http = HttpFetcher(token=self.token, timeout=self.config.get("timeout", 10.0))
            sources: dict[str, Any] = {"http": HttpLayerSource(http)}
            moqt = None
            if self.relay:
                from kvsp_moq.fetch.moqt import MoqtBlockFetcher
                from kvsp_moq.moqt.certs import client_tls

                tls = client_tls(self.relay, cafile=self.config["relay_ca"], insecure=False)
                moqt = MoqtBlockFetcher(token=self.token, tls=tls, timeout=self.config.get("timeout", 10.0),
                                        layer_timeout=self.config.get("layer_timeout", 30.0))
                sources["moqt"] = MoqtLayerSource(moqt, self.relay, down_s=self.config.get("relay_down_s", 5.0))
            self._fetchers = (moqt, http, sources)
        return self._fetchers

    # ------------------------------------------------------------------ commands

    async def seed(self, holder: str, blocks: int, block_bytes_: int, seed: str) -> dict[str, Any]:
        keys, digests = [], []
        headers = {"Authorization": f"Bearer {self.token}", "If-None-Match": "*"}
        for i in range(blocks):
            data = await asyncio.to_thread(block_bytes, seed, i, block_bytes_)
            key = block_key(seed, i)
            r = await self.http.put(f"{holder.rstrip('/')}/blocks/{self.compat}/{self.scope}/{key}",
                                    content=data, headers=headers, timeout=60)
            if r.status_code >= 300:
                raise KvspError(f"storing block {i} at {holder}: HTTP {r.status_code} {r.text[:200]}")
            keys.append(key)
            digests.append(payload_digest(data))
        return {"keys": keys, "digests": digests, "container_bytes": len(data) if blocks else 0}

    async def lookup(self, keys: list[str], timeout: float) -> dict[str, Any]:
        from kvsp_moq.index_client import IndexClient

        deadline = time.monotonic() + timeout
        want_moqt = bool(self.relay)
        async with IndexClient(self.config["index"], token=self.token, client=self.http) as index:
            while True:
                result = await index.lookup(self.scope, self.compat, keys)
                found = {b.block_key: list(b.replicas) for b in result.blocks}
                complete = all(any(not r.is_moqt for r in found.get(k, []))
                               and (not want_moqt or any(r.is_moqt for r in found.get(k, [])))
                               for k in keys)
                if complete or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        self.records.update(found)
        counts = {"http": sum(1 for k in keys for r in found.get(k, []) if not r.is_moqt),
                  "moqt": sum(1 for k in keys for r in found.get(k, []) if r.is_moqt)}
        if not complete:
            raise KvspError(f"the index lists {counts} replicas of {len(keys)} blocks after {timeout} s")
        return counts

    async def connect(self) -> dict[str, Any]:
        moqt, _, _ = self.fetchers()
        if moqt is None or self.relay is None:
            return {"relay": None}
        started = time.perf_counter()
        await moqt.connection(self.relay)
        return {"relay": self.relay, "seconds": round(time.perf_counter() - started, 4)}

    async def load(self, keys: list[str], transport: str, start_at: float | None,
                   digest: bool = False, lease_ms: int = 30_000) -> dict[str, Any]:
        from kvsp_moq.fetch.fallback import BlockCandidates, lease_first_candidates
        from kvsp_moq.fetch.leases import LeaseClient, LeaseKeeper
        from kvsp_moq.fetch.sources import order_candidates

        _, _, by_kind = self.fetchers()
        kinds = {"moqt": ["moqt"], "http": ["http"], "any": ["moqt", "http"]}[transport]
        sources = [by_kind[k] for k in kinds if k in by_kind]
        missing = [k for k in keys if k not in self.records]
        if missing:
            raise KvspError(f"{len(missing)} blocks were not looked up")
        keeper = LeaseKeeper(LeaseClient(self.http, token=self.token), lease_ms)
        blocks = [BlockCandidates(k, order_candidates(self.records[k], sources), keeper=keeper) for k in keys]
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        started = time.monotonic()
        layers: dict[str, int] = {}
        octets = 0
        digests: dict[str, str] = {}
        failures: list[str] = []
        errors: list[str] = []

        async def one(block: BlockCandidates) -> None:
            nonlocal octets
            h = hashlib.sha256() if digest else None
            last = (block.candidates[0].record.layer_count or LAYERS) - 1 if block.candidates else LAYERS - 1
            try:
                async with block.layers(0, last) as stream:
                    async for layer in stream:
                        kind = layer.candidate.source.kind
                        layers[kind] = layers.get(kind, 0) + 1
                        octets += len(layer.k) + len(layer.v)
                        if h is not None:
                            h.update(layer.k)
                            h.update(layer.v)
            except KvspError as e:
                errors.append(f"{block.block_key[:12]}: {e.detail}")
            finally:
                failures.extend(f"{block.block_key[:12]} {cand.source.kind}: {why}" for cand, why in block.failures)
            if h is not None and not block.exhausted:
                digests[block.block_key] = h.hexdigest()

        try:
            await lease_first_candidates(blocks, keeper)
            await asyncio.gather(*(one(b) for b in blocks))
        finally:
            await keeper.release()
        finished = time.monotonic()
        out: dict[str, Any] = {"started": started, "finished": finished, "seconds": round(finished - started, 4),
                               "octets": octets, "layers": layers, "failures": failures, "errors": errors}
        if digest:
            out["digests"] = digests
        return out


    async def lease(self, holder: str, keys: list[str], ttl_ms: int) -> dict[str, Any]:
        from kvsp_moq.fetch.leases import LeaseClient

        return {"lease": await LeaseClient(self.http, token=self.token).acquire(holder, keys, ttl_ms)}

    async def renew(self, holder: str, lease: str, ttl_ms: int) -> dict[str, Any]:
        from kvsp_moq.fetch.leases import LeaseClient

        return {"ttl_ms": await LeaseClient(self.http, token=self.token).renew(holder, lease, ttl_ms)}


async def serve(config: dict[str, Any]) -> None:
    client = Client(config)
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            op = command.pop("op")
            if op == "quit":
                return
            try:
                if op == "seed":
                    answer = await client.seed(command["holder"], command["blocks"], command["block_bytes"],
                                               command["seed"])
                elif op == "lookup":
                    answer = await client.lookup(command["keys"], command.get("timeout", 30.0))
                elif op == "connect":
                    answer = await client.connect()
                elif op == "load":
                    answer = await client.load(command["keys"], command.get("transport", "any"),
                                               command.get("start_at"), command.get("digest", False))
                elif op == "lease":
                    answer = await client.lease(command["holder"], command["keys"], command["ttl_ms"])
                elif op == "renew":
                    answer = await client.renew(command["holder"], command["lease"], command["ttl_ms"])
                else:
                    raise KvspError(f"unknown command {op!r}")
                answer = {"ok": True, **answer}
            except KvspError as e:
                answer = {"ok": False, "error": e.detail}
            except Exception as e:  # reported to the harness, which shows it with the log
                log.exception("command %s failed", op)
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps(answer), flush=True)
    finally:
        await client.aclose()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvsp_moq.fleet.client")
    p.add_argument("config", help="JSON file: index, relay, relay_ca, token_file, compat_id, scope_id")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvsp_moq.allocator import tune_allocator
    from kvsp_moq.moqt.quic import new_event_loop

    tune_allocator()
    config = json.loads(Path(args.config).read_text())
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
