"""`kvsp bench route`: Placement Controller route decisions per second.

64 active instances, 2,048-key prompts, an in-memory Index Service lookup filled with replicas
(several per block, some at the instances themselves, with device/host residency). Prefetch
directives are built but handed to a no-op sender: no HTTP is measured.

Two baselines, measured in the same run on the same inputs:

- the reference router (`Router(reference=True)` over an index that builds its answer on every
  lookup, as `MemoryIndex` did): the per-candidate ranking that the array ranking replaced. A
  fresh pair of routers routes the same requests one after the other, and every decision is
  compared: instance, reason, every candidate's estimate, the directive's blocks
  (`same_choices_as_reference`);
- the ranking of the same candidates by calling the §6.4 estimate on every block's replica one
  by one, without grouping blocks that cost alike (`same_choice_as_baseline`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from kvsp_moq.bench.route_world import (
    BLOCK_TOKENS,
    INSTANCES,
    KEYS,
    _registry,
    _world,
)
from kvsp_moq.index_client import LookupResult
from kvsp_moq.protocol.cost import estimate, fetch_us, mean_service_us
from kvsp_moq.protocol.records import InstanceStatus, LookupRequest, PrefetchDirective


def _baseline_rank(result: LookupResult, statuses: list[InstanceStatus], token_count: int
                   ) -> list[tuple[float, str]]:
    """Every block, every candidate, every replica: the §6.4 estimate without grouping."""
    from pc.placement import holds

    matched_tokens = min(result.matched * BLOCK_TOKENS, token_count)
    out = []
    for status in statuses:
        plan = []
        for block in result.blocks[:result.matched]:
            if any(holds(status.instance, r) for r in block.replicas):
                continue
            plan.append(min(block.replicas, key=lambda r: fetch_us(status, (r,))))
        est = estimate(status, matched_tokens=matched_tokens, total_tokens=token_count, plan=plan,
                       service_us=mean_service_us(status))
        out.append((est.cost_us, status.instance))
    out.sort()
    return out


def run(quick: bool = False, pcs: int | None = None) -> dict[str, Any]:
    """One process's routes (and with `pcs`, those of 1..pcs processes over Redis,
    `kvsp_moq.bench.route_pcs`)."""
    result = asyncio.run(_run(quick))
    if pcs is not None:
        from kvsp_moq.bench.route_pcs import run_pcs

        result["shared_store"] = run_pcs(pcs, quick=quick)
    return result


async def _run(quick: bool) -> dict[str, Any]:
    from pc.placement import PlacementSettings, Router, RouteRequest, ScopeKeys

    w = _world()
    lookup_s = 0.0

    async def timed_lookup(req: LookupRequest) -> LookupResult:
        nonlocal lookup_s
        t = time.perf_counter()
        result = await w["index"].lookup(req)
        lookup_s += time.perf_counter() - t
        return result

    sent: list[PrefetchDirective] = []

    async def no_op_sender(instance: str, directive: PrefetchDirective) -> None:
        sent.append(directive)

    keys = ScopeKeys({"bench": w["scope_key"]})
    router = Router(w["registry"], timed_lookup, no_op_sender,
                    PlacementSettings(block_tokens=BLOCK_TOKENS), keys=keys)
    request = RouteRequest(w["sid"], w["compat"], tuple(w["keys"]), KEYS * BLOCK_TOKENS,
                           BLOCK_TOKENS)
    rounds = 3 if quick else 5
    n = 20 if quick else 100

    # Route decisions with the Block Keys given.
    rates, shares = [], []
    decision = await router.route(request)  # warm-up
    for _ in range(rounds):
        lookup_s = 0.0
        t = time.perf_counter()
        for _ in range(n):
            decision = await router.route(request)
        elapsed = time.perf_counter() - t
        rates.append(n / elapsed)
        shares.append(lookup_s / elapsed)

    # Route decisions from prompt tokens (Block Keys derived by the PC).
    body = {"tokens": w["tokens"], "scope": "bench", "compat_id": w["compat"]}
    m = max(5, n // 5)
    token_rates = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(m):
            await router.route(router.parse(body))
        token_rates.append(m / (time.perf_counter() - t))

    # The reference router on the same inputs: a fresh pair of routers, the same requests in
    # turn, every decision compared (each route counts in its instance's queue, so the later
    # decisions also check that both saw the same state).
    checked = 8 if quick else 24
    same_choices = await _same_choices(w, checked)
    reference = Router(_registry(w["seed"]), w["reference_index"].lookup, no_op_sender,
                       PlacementSettings(block_tokens=BLOCK_TOKENS), keys=keys, reference=True)
    await reference.route(request)  # warm-up
    ref_n = 5 if quick else 20
    ref_rates = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(ref_n):
            await reference.route(request)
        ref_rates.append(ref_n / (time.perf_counter() - t))

    # Baseline: the same ranking without grouping. Every route counts in its instance's queue
    # until that instance reports, so the decision compared is taken on the same registry state.
    result = await w["index"].lookup(LookupRequest(w["sid"], w["compat"], tuple(w["keys"])))
    statuses = w["registry"].active()
    decision = await router.route(request)
    base_n = 1 if quick else 3
    t = time.perf_counter()
    for _ in range(base_n):
        base = _baseline_rank(result, statuses, KEYS * BLOCK_TOKENS)
    base_rate = base_n / (time.perf_counter() - t)
    ours = [(c.cost_us, c.instance) for c in decision.candidates]
    agree = ours[0][1] == base[0][1] and all(
        abs(a[0] - b[0]) <= 1e-6 * max(1.0, abs(b[0])) for a, b in zip(sorted(ours), base))

    rate = statistics.median(rates)
    ref_rate = statistics.median(ref_rates)
    return {
        "instances": INSTANCES,
        "keys_per_prompt": KEYS,
        "block_tokens": BLOCK_TOKENS,
        "matched": decision.matched,
        "replicas_per_block": 3,
        "routes_per_s": round(rate, 1),
        "route_ms": round(1000 / rate, 3),
        "lookup_share": round(statistics.median(shares), 3),
        "routes_per_s_from_tokens": round(statistics.median(token_rates), 1),
        "reference_routes_per_s": round(ref_rate, 1),
        "ratio_to_reference": round(rate / ref_rate, 1),
        "same_choices_as_reference": same_choices,
        "checked_routes": checked,
        "baseline_ungrouped_routes_per_s": round(base_rate, 2),
        "ratio": round(rate / base_rate, 1),
        "same_choice_as_baseline": agree,
        "chosen": decision.instance,
        "prefetch": "built, sent to a no-op sender (no HTTP measured)",
        "directive_blocks": len(sent[-1].blocks) if sent else 0,
        "quick": quick,
    }


async def _same_choices(w: dict[str, Any], n: int) -> bool:
    """Whether a router and the reference router, each with a fresh copy of the registry,
    decide the same for the same `n` requests in turn."""
    from pc.placement import PlacementSettings, RouteDecision, Router, RouteRequest

    def recorder(into: list[PrefetchDirective]) -> Any:
        async def send(instance: str, directive: PrefetchDirective) -> None:
            into.append(directive)
        return send

    sent: tuple[list[PrefetchDirective], list[PrefetchDirective]] = ([], [])
    settings = PlacementSettings(block_tokens=BLOCK_TOKENS)
    routers = (Router(_registry(w["seed"]), w["index"].lookup, recorder(sent[0]), settings),
               Router(_registry(w["seed"]), w["reference_index"].lookup, recorder(sent[1]),
                      settings, reference=True))

    def seen(d: RouteDecision, directives: list[PrefetchDirective]) -> tuple:
        blocks = directives[-1].blocks if d.directive is not None else ()
        return (d.instance, d.reason, d.prefetch, d.matched, blocks,
                [(c.instance, c.resident_blocks, c.estimate) for c in d.candidates])

    for i in range(n):
        # Every other request a shorter prompt: other groups, other counts.
        keys = tuple(w["keys"][:KEYS - (i % 2) * (KEYS // 3 + i)])
        request = RouteRequest(w["sid"], w["compat"], keys, len(keys) * BLOCK_TOKENS + i,
                               BLOCK_TOKENS, request_ref=f"check-{i}")
        fast = seen(await routers[0].route(request), sent[0])
        ref = seen(await routers[1].route(request), sent[1])
        if fast != ref:
            return False
    return True
