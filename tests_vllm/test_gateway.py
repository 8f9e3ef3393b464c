"""README's "Serving vLLM behind KVSP", run as written (on free ports): an index, a relay, a
holder, two vLLM engines with the KVSP connector and `kvsp gateway`, then the `openai` client
against the gateway: completions and chat, streamed and not, refusals (the gateway's and an
engine's), a shared prefix loaded from KVSP by whichever engine the PC routes to, and an engine
SIGKILLed mid-stream, its output continued on the other engine, every token once, greedy output
equal to an uninterrupted run. The engines are separate processes (vLLM's multiprocess mode),
each in a process group of its own, so that killing one kills its engine core too."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from kvsp_moq.gateway.text import ModelText
from kvsp_moq.protocol.keys import scope_id
from kvsp_moq.scope_keys import OPEN_SCOPE_KEY
from tests_vllm.conftest import BLOCK, block_keys, compat_of, eventually, free_port, prompt, records_of

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Serving vLLM behind KVSP"
MODEL = "llama-tiny"
#: how long a server may take to answer after it is started (a vLLM engine: ~30 s alone)
START_S = 240


def readme_commands() -> list[str]:
    """The section's shell commands, continuation lines joined, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else None]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def on_free_ports(commands: list[str]) -> list[str]:
    """The commands with each loopback port the README names replaced by a free one."""
    found = {p for c in commands for p in re.findall(r"127\.0\.0\.1:(\d+)", c)}
    ports = {p: str(free_port()) for p in sorted(found)}

    def swap(m: re.Match[str]) -> str:
        return m.group(1) + ports.get(m.group(2), m.group(2))

    return [re.sub(r"(127\.0\.0\.1:|--port )(\d+)", swap, c) for c in commands]


def env() -> dict[str, str]:
    """`kvsp` and `python` of this environment first on the PATH, this checkout imported, and
    vLLM in its default multiprocess mode."""
    out = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(ROOT),
               NO_COLOR="1")
    return out


def is_engine(command: str) -> bool:
    return "vllm.entrypoints" in command


class Fleet:
    """The README's servers, their logs, and what the foreground commands printed."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.servers: list[tuple[str, subprocess.Popen[bytes], Path, str]] = []
        self.printed = ""

    def run(self, commands: list[str]) -> None:
        pending: list[str] = []
        waiting: list[int] = []
        for command in commands:
            if not command.endswith("&"):
                self.wait(waiting)
                waiting = []
                pending.append(command)
                continue
            if pending:
                self.script(pending)
                pending = []
            command = command.removesuffix("&").strip()
            if not is_engine(command):  # engines start side by side; the rest in order
                self.wait(waiting)
                waiting = []
            waiting.append(self.start(command))
        self.wait(waiting)
        if pending:
            self.script(pending)

    def script(self, commands: list[str]) -> None:
        done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)],
                              cwd=self.workdir, env=env(), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, (f"{commands}\nstdout: {done.stdout}\nstderr: "
                                      f"{done.stderr}\nlogs:\n{self.logs()}")
        self.printed += done.stdout

    def start(self, command: str) -> int:
        words = shlex.split(command)
        name = f"{len(self.servers)}-{'vllm' if is_engine(command) else words[1]}"
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=self.workdir,
                                    env=env(), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.servers.append((name, proc, log, command))
        return len(self.servers) - 1

    def wait(self, which: list[int]) -> None:
        deadline = time.monotonic() + START_S
        for i in which:
            name, proc, log, command = self.servers[i]
            while not self.ready(command, log):
                assert proc.poll() is None, f"{name} exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"{name} did not start:\n{log.read_text()[-4000:]}"
                time.sleep(0.5)

    @staticmethod
    def ready(command: str, log: Path) -> bool:
        words = shlex.split(command)
        if words[:2] == ["kvsp", "relay"]:  # QUIC only: it says so when it listens
            return "relay listening on" in log.read_text(errors="replace")
        if is_engine(command):
            url = f"http://127.0.0.1:{words[words.index('--port') + 1]}/health"
        else:
            url = f"http://{words[words.index('--listen') + 1]}/healthz"
        try:
            return httpx.get(url, timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def url_of(self, kind: str) -> list[str]:
        out = []
        for _, _, _, command in self.servers:
            words = shlex.split(command)
            if kind == "vllm" and is_engine(command):
                out.append(f"http://127.0.0.1:{words[words.index('--port') + 1]}/")
            elif kind != "vllm" and words[:2] == ["kvsp", kind]:
                out.append(f"http://{words[words.index('--listen') + 1]}/")
        return out

    def kill(self, url: str) -> None:
        """SIGKILL an engine's process group: the API server, its engine core and worker."""
        for _, proc, _, command in self.servers:
            if is_engine(command) and f"--port {url.rstrip('/').rsplit(':', 1)[1]}" in command:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
                return
        raise AssertionError(f"no engine at {url}")

    def stop(self) -> None:
        for _, proc, _, _ in reversed(self.servers):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _, _ in self.servers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{log.read_text(errors='replace')[-3000:]}"
                         for name, _, log, _ in self.servers)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("vllm-gateway"))
    try:
        f.run(on_free_ports(readme_commands()))
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def text(fleet: Fleet) -> ModelText:
    return ModelText(fleet.workdir / "models" / "tiny")


