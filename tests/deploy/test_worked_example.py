"""README's "A worked example: three hosts", run as written on three hosts made of network
namespaces (198.18.0.0/15, MTU 1,500): a prompt computed on one agent is loaded by the other
over MOQT through the relay chain, `kvsp lookup` and `kvsp get` over both transports work from
the third host, every server refuses to run open, and a token without the role an action needs
is refused at every server."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvsp_moq.netns import Host, Network, unavailable

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### A worked example: three hosts"
HOSTS = {"A": "198.18.0.1", "B": "198.18.0.2", "C": "198.18.0.3"}
#: the longest a server may take to answer after it is started (a model loads first)
START_S = 90
#: the README's lookup from host C, again
LOOKUP = ("kvsp lookup --index http://198.18.0.1:8700/ --descriptor tiny.json --scope-keys keys.toml "
          "--tokens prompt.json --token-file agent-c.token")


@dataclass
class Step:
    host: str  # "A", "B", "C" or "any"
    commands: list[str]  # continuation lines joined; "&" kept


def readme_steps() -> list[Step]:
    """The section's shell blocks, in order, each with the host its first line names."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start)
    section = text[start:end if end >= 0 else None]
    steps = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
        head = re.fullmatch(r"# (host ([ABC])|any host)", lines[0])
        assert head, f"a block of the worked example must start with '# host X': {lines[0]!r}"
        steps.append(Step(head.group(2) or "any", [" ".join(line.split()) for line in lines[1:]
                                                   if line and not line.startswith("#")]))
    return steps


def env() -> dict[str, str]:
    """The commands' environment: `kvsp` of this checkout first on the PATH."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}


def option(command: str, name: str) -> str | None:
    words = shlex.split(command)
    return words[words.index(name) + 1] if name in words else None


class Deployment:
    """The three hosts, the README's servers on them, and the logs of each."""

    def __init__(self, net: Network, workdir: Path) -> None:
        self.net = net
        self.workdir = workdir
        self.hosts = {name: net.add_host(name) for name in HOSTS}
        for name, host in self.hosts.items():
            assert host.address == HOSTS[name]
        self.servers: list[tuple[str, subprocess.Popen[Any], Path]] = []

    def host(self, name: str) -> Host:
        return self.hosts["A" if name == "any" else name]

    def script(self, host: str, commands: list[str]) -> str:
        """Foreground commands run as one bash script (so variables carry), stopping at the
        first that fails; its output."""
        script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
        done = self.host(host).run(["bash", "-c", script], cwd=self.workdir, env=env(),
                                   capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (f"host {host}: {commands}\nstdout: {done.stdout}\n"
                                      f"stderr: {done.stderr}\nlogs:\n{self.logs()}")
        return done.stdout

    def serve(self, host: str, command: str) -> None:
        """A server command ("... &"), started and waited for until it answers."""
        command = command.removesuffix("&").strip()
        name = f"{host}-{len(self.servers)}-{shlex.split(command)[1]}"
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = self.host(host).start(["bash", "-c", "exec " + command], cwd=self.workdir,
                                         env=env(), stdout=out, stderr=subprocess.STDOUT)
        self.servers.append((name, proc, log))
        if shlex.split(command)[0] == "redis-server":
            listen = f"{HOSTS[host]}:6379"  # from its configuration file
        else:
            listen = option(command, "--listen")
        assert listen is not None, command
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text()}"
            if self._ready(host, command, listen, log):
                return
            time.sleep(0.3)
        raise AssertionError(f"{name} did not come up in {START_S} s:\n{log.read_text()}")

    def _ready(self, host: str, command: str, listen: str, log: Path) -> bool:
        if shlex.split(command)[1] == "relay":  # QUIC only: it says so when it listens
            return "relay listening on" in log.read_text(errors="replace")
        if shlex.split(command)[0] == "redis-server":
            return "Ready to accept connections" in log.read_text(errors="replace")
        probe = f"import httpx; httpx.get('http://{listen}/healthz', timeout=2).raise_for_status()"
        done = self.host(host).run([sys.executable, "-c", probe], capture_output=True, timeout=10)
        return done.returncode == 0

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{log.read_text(errors='replace')[-3000:]}"
                         for name, _, log in self.servers)

    def run_readme(self) -> str:
        out = []
        for step in readme_steps():
            pending: list[str] = []
            for command in step.commands:
                if command.endswith("&"):
                    if pending:
                        out.append(self.script(step.host, pending))
                        pending = []
                    self.serve(step.host, command)
                else:
                    pending.append(command)
            if pending:
                out.append(self.script(step.host, pending))
        return "".join(out)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    assert unavailable() is None, unavailable()  # needs root: a failure, not a skip
    workdir = tmp_path_factory.mktemp("worked-example")
    with Network(prefix="kvspdoc", mtu=1500) as net:
        yield Deployment(net, workdir)


