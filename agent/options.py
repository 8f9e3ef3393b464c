"""The engine's tunables (`agent.engine.Engine` and the parts it is made of read them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOptions:
    """The engine's tunables (the agent's settings pick them)."""

    block_tokens: int = 16
    lease_ms: int = 10_000
    load_concurrency: int = 8
    layers_per_request: int | None = None
    #: non-deterministic samplers: tokens per checkpoint before they are released
    release_batch: int = 4
    #: non-deterministic samplers: how far decoding may run ahead of acknowledgements
    max_unacked: int = 64
    #: pause between output tokens (pacing for demos and failover tests); 0: none
    token_interval_s: float = 0.0
    max_new_tokens: int = 4096
    #: holders each new block is also stored at, so that it outlives this instance
    replicate_to: tuple[str, ...] = ()
    #: how long a finished session stays readable by streams ...
    keep_finished_s: float = 300.0
    #: ... and how many at most: the oldest go first, so that memory does not follow the
    #: request rate (each holds its prompt, output and block keys)
    keep_finished: int = 1024
    publish_wait_s: float = 5.0
    #: compute while loading (DESIGN §5); False loads the whole prefix first (a baseline)
    pipelined: bool = True
    #: keep each session's first logits (for checks against a recompute): a tensor the size
    #: of the vocabulary per kept session, 0.5 MiB for a 128k vocabulary
    keep_first_logits: bool = False
    #: choose between loading a cached prefix and recomputing it by the §6.4 estimates with
    #: this instance's measured rates (`agent.choice`); False always loads what it can
    choose_by_cost: bool = True
    #: after this many recomputes in a row the link is measured again (in the background)
    probe_every: int = 8
    #: with a relay, publish the prompt blocks a prefill computes layer by layer while they are
    #: computed (DESIGN §9), with in-production records in the index
    live_kv: bool = True


__all__ = ["EngineOptions"]