@pytest.fixture
def client(fleet: Fleet) -> Iterator[openai.OpenAI]:
    with httpx.Client(trust_env=False, timeout=120) as http:
        yield openai.OpenAI(base_url=fleet.url_of("gateway")[0] + "v1", api_key="unused",
                            max_retries=0, http_client=http)


def direct(engine: str, tokens: list[int], n: int) -> list[int]:
    """An engine's greedy token ids for a prompt, asked without the gateway."""
    r = httpx.post(engine + "v1/completions", timeout=120, trust_env=False, json={
        "model": "models/tiny", "prompt": tokens, "max_tokens": n, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def shown(text: ModelText, ids: list[int]) -> str:
    """The text the gateway shows for output ids: up to an end of sequence, without it."""
    for i, t in enumerate(ids):
        if t in text.eos_ids:
            ids = ids[:i]
            break
    return text.decode(ids).strip()


def test_the_readme_commands_serve_vllm_behind_the_gateway(fleet: Fleet) -> None:
    answer = json.loads((fleet.workdir / "answer.json").read_text())
    assert answer["model"] == MODEL and answer["usage"]["completion_tokens"] >= 1
    assert answer["choices"][0]["text"].strip() in fleet.printed  # jq printed it
    assert len(fleet.url_of("vllm")) == 2
    # both engines report to the PC under their OpenAI URLs
    pc = fleet.url_of("index")[0]
    listed = {i["instance"] for i in httpx.get(pc + "instances", trust_env=False).json()["instances"]}
    assert listed == set(fleet.url_of("vllm")), listed


def test_completions_whole_and_streamed(fleet: Fleet, text: ModelText,
                                        client: openai.OpenAI) -> None:
    tokens = prompt(40, seed=3)
    expected = shown(text, direct(fleet.url_of("vllm")[0], tokens, 8))
    whole = client.completions.create(model=MODEL, prompt=tokens, max_tokens=8, temperature=0)
    assert whole.choices[0].text.strip() == expected
    assert whole.usage is not None and whole.usage.prompt_tokens == 40
    chunks = list(client.completions.create(model=MODEL, prompt=tokens, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip() == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 40


def test_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "system", "content": "You answer briefly."},
                     {"role": "user", "content": "w1 w2 w3 w4 w5 w6 w7 w8 w9"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage is not None and 1 <= whole.usage.completion_tokens <= 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, stream=True)
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == whole.choices[0].message.content


def test_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="no-such-model", prompt="w1", max_tokens=2)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:  # the gateway's own check
        client.completions.create(model=MODEL, prompt="w1", max_tokens=2, n=2)
    assert "n=1" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as long:  # the engine's, relayed
        client.completions.create(model=MODEL, prompt=prompt(1100, seed=4), max_tokens=2)
    assert "instance http://127.0.0.1:" in str(long.value)


def test_a_shared_prefix_is_loaded_from_kvsp(fleet: Fleet, client: openai.OpenAI) -> None:
    prefix = prompt(3 * BLOCK, seed=5)
    first = client.completions.create(model=MODEL, prompt=prefix + prompt(20, seed=6),
                                      max_tokens=2, temperature=0)
    assert first.usage is not None
    compat = compat_of(fleet.workdir / "models" / "tiny")
    keys = block_keys(OPEN_SCOPE_KEY, compat, prefix)
    eventually(lambda: all(records_of(fleet.url_of("index")[0], scope_id(OPEN_SCOPE_KEY).hex(),
                                      compat, keys)), "the prefix's records at the index")
    second = client.completions.create(model=MODEL, prompt=prefix + prompt(20, seed=7),
                                       max_tokens=2, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 3 * BLOCK, fleet.logs()


def running(engine: str) -> float:
    """vLLM's own gauge of the requests an engine runs now."""
    try:
        body = httpx.get(engine + "metrics", timeout=2, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", body, re.M)
    return sum(float(x) for x in found)


def gateway_metric(fleet: Fleet, name: str) -> float:
    body = httpx.get(fleet.url_of("gateway")[0] + "metrics", timeout=5, trust_env=False).text
    (value,) = re.findall(rf"^kvsp_gateway_{name} ([0-9.]+)$", body, re.M)
    return float(value)


def test_an_engine_killed_mid_stream(fleet: Fleet, text: ModelText,
                                     client: openai.OpenAI) -> None:
    """Last in this module: it leaves one engine."""
    engines = fleet.url_of("vllm")
    new = 300
    for seed in range(20, 30):  # a prompt whose greedy output has no early end of sequence
        tokens = prompt(2 * BLOCK + 16, seed=seed)
        reference = direct(engines[0], tokens, new)
        if len(reference) == new and not set(reference) & text.eos_ids:
            break
    else:
        raise AssertionError("no prompt of ten runs to max_tokens")
    before = gateway_metric(fleet, "continued")
    stream = client.completions.create(model=MODEL, prompt=tokens, max_tokens=new,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces: list[str] = []
    usage = None
    killed = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        pieces.append(chunk.choices[0].text)
        if killed is None:
            busy = [e for e in engines if running(e) > 0]
            assert len(busy) == 1, "the stream ended before an engine could be killed"
            killed = busy[0]
            fleet.kill(killed)
    assert killed is not None
    assert "".join(pieces).strip() == shown(text, reference)
    assert gateway_metric(fleet, "continued") == before + 1, fleet.logs()
    assert usage is not None and usage.completion_tokens == new
    # the survivor loaded the prompt's blocks from the holder rather than computing them
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 2 * BLOCK, fleet.logs()