def headers(d: Deployment, who: str) -> dict[str, str]:
    return {"Authorization": "Bearer " + (d.workdir / f"{who}.token").read_text().strip()}


def http(d: Deployment, host: str, method: str, url: str, who: str, body: Any = None) -> int:
    """The status of one request made from `host` with `who`'s token."""
    code = ("import httpx, json, sys; r = httpx.request(sys.argv[1], sys.argv[2], "
            "headers=json.loads(sys.argv[3]), content=sys.argv[4].encode() or None, timeout=10); "
            "print(r.status_code)")
    done = d.host(host).run([sys.executable, "-c", code, method, url, json.dumps(headers(d, who)),
                             "" if body is None else json.dumps(body)],
                            capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_the_worked_example_runs_as_written(deployment: Deployment) -> None:
    d = deployment
    out = d.run_readme()
    answer_b = json.loads((d.workdir / "answer-b.json").read_text())
    answer_c = json.loads((d.workdir / "answer-c.json").read_text())
    blocks = (200 - 1) // 16
    assert answer_b["sources"]["recompute"] >= blocks
    # C loaded what B computed, over MOQT, through its relay and B's
    assert answer_c["cached_tokens"] == blocks * 16, (answer_c, d.logs())
    assert answer_c["sources"]["moqt"] == blocks, (answer_c, d.logs())
    assert answer_c["load_choice"]["chose"] == "load"
    assert answer_c["tokens"] == answer_b["tokens"]
    assert json.dumps(answer_c["sources"], separators=(",", ":")) in out  # jq -c printed it
    lookup = json.loads((d.workdir / "lookup.json").read_text())
    assert lookup["matched"] == blocks
    wanted = {"http://198.18.0.1:8801/", "http://198.18.0.2:8900/", "http://198.18.0.3:8900/",
              "moqt://198.18.0.2:4443"}
    for _ in range(20):  # (A's holder publishes its replicas once B's copies have reached it)
        holders = {r["holder"] for b in lookup["blocks"] for r in b["replicas"]}
        if wanted <= holders:
            break
        time.sleep(0.5)
        lookup = json.loads(d.script("C", [LOOKUP]))
    assert wanted <= holders, holders
    http_copy, moqt_copy = (d.workdir / "block-http.kvb"), (d.workdir / "block-moqt.kvb")
    assert http_copy.stat().st_size > 0 and http_copy.read_bytes() == moqt_copy.read_bytes()
    # Two PCs on one Redis act as one: B's agent reports to A's PC, C's agent to B's, and
    # each PC lists both.
    agents = {"http://198.18.0.2:8900/", "http://198.18.0.3:8900/"}
    for pc in ("http://198.18.0.1:8700/", "http://198.18.0.2:8700/"):
        listed = instances(d, pc)
        assert agents <= listed, (pc, listed)


def instances(d: Deployment, pc: str) -> set[str]:
    """The active instances `GET {pc}instances` lists, asked from host C with the PC's token."""
    code = ("import httpx, sys; r = httpx.get(sys.argv[1] + 'instances', headers={'Authorization': "
            "'Bearer ' + sys.argv[2]}, timeout=10); r.raise_for_status(); "
            "print(' '.join(i['instance'] for i in r.json()['instances'] if i['state'] == 'active'))")
    done = d.host("C").run([sys.executable, "-c", code, pc, (d.workdir / "pc.token").read_text().strip()],
                           capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def readme_servers() -> list[tuple[str, str]]:
    return [(s.host, c.removesuffix("&").strip()) for s in readme_steps() for c in s.commands
            if c.endswith("&") and c.startswith("kvsp ")]


def test_every_server_refuses_to_run_open(deployment: Deployment) -> None:
    d = deployment
    servers = readme_servers()
    assert {shlex.split(c)[1] for _, c in servers} == {"index", "holder", "relay", "agent"}
    for host, command in servers:
        words = shlex.split(command)
        at = words.index("--principals")
        del words[at:at + 2]
        listen = words[words.index("--listen") + 1]
        words[words.index("--listen") + 1] = listen.rsplit(":", 1)[0] + ":1"  # never bound
        done = d.host(host).run(["bash", "-c", shlex.join(words)], cwd=d.workdir, env=env(),
                                capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (words, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "refusing to run open" in lines[0], (words, done.stderr)


def test_a_token_without_the_role_is_refused_at_every_server(deployment: Deployment) -> None:
    d = deployment
    if not (d.workdir / "answer-c.json").exists():
        d.run_readme()
    lookup = json.loads((d.workdir / "lookup.json").read_text())
    record = lookup["blocks"][0]["replicas"][0]["record"]
    compat, scope, key = record["compat_id"], record["scope_id"], record["block_key"]
    index, holder = "http://198.18.0.1:8700/", "http://198.18.0.1:8801/"
    agent = "http://198.18.0.3:8900/"
    forged = dict(record, holder="http://198.18.0.3:9999/")
    replica = "0" * 32
    container = (d.workdir / "block-http.kvb").read_bytes()
    instance = "http://198.18.0.3:8900/"
    refusals = [
        ("PUT", f"{index}replicas/{compat}/{scope}/{key}/{replica}", forged),  # publish a record
        ("PUT", f"{index}instances/x/status",
         {"instance": instance, "epoch": 1, "state": "active", "ttl_ms": 3000}),  # report status
        ("POST", f"{agent}prefetch", {"directive": "x"}),  # direct an agent
        ("PUT", f"{agent}state", {"state": "draining"}),
    ]
    for method, url, body in refusals:
        status = http(d, "C", method, url, "client", body)
        assert status == 403, (method, url, status)
    # storing a block at the holder (a body of octets)
    code = ("import httpx, sys; r = httpx.put(sys.argv[1], content=open(sys.argv[2], 'rb').read(), "
            "headers={'Authorization': 'Bearer ' + sys.argv[3]}, timeout=10); print(r.status_code)")
    done = d.host("C").run([sys.executable, "-c", code, f"{holder}blocks/{compat}/{scope}/{'1' * 64}",
                            str(d.workdir / "block-http.kvb"),
                            (d.workdir / "client.token").read_text().strip()],
                           capture_output=True, text=True, timeout=30)
    assert done.stdout.strip() == "403", done.stderr
    assert container  # (the holder still has only what it had: the key above was never stored)
    assert http(d, "C", "GET", f"{holder}blocks/{compat}/{scope}/{'1' * 64}", "agent-c") == 404
    # fetching at a relay: the client's token may not
    done = d.host("C").run(
        ["bash", "-c", "kvsp get moqt://198.18.0.3:4443 --record /dev/stdin --relay-ca "
                       "relay-c/relay-cert.pem --token-file client.token -o /dev/null"],
        input=json.dumps(next(r["record"] for b in lookup["blocks"] for r in b["replicas"]
                              if r["holder"].startswith("moqt://"))),
        cwd=d.workdir, env=env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "nauthorized" in done.stderr.lower(), done.stderr
    # and nothing changed: the index lists what it listed
    again = d.script("C", [LOOKUP])
    assert json.loads(again)["matched"] == lookup["matched"]
    assert "198.18.0.3:9999" not in again
