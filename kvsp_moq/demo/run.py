"""The `kvsp demo` scenario: a shared system prompt computed once and reused, a session that
survives the loss of its instance, a reshard, and a tenant that sees nothing of another's.

Every figure printed is measured in the run; the report folder keeps them as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx

from kvsp_moq.bench import figures
from kvsp_moq.demo.cluster import Cluster
from kvsp_moq.frontend import decode_at

SYSTEM_TOKENS = 512
SUFFIX_TOKENS = 40
NEW_TOKENS = 8


class Progress:
    """A one-line progress display on a terminal; plain lines otherwise."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()

    def step(self, text: str, done: int | None = None, total: int | None = None) -> None:
        if self.quiet:
            return
        if done is not None and total:
            width = 24
            filled = int(width * done / total)
            text = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
        elif done is None or not total or done == total or done % max(1, total // 4) == 0:
            sys.stderr.write(text + "\n")

    def end(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r\033[K")


def _tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


class Demo:
    def __init__(self, root: Path, *, as_json: bool, progress: Progress) -> None:
        self.root = root
        self.as_json = as_json
        self.progress = progress
        self.cluster = Cluster(root)
        self.report: dict[str, Any] = {"report_dir": str(root)}
        self.http = httpx.Client(timeout=120.0)

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        from agent.model import ModelAdapter
        from agent.tiny import ensure_tiny_model

        self.progress.step("making the tiny model (once)")
        model_dir = ensure_tiny_model(self.root / "models" / "tiny")
        adapter = ModelAdapter.load(model_dir)
        self.descriptor = adapter.descriptor(self.cluster.block_tokens)
        from kvsp_moq.protocol.compat import CompatDescriptor

        self.compat = CompatDescriptor.from_dict(self.descriptor).compat_hex
        adapter.close()
        self.cluster.model_dir = model_dir
        self.cluster.configure()
        names = ["index", "relay", "holder", "agent1", "agent2"]
        for i, name in enumerate(names):
            self.progress.step(f"starting {name}", i, len(names))
            self.cluster.start_one(name)
            self.cluster.wait_healthy(name)
        self.progress.step("waiting for both agents to report to the PC", len(names), len(names))
        self._wait(lambda: self._active_instances() >= 2, 60, "agents reporting to the PC")
        self.progress.end()
        self.report["services"] = {n: s.url for n, s in self.cluster.services.items()}

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}")

    def _auth(self, who: str) -> dict[str, str]:
        tenants = {t.name: t.token for t in self.cluster.tenants}
        token = tenants.get(who) or self.cluster.tokens[who]
        return {"Authorization": f"Bearer {token}"}

    def _active_instances(self) -> int:
        r = self.http.get(self.cluster.urls["index"] + "instances", headers=self._auth("admin"))
        if r.status_code != 200:
            return 0
        data = r.json()
        items = data.get("instances", data) if isinstance(data, dict) else data
        return sum(1 for i in items if i.get("state") == "active")

    # ------------------------------------------------------------------ workload

    def route(self, tenant: str, tokens: list[int], exclude: list[str] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"tokens": tokens, "scope": tenant, "compat_id": self.compat}
        if exclude:
            body["exclude"] = exclude
        r = self.http.post(self.cluster.urls["index"] + "route", headers=self._auth("admin"),
                           json=body)
        r.raise_for_status()
        return r.json()

    def _name(self, url: str) -> str:
        return next((n for n, s in self.cluster.services.items() if s.url == url), url)

    def generate(self, instance: str, tenant: str, tokens: list[int], **extra: Any) -> dict[str, Any]:
        body = {"tokens": tokens, "max_new_tokens": NEW_TOKENS, "scope": tenant,
                "sampler": {"method": "greedy"}, **extra}
        # As the tenant's front end does: generating takes the client role.
        r = self.http.post(instance + "generate", headers=self._auth(tenant), json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"generate at {instance}: {r.status_code} {r.text[:300]}")
        return r.json()

    def shared_prompt(self) -> list[dict[str, Any]]:
        system = _tokens(SYSTEM_TOKENS, 1)
        rows = []
        plan = [("cold: nobody has the prompt", None),
                ("same system prompt, new question", None),
                ("another instance: the first excluded, as if busy", "other"),
                ("same system prompt, new question", None)]
        cold_ttft = None
        first_instance: str | None = None
        for i, (label, force) in enumerate(plan):
            self.progress.step(f"request {i + 1}: {label}", i, len(plan))
            prompt = system + _tokens(SUFFIX_TOKENS, 100 + i)
            exclude: list[str] = [first_instance] if force == "other" and first_instance else []
            decision = self.route("tenant-a", prompt, exclude=exclude)
            instance = decision["instance"]
            why = decision.get("reason", "")
            if exclude:
                why += f", {self._name(exclude[0])} excluded"
            first_instance = first_instance or instance
            out = self.generate(instance, "tenant-a", prompt, timeline=True)
            choice = out.get("load_choice") or {}
            if choice.get("chose") == "recompute":  # the instance's own §6.4 choice
                why += f"; {self._name(instance)} recomputed: {choice.get('reason')}"
            cold_ttft = cold_ttft or out["ttft_ms"]
            est: dict[str, Any] = next(
                (e for e in decision.get("estimates", []) if e["instance"] == instance), {})
            rows.append({
                "request": i + 1, "label": label, "instance": instance, "why": why,
                "cost_us": est.get("cost_us"), "fetch_us": est.get("fetch_us"),
                "recompute_us": est.get("recompute_all_us"),
                "matched_blocks": decision.get("matched"),
                "cached_tokens": out.get("cached_tokens"), "sources": out.get("sources"),
                "ttft_ms": out["ttft_ms"], "ratio_to_cold": round(out["ttft_ms"] / cold_ttft, 3),
                "timeline": out.get("timeline"), "load_choice": out.get("load_choice"),
            })
        self.progress.end()
        return rows

    def prefill_apart(self) -> dict[str, Any]:
        """Prefill and decode apart (live KV): agent1 computes a new prompt and publishes each
        layer as it is computed; agent2 subscribes at once, decodes, and is compared with one
        instance doing a prompt of the same length alone."""
        a = self.cluster.services["agent1"].url
        b = self.cluster.services["agent2"].url
        prompt = _tokens(SYSTEM_TOKENS, 7) + _tokens(SUFFIX_TOKENS, 7)
        self.progress.step("a single instance computes a new prompt of the same length", 0, 2)
        single = self.generate(b, "tenant-a", _tokens(SYSTEM_TOKENS, 8) + _tokens(SUFFIX_TOKENS, 8))
        self.progress.step("agent1 prefills a new prompt, agent2 decodes it as it streams", 1, 2)
        # As a front end does when the PC's route carries "prefill" (kvsp index --pd).
        r = self.http.post(a + "prefill", headers=self._auth("tenant-a"),
                           json={"tokens": prompt, "scope": "tenant-a"})
        if r.status_code != 202:
            raise RuntimeError(f"prefill at {a}: {r.status_code} {r.text[:300]}")
        streamed = self.generate(b, "tenant-a", prompt, **decode_at(a, r.json()))
        alone = self.generate(a, "tenant-a", prompt)
        self.progress.end()
        return {"prompt_tokens": len(prompt), "prefill": "agent1", "decode": "agent2",
                "live_blocks": len(r.json()["live"]), "sources": streamed["sources"],
                "ttft_ms": {"single": single["ttft_ms"], "streamed": streamed["ttft_ms"]},
                "streamed_vs_single": round(streamed["ttft_ms"] / single["ttft_ms"], 3),
                "equals_one_instance": streamed["tokens"] == alone["tokens"]}

    def failover(self) -> dict[str, Any]:
        """A session on agent1, agent1 killed mid-way; the front end gets every index once."""
        import asyncio

        from kvsp_moq.frontend import FrontEnd

        prompt = _tokens(SYSTEM_TOKENS, 1) + _tokens(SUFFIX_TOKENS, 999)
        session = str(uuid.uuid4())
        victim = self.cluster.services["agent1"]
        n = 160
        body = {"tokens": prompt, "max_new_tokens": n, "scope": "tenant-a",
                "sampler": {"method": "greedy"}, "session": session, "stream": True}
        received: list[tuple[int, int, int]] = []

        async def run() -> None:
            async with httpx.AsyncClient(timeout=120.0) as client:
                start = client.build_request("POST", victim.url + "generate", json=body,
                                             headers=self._auth("tenant-a"))
                resp = await client.send(start, stream=True)
                await resp.aclose()  # the front end reads the session's stream from here on
            fe = FrontEnd(self.cluster.urls["index"], token=self.cluster.tokens["admin"])
            killed = False
            async for tok in fe.stream(session, instance=victim.url):
                received.append((tok.index, tok.epoch, tok.token))
                self.progress.step(f"session {session[:8]}: token {tok.index} epoch {tok.epoch}",
                                   len(received), n)
                if not killed and len(received) >= n // 4:
                    self.cluster.kill("agent1")
                    killed = True
                if len(received) >= n:
                    break

        asyncio.run(asyncio.wait_for(run(), 180))
        self.progress.end()
        indices = [i for i, _, _ in received]
        reference = self.generate(self.cluster.services["agent2"].url, "tenant-a", prompt,
                                  max_new_tokens=n)["tokens"]
        return {"session": session, "tokens": n, "killed": "agent1", "at_index": n // 4,
                "epochs": sorted({e for _, e, _ in received}),
                "every_index_once": indices == list(range(n)),
                "equals_uninterrupted_run": [t for _, _, t in received] == reference}

    def reshard(self) -> dict[str, Any]:
        """A long context held by one agent is split across both (KVSP §6.9), driven by the PC."""
        self.progress.step("restarting agent1 for the reshard")
        self.cluster.start_one("agent1")
        self.cluster.wait_healthy("agent1")
        self._wait(lambda: self._active_instances() >= 2, 60, "agent1 reporting again")
        a, b = self.cluster.services["agent2"].url, self.cluster.services["agent1"].url
        n = 1024
        context = _tokens(n, 4242)
        admin = self._auth("admin")
        scope = next(t.scope_id for t in self.cluster.tenants if t.name == "tenant-a")
        self.progress.step(f"computing a {n}-token context on agent2")
        for url, ranges in ((a, [[0, n]]), (b, [])):
            r = self.http.put(url + "shards/long", headers=admin,
                              json={"version": 1, "tokens": context, "ranges": ranges,
                                    "scope_id": scope})
            r.raise_for_status()
        pc = self.cluster.urls["index"]
        # The map carries its scope: only tenant-a's principals read its ranges.
        v1 = {"map": "long", "version": 1, "scope_id": scope,
              "shards": [{"tokens": [0, n], "instance": a}]}
        self.http.post(pc + "reshard/long", headers=admin, json=v1).raise_for_status()
        v2 = {"map": "long", "version": 2, "deadline_ms": 30000, "shards": [
            {"tokens": [0, n // 2], "instance": a}, {"tokens": [n // 2, n], "instance": b}]}
        self.progress.step("resharding: agent2 keeps [0, 512), agent1 takes [512, 1024)")
        r = self.http.post(pc + "reshard/long", headers=admin, json=v2, timeout=120)
        r.raise_for_status()
        outcome = r.json()
        kept = self.http.get(a + "reshard/long", headers=admin).json()
        took = self.http.get(b + "reshard/long", headers=admin).json()
        self.progress.end()
        moved = sum(f.get("bytes", 0) for f in took.get("last", {}).get("fetched", []))
        return {"map": "long", "tokens": n, "committed": outcome.get("committed"),
                "agent2_ranges": kept.get("ranges"), "agent1_ranges": took.get("ranges"),
                "bytes_moved_to_agent1": moved,
                "bytes_moved_for_retained_range": kept.get("last", {}).get("transferred_bytes")}

    def other_tenant(self) -> dict[str, Any]:
        prompt = _tokens(SYSTEM_TOKENS, 1) + _tokens(SUFFIX_TOKENS, 100)
        decision = self.route("tenant-b", prompt)
        out = self.generate(decision["instance"], "tenant-b", prompt)
        return {"matched_blocks": decision.get("matched"), "cached_tokens": out.get("cached_tokens"),
                "sources": out.get("sources")}

    # ------------------------------------------------------------------ output

    def print_table(self, rows: list[dict[str, Any]]) -> None:
        names = {s.url: n for n, s in self.cluster.services.items()}
        print(f"{'#':>2} {'instance':<8} {'matched':>7} {'cached':>6} {'moqt':>5} {'http':>5} "
              f"{'recomp':>6} {'TTFT ms':>8} {'vs cold':>7}  why")
        for r in rows:
            s = r.get("sources") or {}
            print(f"{r['request']:>2} {names.get(r['instance'], r['instance']):<8} "
                  f"{r['matched_blocks'] or 0:>7} {r['cached_tokens'] or 0:>6} "
                  f"{s.get('moqt', 0):>5} {s.get('http', 0):>5} {s.get('recompute', 0):>6} "
                  f"{r['ttft_ms']:>8.1f} {r['ratio_to_cold']:>7.2f}  {r['why']} ({r['label']})")

    def run(self) -> dict[str, Any]:
        self.start()
        rows = self.shared_prompt()
        self.report["shared_prompt"] = rows
        if not self.as_json:
            print(f"\nShared system prompt ({SYSTEM_TOKENS} tokens, "
                  f"{SYSTEM_TOKENS // self.cluster.block_tokens} blocks of "
                  f"{self.cluster.block_tokens}) with different questions:")
            self.print_table(rows)
        pd = self.prefill_apart()
        self.report["prefill_apart"] = pd
        if not self.as_json:
            print(f"\nPrefill and decode apart ({pd['prompt_tokens']} new tokens): agent1 computed "
                  f"{pd['live_blocks']} blocks and published each layer as it was computed, agent2 "
                  f"loaded {pd['sources'].get('moqt', 0)} of them live over MOQT and decoded; TTFT "
                  f"{pd['ttft_ms']['streamed']:.1f} ms vs {pd['ttft_ms']['single']:.1f} ms on one "
                  f"instance ({pd['streamed_vs_single']:.2f}x); output equals one instance: "
                  f"{pd['equals_one_instance']}")
        fo = self.failover()
        self.report["failover"] = fo
        if not self.as_json:
            print(f"\nFailover: agent1 killed (SIGKILL) at token {fo['at_index']} of {fo['tokens']}; "
                  f"epochs seen {fo['epochs']}; every index delivered once: {fo['every_index_once']}; "
                  f"output equals an uninterrupted run: {fo['equals_uninterrupted_run']}")
        rs = self.reshard()
        self.report["reshard"] = rs
        if not self.as_json:
            print(f"\nReshard of a {rs['tokens']}-token context: committed {rs['committed']}; "
                  f"agent2 keeps {rs['agent2_ranges']} (moved {rs['bytes_moved_for_retained_range']} "
                  f"octets), agent1 holds {rs['agent1_ranges']} ({rs['bytes_moved_to_agent1']} "
                  f"octets fetched from agent2)")
        other = self.other_tenant()
        self.report["other_tenant"] = other
        if not self.as_json:
            print(f"\nTenant B, same system prompt: matched {other['matched_blocks']} blocks, "
                  f"cached tokens {other['cached_tokens']} (scopes keep tenants apart)")
        self.write_report(rows)
        return self.report

    def write_report(self, rows: list[dict[str, Any]]) -> None:
        timeline = next((r["timeline"] for r in rows if r.get("timeline") and r["cached_tokens"]),
                        None)
        if timeline:
            spans = timeline.get("spans", timeline) if isinstance(timeline, dict) else timeline
            try:
                png = figures.write(self.root / "timeline.png", figures.timeline_figure, spans,
                                    "The demo: one request's layers loading and computing")
            except Exception as e:  # the report is still useful without the picture
                self.report["timeline_png_error"] = str(e)
            else:
                if png is None:
                    self.report["timeline_png_error"] = f"matplotlib is not installed: {figures.PLOTS_HINT}"
                else:
                    self.report["timeline_png"] = png
        path = self.root / "report.json"
        path.write_text(json.dumps(self.report, indent=2))
        if not self.as_json:
            print(f"\nReport: {path}")

    def close(self) -> None:
        self.http.close()
        self.cluster.stop()


def run_demo(*, as_json: bool = False, serve: bool = False, report_dir: str | None = None) -> int:
    root = Path(report_dir or tempfile.mkdtemp(prefix="kvsp-demo-"))
    demo = Demo(root, as_json=as_json, progress=Progress(quiet=False))
    try:
        if serve:
            demo.start()
            print(json.dumps({"services": demo.report["services"], "principals":
                              str(root / "principals.toml"), "tokens": demo.cluster.tokens}, indent=2))
            print("Serving; Ctrl-C stops everything.", file=sys.stderr)
            threading.Event().wait()
        report = demo.run()
        if as_json:
            print(json.dumps(report, indent=2))
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        demo.close()
