"""An agent in a process of its own, so that a test can kill it with SIGKILL.

    python -m tests.pc.agent_process '{"model": DIR, "index_url": URL, ...}'

The argument holds `AgentSettings` members (JSON); the agent listens on a free port of
127.0.0.1 and prints one line `{"url": ...}` once it serves, then runs until it is killed or
its standard input closes (so that it never outlives the test that started it).
"""

from __future__ import annotations

import json
import sys

from agent.service import Agent, AgentSettings


def main(argv: list[str]) -> int:
    options = json.loads(argv[1])
    options.setdefault("listen", "127.0.0.1:0")
    agent = Agent(AgentSettings(**options)).start()
    print(json.dumps({"url": agent.url}), flush=True)
    sys.stdin.read()  # returns when the parent goes away
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
